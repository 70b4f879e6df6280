"""One decode step as a single function over fixed buffers: forward, pick, advance.

Defined in chapter 05 (the KV cache); compiled and captured in chapter 07. Everything a
step reads or writes lives in a decode state, allocated once per cache shape: the newest
token of every row, its position and cache slot, the sampling settings, and the tokens the
steps picked. The step writes its results back into those same buffers, so the host only
has to launch it: a compiled step is one call, a captured one one replay, with no Python
between tokens. ``DecodeState`` is the state over chapter 05's contiguous cache; the paged
cache of chapter 12 has its own (``paged.PagedDecodeState``), and the same step runs on both.
"""

from __future__ import annotations

import torch

from ..cache.contiguous import KVCache
from ..sampling import PickMode, SamplingState, non_finite

MAX_AHEAD = 64  # the most decode steps a batch runs before the host reads its tokens
GREEDY = PickMode(True, False, 1)  # argmax, nothing per row: the mode of a batch of plain greedy rows


class StepBuffers:
    """What every decode state holds besides its cache, ``batch`` rows of each: the newest token and
    its position, a flag for non-finite logits, the last step's fp32 logits, the tokens picked since the
    host last loaded the rows (``picked``, ``ahead``), and the rows' sampling settings."""

    def __init__(self, batch: int, vocab_size: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.batch = batch
        self.token = torch.zeros(batch, 1, **long)  # the newest token, not yet in the cache
        self.positions = torch.zeros(batch, 1, **long)  # its position (RoPE)
        self.bad = torch.zeros(batch, dtype=torch.bool, device=device)  # NaN/Inf seen since the last load
        self.logits = torch.zeros(batch, vocab_size, device=device)  # fp32: rows picked on the host read these
        # the tokens picked since the host last loaded the rows, and how many: running ahead, the host reads
        # them all in one copy, and nothing runs between the steps
        self.picked = torch.zeros(batch, MAX_AHEAD, **long)  # (batch, MAX_AHEAD)
        self.ahead = torch.zeros(batch, 1, **long)  # (batch, 1)
        self.sampling = SamplingState(batch, vocab_size, device)  # the rows' settings
        self.graphs: dict = {}  # captured CUDA graphs, one per pick mode
        self.added: set[int] = set()  # rows whose sampling.add holds a request's adjustments
        self.order: list[int] = []  # the row of each sequence ``load`` was given, in its order
        self.rows: slice | list[int] = slice(0, 0)  # ``order`` as an index (see ``set_order``)

    def set_order(self, order: list[int]) -> None:
        """Where ``load``'s sequences sit. Rows 0..n-1 in order index as a slice: a view, where a list index
        would dispatch a gather (and on a GPU launch a kernel) for every buffer the host reads each step."""
        self.order = order
        self.rows = slice(0, len(order)) if order == list(range(len(order))) else order

    def record(self, token: torch.Tensor) -> None:
        """Make ``token`` (batch,) every row's newest token and keep it among the picks."""
        self.token.copy_(token[:, None])
        self.picked.scatter_(1, self.ahead.clamp(max=MAX_AHEAD - 1), token[:, None])  # (batch, MAX_AHEAD)
        self.ahead += 1

    # ------------------------------------------------------- the rows' sampling (the token loop)
    def load_sampling(self, samplers: list) -> PickMode:
        """Copy the loaded rows' sampling settings (one ``RowSampler`` each, in ``order``), their seen tokens
        and fresh noise into the buffers, for a pick inside the step -> the batch's pick mode. Each row draws
        its noise from its own seeded generator, as many values as it draws alone, so it picks what it would
        pick alone. Rows that sit the step out keep the settings of a plain greedy row."""
        modes = [s.mode for s in samplers]
        greedy = all(m.greedy for m in modes)
        penalize = any(m.penalize for m in modes) or any(s.adjust is not None for s in samplers)
        candidates = max(m.candidates for m in modes)
        if greedy and not penalize:
            return GREEDY
        # the values SamplingState.load gives each row alone, from the host's copy of its settings
        values = [[1.0, 1.0, 1.0, 0.0, 1.0]] * self.batch
        for row, s in zip(self.order, samplers):
            p = s.params
            values[row] = [1.0 if p.greedy else p.temperature, p.top_p, p.repetition_penalty, float(p.top_k),
                           float(p.greedy)]
        host = torch.tensor(values)  # (batch, 5): one host tensor, not one per row
        sp = self.sampling  # (batch, 1) each
        sp.temperature.copy_(host[:, 0:1])
        sp.top_p.copy_(host[:, 1:2])
        sp.penalty.copy_(host[:, 2:3])
        sp.top_k.copy_(host[:, 3:4].long())
        sp.greedy_rows.copy_(host[:, 4:5].bool())
        if penalize:
            sp.seen[self.rows] = torch.cat([s.state.seen for s in samplers])  # (rows, vocab)
        if not greedy:
            if candidates not in sp.noise:
                sp.noise[candidates] = torch.ones(self.batch, candidates, device=self.token.device)
            self.draw_noise(samplers, candidates)
        self.load_adjustments([s.adjust for s in samplers])
        # every mode but plain greedy adjusts (with zeros and no floor for rows that ask for nothing):
        # one variant per mode, not two, keeps the step's variants under dynamo's recompile limit
        return PickMode(greedy, penalize, candidates, adjusted=True)

    def draw_noise(self, samplers: list, candidates: int) -> None:
        """Fresh Exp(1) noise for the next pick: each sampled row draws from its own generator as
        many values as it draws alone (columns past its own candidates hold probability 0: never picked)."""
        noise = self.sampling.noise[candidates]
        for row, s in zip(self.order, samplers):
            if not s.mode.greedy:
                s.state._fill(noise[row:row + 1, :s.mode.candidates], "exponential")

    def load_adjustments(self, adjusts: list) -> None:
        """Copy the rows' ``LogitsAdjust`` vectors and min_p floors (None: nothing) into the buffers."""
        sp = self.sampling
        if sp.add is None:  # made on first use: (batch, vocab), as large as the logits
            sp.add = torch.zeros(self.batch, sp.vocab_size, device=self.token.device)
            sp.floor = torch.full((self.batch, 1), float("-inf"), device=self.token.device)
            self.marked_dynamic = False  # the compiled step marks the new buffers' batch size symbolic too
        given = {row: a for row, a in zip(self.order, adjusts) if a is not None}
        stale = sorted(self.added - set(given))  # rows that held another request's vector last step
        if stale:
            sp.add[stale] = 0.0
        if given:
            sp.add[list(given)] = torch.stack(list(a.add for a in given.values()))  # (adjusted rows, vocab)
        self.added = set(given)
        floors = torch.full((self.batch, 1), float("-inf"))
        for row, a in given.items():
            floors[row, 0] = a.floor_value
        sp.floor.copy_(floors)

    # ------------------------------------------- what CompiledStep's warm-up saves and restores
    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the buffers a step advances (used around warm-up runs before a capture)."""
        return [t.clone() for t in self._advanced()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._advanced(), saved):
            t.copy_(s)

    def _advanced(self) -> list[torch.Tensor]:
        return [self.token, self.positions, self.ahead, self.picked, self.bad, self.sampling.seen]

    def row_buffers(self) -> list[torch.Tensor]:
        """Every buffer with one row per batch row (the compiled step keeps their batch size symbolic)."""
        return [self.token, self.positions, self.bad, self.picked, self.ahead, self.logits,
                *[t for t in vars(self.sampling).values() if isinstance(t, torch.Tensor)], *self.sampling.noise.values()]


class DecodeState(StepBuffers):
    """The fixed device buffers of a decode step over one contiguous cache: one row per cache row.

    Row r of the step is row r of the cache. ``cache_pos`` is the slot each row's newest token writes
    (its position: a sequence's position p lives in slot p of its row); a row that sits out the step
    writes to its row's scratch slot instead (``load``). ``padded``: rows stand at different positions,
    so an eager step over the first ``kv_len`` slots masks by slot (``key_valid``), as the fixed-shape
    step always does.
    """

    def __init__(self, cache: KVCache, vocab_size: int, device: torch.device):
        super().__init__(cache.batch, vocab_size, device)
        self.cache, self.kv = cache, cache.layers()
        self.cache_pos = torch.zeros(cache.batch, 1, dtype=torch.long, device=device)  # the slot it writes
        self.key_valid = torch.ones(cache.batch, cache.max_len, dtype=torch.bool, device=device)  # no padding slots
        self.padded = False
        self.read_span = 0  # host side: slots an eager step reads, the furthest row's newest slot + 1

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def load(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Copy this step's rows into the buffers: sequence i, whose block table is its cache row
        ``tables[i][0]``, has newest token ``tokens[i]`` at ``positions[i]``. The other rows sit the
        step out: their newest token (0) writes to the scratch slot, and their pick is not read."""
        b, scratch = self.batch, self.cache.scratch_slot
        rows = [[0, 0, scratch]] * b
        self.set_order([table[0] for table in tables])
        for tok, pos, row in zip(tokens, positions, self.order):
            rows[row] = [tok, pos, pos]
        host = torch.tensor(rows)  # (batch, 3): token, position, slot; one host tensor, not one per row
        self.token.copy_(host[:, :1])
        self.positions.copy_(host[:, 1:2])
        self.cache_pos.copy_(host[:, 2:3])
        self.ahead.zero_()
        self.bad.zero_()
        self.padded = len(tokens) < b or len(set(positions)) > 1
        self.read_span = max(positions) + 1

    def prepare(self) -> None:
        """Nothing to do: the contiguous cache's slots are ``cache_pos`` itself (the paged state,
        ``paged.py``, computes its physical slots here)."""

    def advance(self, token: torch.Tensor) -> None:
        """Make ``token`` (batch,) the newest one and move every row on by one slot."""
        self.record(token)
        self.positions += 1
        self.cache_pos += 1

    def _advanced(self) -> list[torch.Tensor]:
        return [*super()._advanced(), self.cache_pos]

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(buffer, dim) pairs a compiled step keeps symbolic: batch (from 2 on) and cache length."""
        b = self.batch
        dims = [(t, 0) for t in [*self.row_buffers(), self.cache_pos, self.key_valid, *self.cache.buffers]
                if b > 1 and t.shape[0] == b]
        dims += [(t, 2) for t in self.cache.buffers]  # (batch, kv_heads, max_len[, head_dim])
        return dims + [(self.key_valid, 1)]  # (batch, max_len)


def decode_step(model, st, mode: PickMode, kv_len: int | None) -> None:
    """Forward the newest token, pick the next one, and move every buffer on by one slot.

    ``kv_len=None`` is the fixed-shape form (compiled, captured): attention reads the whole
    cache and a mask built here from the buffers hides unwritten and padding slots. An
    integer reads just the first ``kv_len`` slots (the eager rungs). The state may be the engine's
    contiguous one (``DecodeState``) or the server's paged one (``paged.py``): the same
    step makes every decoded token.
    """
    st.prepare()
    key_valid = st.key_valid if kv_len is None or st.padded else None
    logits = model(st.token, st.positions, st.kv, st.cache_pos, key_valid, kv_len, last_only=True)[:, -1]
    st.logits.copy_(logits)  # fp32, exact: the check and the pick read it (on a CPU, bf16 reductions are slower)
    st.bad |= non_finite(st.logits)  # read by the host at its next sync, not now
    st.advance(st.sampling.pick(st.logits, mode))  # the picked token: (batch,)
