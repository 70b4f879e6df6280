"""Prefill and decode over a preallocated KV cache: the cached rungs' token engine.

Defined in chapter 05 (the KV cache); the compiled, graph-captured step in chapter 07.
The runner owns one ``DecodeState`` (cache + step buffers) at a time, sized in buckets
of ``CACHE_BUCKET`` slots and kept while requests fit it. It hands the model every fact
about a step explicitly: positions, the cache slots to write, how far to read.
"""

from __future__ import annotations

import torch

from ..cache.contiguous import KVCache
from ..errors import ContextLengthError
from ..model.qwen2 import Qwen2ForCausalLM
from ..sampling.pick import SamplingParams, non_finite
from .compiled import CompiledStep
from .decode import DecodeState, decode_step


def usable_context(cfg, max_model_len: int | None) -> int:
    """The one name for the context length, ``max_model_len`` (vLLM's): the positions prompt + new tokens may
    fill. A fixed ``max_model_len`` where one is given, never past the model's ``max_position_embeddings``."""
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def check_fits(needed: int, max_model_len: int, what: str) -> None:
    """The engine path's one context check: prompt + new tokens (``needed``) must fit ``max_model_len`` positions."""
    if needed > max_model_len:
        raise ContextLengthError(f"prompt + max_new_tokens = {needed} tokens exceeds {what} "
                                 f"({max_model_len}); shorten the prompt or ask for fewer tokens")


CACHE_BUCKET = 256  # cache lengths are rounded up to this, so buffers (and captured graphs) get reused


class CachedRunner:
    """Prefill once, then one token per ``decode()``.

    ``static=True`` decodes with the fixed-shape step (it reads the whole cache buffer
    and masks what is not written yet), compiled when ``compile_step`` and captured as
    a CUDA graph when ``cuda_graph`` (see ``CompiledStep``). Otherwise each step reads
    exactly the slots written so far, eagerly.
    """

    def __init__(self, model: Qwen2ForCausalLM, compile_step: bool = False, cuda_graph: bool = False,
                 max_model_len: int | None = None):
        self.model = model
        cfg = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self.static = compile_step or self.cuda_graph
        key = (cfg, self.dtype, model.options, self.device.type)
        self.fast = CompiledStep(compile_step, self.cuda_graph, key) if self.static else None
        self.fixed_len = max_model_len  # a cache of exactly this length, where the caller fixed one
        self.max_model_len = usable_context(cfg, max_model_len)
        self.state: DecodeState | None = None

    @property
    def step_form(self) -> str:
        """How decode steps run now: 'cuda_graph', 'compiled' or 'eager'."""
        return self.fast.form if self.fast is not None else "eager"

    @property
    def fallbacks(self) -> list[str]:
        """What made the compiled step fall back, in order (empty: it did not, or there is none)."""
        return self.fast.fallbacks if self.fast is not None else []

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache the runner holds now (0 before its first prefill)."""
        return self.state.cache.nbytes if self.state is not None else 0

    def check_fits(self, needed: int) -> None:
        check_fits(needed, self.max_model_len, "max_model_len" if self.fixed_len else "the model's max_position_embeddings")

    def _state_for(self, batch: int, needed: int) -> DecodeState:
        self.check_fits(needed)
        length = self.fixed_len or min(-(-needed // CACHE_BUCKET) * CACHE_BUCKET, self.max_model_len)
        st = self.state
        if st is None or st.batch != batch or st.max_len != length:
            self.state = None  # free the old buffers (and graphs) before allocating new ones
            cfg = self.model.config
            cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, length,
                            self.dtype, self.device)
            st = self.state = DecodeState(cache, cfg.vocab_size, self.device)
        return st

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, sampling: list[SamplingParams],
                max_new_tokens: int) -> torch.Tensor:
        """Run the prompt (batch, prompt_len), left-padded where ``valid`` is False, through the
        model, fill the cache, and pick the first new token: -> (batch,) token ids."""
        b, t = input_ids.shape
        st = self._state_for(b, t + max_new_tokens)
        st.padded = valid is not None and not bool(valid.all())
        st.key_valid.fill_(True)
        cache_pos = torch.arange(t, device=self.device).expand(b, t)  # (batch, prompt_len)
        if st.padded:
            st.key_valid[:, :t] = valid  # padding slots stay hidden for the whole request
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # every row counts from 0
        else:
            positions = cache_pos
        mode = st.sampling.load(sampling)
        st.sampling.observe(input_ids, valid)
        logits = self.model(input_ids, positions, st.kv, cache_pos, st.key_valid if st.padded else None,
                            kv_len=t, last_only=True)[:, -1]  # (batch, vocab)
        st.bad.copy_(non_finite(logits))
        st.logits.copy_(logits)
        st.sampling.draw_noise()
        token = st.sampling.pick(logits, mode)
        st.history[:, :t] = input_ids
        st.history[:, t] = token
        st.token.copy_(token[:, None])
        st.positions.copy_(positions[:, -1:] + 1)
        st.cache_pos.fill_(t)
        st.prompt_len, st.length = t, t + 1
        return token

    @torch.inference_mode()
    def decode(self) -> None:
        """One step: the newest token in, the next one into ``state.history``. No host sync."""
        st = self.state
        if st.length >= st.max_len:
            raise ContextLengthError(f"the KV cache is full ({st.max_len} slots)")
        st.sampling.draw_noise()
        if self.fast is not None:
            self.fast(self.model, st, st.sampling.mode)
        else:
            decode_step(self.model, st, st.sampling.mode, kv_len=st.length)
        st.length += 1

    @torch.inference_mode()
    def verify(self, draft: torch.Tensor) -> torch.Tensor:
        """Forward the newest token and ``k`` drafted ones, draft (batch, k), in one call over the cache.

        -> fp32 logits (batch, k + 1, vocab): position i scores the token that follows input i.
        Each row writes its k + 1 slots from its own ``cache_pos`` (rows may sit at different
        slots); the slots ``advance`` does not keep are simply overwritten later (speculative
        decoding, chapter 11).
        """
        st = self.state
        k = draft.shape[1]
        steps = torch.arange(k + 1, device=self.device)
        slots = st.cache_pos + steps  # (batch, k + 1)
        last = st.length - 1 + k  # the newest token sits in slot length - 1 of the furthest row
        if last >= st.max_len:
            raise ContextLengthError(f"the KV cache is full ({st.max_len} slots, slot {last} asked for)")
        inputs = torch.cat([st.token, draft], dim=1)  # (batch, k + 1)
        logits = self.model(inputs, st.positions + steps, st.kv, slots, st.key_valid, kv_len=last + 1)
        st.bad |= non_finite(logits).flatten(1).any(dim=-1)  # read by the host at its next sync
        return logits.float()

    @torch.inference_mode()
    def advance(self, accepted: torch.Tensor, next_token: torch.Tensor, draft: torch.Tensor,
                active: torch.Tensor) -> None:
        """Keep the first ``accepted[r]`` drafted tokens of row r and make ``next_token[r]`` its
        newest token; rows where ``active`` is False stay where they are. Nothing is recomputed:
        the kept keys and values are already in the cache, and the write position moves past them."""
        st = self.state
        rows = torch.arange(draft.shape[0], device=self.device)[:, None]
        k = draft.shape[1]
        step = (accepted + 1) * active  # (batch,)
        st.history[rows, st.cache_pos + 1 + torch.arange(k, device=self.device)] = draft  # kept ones survive
        st.history[rows[:, 0], st.cache_pos[:, 0] + step] = torch.where(active, next_token,
                                                                         st.history[rows[:, 0], st.cache_pos[:, 0]])
        st.token.copy_(torch.where(active, next_token, st.token[:, 0])[:, None])
        st.cache_pos += step[:, None]
        st.positions += step[:, None]
        st.length = int(st.cache_pos.max()) + 1

    def new_tokens(self, start: int, end: int) -> torch.Tensor:
        """Generated tokens start..end-1 of every row, on the host: (batch, end - start). Syncs."""
        st = self.state
        return st.history[:, st.prompt_len + start: st.prompt_len + end].cpu()

    def bad_rows(self) -> list[int]:
        """Rows whose logits held NaN or Inf at some step so far. Syncs."""
        return torch.nonzero(self.state.bad).flatten().tolist()
