"""Prefill and decode steps over a preallocated KV cache, optionally compiled and graph-captured.

Defined in chapter 05 (the KV cache); compilation and CUDA graphs in chapter 07.
"""

from __future__ import annotations

import warnings

import torch

from .errors import ContextLengthError
from .kv_cache import KVCache
from .model import Qwen2ForCausalLM

CACHE_BUCKET = 256  # cache lengths are rounded up to this, so compiled shapes get reused


class CachedRunner:
    """Owns the KV cache and the decode step of one model.

    ``compile_decode`` compiles the decode step with torch.compile (fixed shapes: it reads
    the whole cache buffer and masks what is not written yet). On CUDA, ``cuda_graph``
    also captures that step once per cache shape and replays it for every token.
    """

    def __init__(self, model: Qwen2ForCausalLM, compile_decode: bool = False, cuda_graph: bool = False,
                 max_cache_len: int | None = None):
        self.model = model
        cfg = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.static = compile_decode or cuda_graph
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self.max_cache_len = max_cache_len
        self.limit = min(max_cache_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache: KVCache | None = None
        self._step = self._decode_forward
        if compile_decode:
            self._step = torch.compile(self._decode_forward, fullgraph=True, dynamic=False)
        self._graphs: dict[tuple, tuple] = {}
        self._pos = 0

    def _cache_for(self, batch: int, needed: int) -> KVCache:
        if needed > self.limit:
            what = "max_cache_len" if self.max_cache_len else "the model's max_position_embeddings"
            raise ContextLengthError(f"prompt + max_new_tokens = {needed} tokens exceeds {what} "
                                     f"({self.limit}); shorten the prompt or ask for fewer tokens")
        length = self.max_cache_len or min(-(-needed // CACHE_BUCKET) * CACHE_BUCKET, self.limit)
        c = self.cache
        if c is None or c.k.shape[1] != batch or c.max_len != length:
            self.cache = None  # free the old buffers before allocating new ones
            cfg = self.model.config
            c = self.cache = KVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim,
                                     length, self.dtype, self.device)
            c.decode_pos = torch.zeros(1, dtype=torch.long, device=self.device)
            c.decode_positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
            c.decode_token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        return c

    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor | None, max_new_tokens: int) -> torch.Tensor:
        """Run the prompt (batch, prompt_len) through the model, filling the cache. -> (batch, vocab)."""
        b, t = input_ids.shape
        c = self._cache_for(b, t + max_new_tokens)
        c.padded = valid is not None and not bool(valid.all())
        if not c.padded and not self.static:
            c.key_valid = None
            positions = torch.arange(t, device=self.device).expand(b, t)
        else:
            c.key_valid = c.key_valid_buffer
            c.key_valid.fill_(True)
            if c.padded:
                c.key_valid[:, :t] = valid  # padding keys stay hidden for the whole request
            positions = (c.key_valid[:, :t].long().cumsum(-1) - 1).clamp(min=0)  # left padding: rows count from 0
        c.write_pos, c.read_len = torch.arange(t, device=self.device), t
        logits = self.model(input_ids, positions, c, last_only=True)[:, -1]
        c.decode_positions.copy_(positions[:, -1:] + 1)
        c.decode_pos.fill_(t)
        self._pos = t
        return logits

    def _decode_forward(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(token, positions, self.cache, last_only=True)[:, -1]

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """One step: token (batch,) at the next position -> logits (batch, vocab)."""
        c = self.cache
        c.decode_token.copy_(token[:, None])
        c.write_pos = c.decode_pos
        c.read_len = None if self.static else self._pos + 1
        if self.cuda_graph:
            logits = self._graph_step()
        else:
            logits = self._step(c.decode_token, c.decode_positions)
        # advance on the device: no host sync, and the graph's inputs keep their addresses
        c.decode_pos += 1
        c.decode_positions += 1
        self._pos += 1
        return logits

    def _graph_step(self) -> torch.Tensor:
        c = self.cache
        key = (id(c), c.k.shape)
        if key not in self._graphs:
            try:
                self._graphs = {key: self._capture()}  # one cache at a time: drop old graphs
            except Exception as exc:  # keep generating, just without the graph
                warnings.warn(f"CUDA graph capture failed, decoding without it: {exc}", stacklevel=3)
                self.cuda_graph = False
                return self._step(c.decode_token, c.decode_positions)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        c = self.cache
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (and compile) outside the capture
            for _ in range(2):
                self._step(c.decode_token, c.decode_positions)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(c.decode_token, c.decode_positions)
        return graph, out
