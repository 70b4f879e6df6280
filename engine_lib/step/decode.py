"""One decode step as a single function over fixed buffers: forward, pick, advance.

Defined in chapter 05 (the KV cache); compiled and captured in chapter 07. Everything a
step reads or writes lives in ``DecodeState``, allocated once per cache shape: the newest
token, its position and cache slot, which slots hold padding, every token so far, and
the sampling settings. The step writes its results back into those same buffers, so the
host only has to launch it: a compiled step is one call, a captured one one replay,
with no Python between tokens.
"""

from __future__ import annotations

import torch

from ..cache.contiguous import KVCache
from ..sampling.pick import PickMode, SamplingState, non_finite


class DecodeState:
    """The fixed device buffers of one (batch, max_len) cache."""

    def __init__(self, cache: KVCache, vocab_size: int, device: torch.device):
        b, s = cache.batch, cache.max_len
        self.cache, self.kv = cache, cache.layers()
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(b, 1, **long)  # the newest token, not yet in the cache
        self.positions = torch.zeros(b, 1, **long)  # its RoPE position (rows differ under left padding)
        self.cache_pos = torch.zeros(b, 1, **long)  # the slot its keys/values go to
        self.key_valid = torch.ones(b, s, dtype=torch.bool, device=device)  # False: a padding slot
        self.history = torch.zeros(b, s, **long)  # the token id at every slot, prompt and generated
        self.bad = torch.zeros(b, dtype=torch.bool, device=device)  # NaN/Inf seen in a row's logits
        self.logits = torch.zeros(b, vocab_size, device=device)  # the last step's fp32 logits (tests, verify)
        self.sampling = SamplingState(b, vocab_size, device)
        self.graphs: dict[PickMode, object] = {}  # captured CUDA graphs, one per pick mode
        # host-side facts about the current request
        self.padded = False
        self.prompt_len = 0
        self.length = 0  # slots a step reads: everything written so far plus the newest token's

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the buffers a step advances (used around warm-up runs before a capture)."""
        return [t.clone() for t in self._advanced()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._advanced(), saved):
            t.copy_(s)

    def _advanced(self) -> list[torch.Tensor]:
        return [self.token, self.positions, self.cache_pos, self.bad, self.sampling.seen]

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(buffer, dim) pairs a compiled step keeps symbolic: batch (from 2 on) and cache length."""
        b = self.batch
        buffers = [self.token, self.positions, self.cache_pos, self.key_valid, self.history, self.bad, self.logits,
                   *[t for t in vars(self.sampling).values() if isinstance(t, torch.Tensor)],
                   *self.sampling.noise.values()]
        dims = [(t, 0) for t in buffers + self.cache.k + self.cache.v if b > 1 and t.shape[0] == b]
        dims += [(t, 2) for t in self.cache.k + self.cache.v]  # (batch, kv_heads, max_len, head_dim)
        return dims + [(self.key_valid, 1), (self.history, 1)]  # (batch, max_len)

    def prepare(self) -> None:
        """Nothing to do: the contiguous cache's slots are ``cache_pos`` itself (the paged state,
        ``paged_step.py``, computes its physical slots here)."""

    def advance(self, token: torch.Tensor) -> None:
        """Make ``token`` (batch,) the newest one and move every buffer on by one slot."""
        self.token.copy_(token[:, None])
        self.positions += 1
        self.cache_pos += 1
        rows = torch.arange(token.shape[0], device=token.device)
        self.history[rows, self.cache_pos[:, 0]] = token


def decode_step(model, st: DecodeState, mode: PickMode, kv_len: int | None) -> None:
    """Forward the newest token, pick the next one, and move every buffer on by one slot.

    ``kv_len=None`` is the fixed-shape form (compiled, captured): attention reads the whole
    cache and a mask built here from the buffers hides unwritten and padding slots. An
    integer reads just the first ``kv_len`` slots (the eager rungs). The state may be the engine's
    contiguous one (``DecodeState``) or the server's paged one (``paged_step.py``): the same
    step makes every decoded token.
    """
    st.prepare()
    key_valid = st.key_valid if kv_len is None or st.padded else None
    logits = model(st.token, st.positions, st.kv, st.cache_pos, key_valid, kv_len, last_only=True)[:, -1]
    st.logits.copy_(logits)  # fp32, exact: the check and the pick read it (on a CPU, bf16 reductions are slower)
    st.bad |= non_finite(st.logits)  # read by the host at its next sync, not now
    st.advance(st.sampling.pick(st.logits, mode))  # the picked token: (batch,)
