"""The server's decode batches run the engine's own ``decode_step``, over the paged cache.

Defined in chapter 12 (serving many users). A decode batch is padded to a *bucket* (a batch
size from ``BATCH_BUCKETS``) and reads a fixed span of positions (a multiple of
``SPAN_BUCKET``), so one ``PagedDecodeState`` per (bucket, span) holds every buffer the step
reads: the newest tokens, their positions and the block tables. The step computes its physical
slots from those on the device (``prepare``), so it is the same fixed-shape function as the
engine's step: compiled once, captured as a CUDA graph per bucket on a GPU, and replayed with
only the host's copies of tokens, positions and tables in between.

Padding rows are harmless by construction: their block table is all scratch block, so they
write only there and read only there, and no real row's table ever holds the scratch block.
"""

from __future__ import annotations

import torch

from ..cache.paged import SCRATCH_BLOCK, ZERO_BLOCK, PagedKVCache
from ..sampling.pick import PickMode, SamplingState
from .decode import DecodeState

# nano-vllm's and vLLM's choice: small sizes one by one, then steps of 16
BATCH_BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))
SPAN_BUCKET = 256  # read spans are rounded up to a multiple of this
MAX_AHEAD = 64  # the most decode steps a batch runs before the host reads its tokens (``decode_steps``)
GREEDY = PickMode(True, False, 1)  # argmax, nothing per row: the mode of a batch of plain greedy rows


def batch_bucket(rows: int, smallest: int = 1) -> int:
    """The bucket a decode batch of ``rows`` is padded to (at least ``smallest``)."""
    need = max(rows, smallest)
    for b in BATCH_BUCKETS:
        if b >= need:
            return b
    raise ValueError(f"{rows} rows exceed the largest decode bucket ({BATCH_BUCKETS[-1]})")


def span_bucket(longest: int, limit: int) -> int:
    """The read span for rows whose longest needs ``longest`` positions: a multiple of ``SPAN_BUCKET``,
    at most ``limit`` (the context rounded up to whole blocks)."""
    return min(-(-longest // SPAN_BUCKET) * SPAN_BUCKET, limit)


class PagedDecodeState:
    """The fixed buffers of one (bucket, span) decode batch over the paged cache.

    It answers what ``decode_step`` asks of a state (``prepare``, ``kv``, ``advance``, the
    sampling buffers), and what the paged layers ask of a slot source (``write_slots``,
    ``read_slots``, ``tables``, ``read_len``).
    """

    def __init__(self, cache: PagedKVCache, batch: int, read_len: int, vocab_size: int):
        bs, device = cache.block_size, cache.device
        if read_len % bs:
            raise ValueError(f"read span {read_len} is not a whole number of {bs}-token blocks")
        long = dict(dtype=torch.long, device=device)
        self.batch, self.read_len, self.block_size = batch, read_len, bs
        self.token = torch.zeros(batch, 1, **long)  # the newest token of each row
        self.positions = torch.zeros(batch, 1, **long)  # its logical position (also the model's cache_pos)
        self.cache_pos = self.positions  # the model's mask compares logical positions
        self.tables = torch.full((batch, read_len // bs), SCRATCH_BLOCK, **long)  # (batch, blocks)
        self.key_valid = torch.ones(batch, read_len, dtype=torch.bool, device=device)  # no padding slots
        self.span = torch.arange(read_len, **long)  # (read_len,) the logical positions read
        self.write_slots = torch.zeros(batch, **long)  # (batch,) computed by prepare
        self.read_slots = torch.zeros(batch * read_len, **long)  # (batch * read_len,)
        self.bad = torch.zeros(batch, dtype=torch.bool, device=device)  # cleared by ``load``, so steps run ahead add up
        # the tokens picked since the host last loaded the batch, and how many: running ahead, the host reads them
        # all in one copy, and nothing runs between the steps
        self.picked = torch.zeros(batch, MAX_AHEAD, **long)  # (batch, MAX_AHEAD)
        self.ahead = torch.zeros(batch, 1, **long)  # (batch, 1)
        self.logits = torch.zeros(batch, vocab_size, device=device)  # fp32: rows picked on the host read these
        self.sampling = SamplingState(batch, vocab_size, device)  # rows' settings, loaded every step
        self.kv = cache.layers(self)
        self.pool = [*cache.k, *cache.v]  # (slots, kv_heads, head_dim) each: the cache's whole pool of blocks
        self.graphs: dict = {}  # captured CUDA graphs, one per pick mode
        self.added: set[int] = set()  # rows whose sampling.add holds a request's adjustments
        self.padded = False

    @property
    def max_len(self) -> int:
        return self.read_len

    def load(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Copy this step's rows into the buffers; rows past ``len(tokens)`` become padding.

        Real rows read zeros past their blocks (masked anyway), never the scratch block; padding
        rows hold nothing but the scratch block. One host tensor, three copies."""
        width = self.tables.shape[1]
        rows = [[tok, pos, 0, *t[:width], *[ZERO_BLOCK] * (width - len(t[:width]))]
                for tok, pos, t in zip(tokens, positions, tables)]
        rows += [[0, 0, 0, *[SCRATCH_BLOCK] * width]] * (self.batch - len(rows))
        host = torch.tensor(rows)  # (batch, 3 + blocks): token, position, picks so far (none), block table
        self.token.copy_(host[:, :1])
        self.positions.copy_(host[:, 1:2])
        self.ahead.copy_(host[:, 2:3])
        self.tables.copy_(host[:, 3:])
        self.bad.zero_()

    def load_sampling(self, samplers: list) -> PickMode:
        """Copy the rows' sampling settings, their seen tokens and fresh noise into the buffers, for a
        pick inside the step -> the batch's pick mode. Each row draws its noise from its own seeded
        generator, as many values as it draws alone, so it picks what it would pick alone."""
        modes = [s.mode for s in samplers]
        greedy = all(m.greedy for m in modes)
        penalize = any(m.penalize for m in modes) or any(s.adjust is not None for s in samplers)
        candidates = max(m.candidates for m in modes)
        if greedy and not penalize:
            return GREEDY
        states, params = [s.state for s in samplers], [s.params for s in samplers]
        pad = self.batch - len(states)
        # the values SamplingState.load gives each row alone, from the host's copy of its settings
        host = torch.tensor([[1.0 if p.greedy else p.temperature, p.top_p, p.repetition_penalty, float(p.top_k),
                              float(p.greedy)] for p in params] + [[1.0, 1.0, 1.0, 0.0, 1.0]] * pad)
        sp = self.sampling  # (batch, 1) each
        sp.temperature.copy_(host[:, 0:1])
        sp.top_p.copy_(host[:, 1:2])
        sp.penalty.copy_(host[:, 2:3])
        sp.top_k.copy_(host[:, 3:4].long())
        sp.greedy_rows.copy_(host[:, 4:5].bool())
        if penalize:
            sp.seen[:len(states)].copy_(torch.cat([st.seen for st in states]))  # (rows, vocab)
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
        for i, s in enumerate(samplers):
            if not s.mode.greedy:
                s.state._fill(noise[i:i + 1, :s.mode.candidates], "exponential")

    def load_adjustments(self, adjusts: list) -> None:
        """Copy the rows' ``LogitsAdjust`` vectors and min_p floors (None: nothing) into the buffers."""
        sp = self.sampling
        if sp.add is None:  # made on first use: (batch, vocab), as large as the logits
            sp.add = torch.zeros(self.batch, sp.vocab_size, device=self.token.device)
            sp.floor = torch.full((self.batch, 1), float("-inf"), device=self.token.device)
            self.marked_dynamic = False  # the compiled step marks the new buffers' batch size symbolic too
        rows = [i for i, a in enumerate(adjusts) if a is not None]
        stale = sorted(self.added - set(rows))  # rows that held another request's vector last step
        if stale:
            sp.add[stale] = 0.0
        if rows:
            sp.add[rows] = torch.stack([adjusts[i].add for i in rows])  # (adjusted rows, vocab)
        self.added = set(rows)
        floors = [a.floor_value if a is not None else float("-inf") for a in adjusts]
        sp.floor.copy_(torch.tensor(floors + [float("-inf")] * (self.batch - len(adjusts)))[:, None])

    def prepare(self) -> None:
        """Each row's physical slots, computed from its block table on the device (inside the step)."""
        bs = self.block_size
        pos = self.positions  # (batch, 1)
        self.write_slots.copy_((self.tables.gather(1, pos // bs) * bs + pos % bs)[:, 0])
        slots = self.tables[:, self.span // bs] * bs + self.span % bs  # (batch, read_len)
        # past the newest token: the zero block, never a stale (maybe non-finite) value of a freed block
        self.read_slots.copy_(torch.where(self.span <= pos, slots, ZERO_BLOCK * bs).flatten())

    def advance(self, token: torch.Tensor) -> None:
        """Keep the picked tokens (batch,) and move every row on by one position, on the device: a step that
        runs ahead of the host (``load`` not called) decodes the token the last one picked, and its slots follow
        from the tables. The host reads ``picked`` when it plans the next batch."""
        self.token.copy_(token[:, None])
        self.picked.scatter_(1, self.ahead.clamp(max=MAX_AHEAD - 1), token[:, None])  # (batch, MAX_AHEAD)
        self.ahead += 1
        self.positions += 1

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """Batch (from 2 on), read span and the cache's pool of slots stay symbolic in the compiled step: one
        compile serves every bucket, and every cache (an engine sizes its own to each call's rows)."""
        per_row = [self.token, self.positions, self.tables, self.key_valid, self.write_slots, self.bad,
                   self.picked, self.ahead, self.logits,
                   *[t for t in vars(self.sampling).values() if isinstance(t, torch.Tensor)], *self.sampling.noise.values()]
        dims = [(t, 0) for t in per_row if self.batch > 1]
        return dims + [(self.tables, 1), (self.key_valid, 1), (self.span, 0), (self.read_slots, 0),
                       *[(t, 0) for t in self.pool]]

    # what CompiledStep's warm-up before a capture saves and restores
    snapshot = DecodeState.snapshot
    restore = DecodeState.restore

    def _advanced(self) -> list[torch.Tensor]:
        return [self.token, self.positions, self.ahead, self.bad, self.sampling.seen]
