"""What a chapter holds in memory at once, priced at the real model's shape.

Defined in chapter 00. A free Colab T4 has 15 GB; an fp32 Qwen2.5-1.5B is 6.2 GB, so two of
them side by side leave no room for the CUDA context, activations and the KV cache. CI runs
the chapters on small random checkpoints, where every model is tiny, so it cannot see this
by measuring. Instead, while a budget is active, every model and KV cache the engine (or
``load_hf_model``) creates is priced as if it had the real shape and dtype, and released
when Python frees it. The chapter ends by checking the peak against the T4 budget, and
that no two fp32 models were ever held at once: together they take 11.5 GiB, which leaves
a T4 too little for the CUDA context, activations, caches and a reader's experiments.
"""

from __future__ import annotations

import textwrap
import weakref
from dataclasses import dataclass

import torch

from ..tracking import listen
from . import WIDTH

T4_BUDGET_GIB = 13.0  # of a T4's 15 GB: the rest is the CUDA context, the allocator's slack and the kernels
WORKSPACE_GIB = 0.5  # activations of the largest forward a chapter runs (a 2k-token prefill in fp32)
ACTIVE: MemoryBudget | None = None


def note(obj, what: str) -> None:
    """Hears every model and KV cache the engine makes (``tracking.note``); a no-op unless a budget is active."""
    if ACTIVE is not None:
        ACTIVE.add(obj, what)


listen(note)  # the engine announces, the budget listens: no engine file imports this module


def _real_config():
    from ..model.checkpoints import preset_config

    return preset_config("qwen2.5-1.5b-random")  # exactly the real model's shape


def real_shape_bytes(obj, what: str) -> int:
    """The bytes ``obj`` would take at the real model's shape, in its own dtype."""
    cfg = _real_config()
    if what == "kv_cache":
        from ..cache.quantized import bytes_per_token

        return obj.batch * obj.max_len * bytes_per_token(cfg, obj.dtype, getattr(obj, "kv_cache_dtype", None))
    dtype = next(obj.parameters()).dtype
    quant = getattr(getattr(obj, "options", None), "quant", None)
    if quant:  # integer weights + scales, the embedding table in half precision unless read from the head
        from ..quant.embedding import QuantEmbedding
        from ..quant.formats import real_shape_bytes as quantized_bytes

        table = not isinstance(getattr(getattr(obj, "model", None), "embed_tokens", None), QuantEmbedding)
        return quantized_bytes(cfg, quant, dtype, table)
    return cfg.num_parameters() * dtype.itemsize


@dataclass
class Held:
    label: str
    nbytes: int


class MemoryBudget:
    """A ledger of live models and caches at real-shape prices; ``start()`` makes it the active one."""

    def __init__(self, limit_gib: float = T4_BUDGET_GIB, workspace_gib: float = WORKSPACE_GIB):
        self.limit, self.workspace = int(limit_gib * 2**30), int(workspace_gib * 2**30)
        self.live: dict[int, Held] = {}
        self.peak, self.at_peak = self.workspace, []
        self.most_fp32_models = 0  # the most fp32 model copies held at one time
        from .host_budget import HostBudget

        self.host = HostBudget()  # Colab's host RAM, priced for the same loads (host_budget.py)

    @classmethod
    def start(cls, **kwargs) -> MemoryBudget:
        global ACTIVE
        ACTIVE = cls(**kwargs)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return ACTIVE

    def add(self, obj, what: str) -> None:
        self.host.add(obj, what)
        key = id(obj)
        dtype = str(obj.k[0].dtype if what == "kv_cache" else next(obj.parameters()).dtype).removeprefix("torch.")
        quant = getattr(getattr(obj, "options", None), "quant", None)
        if quant and what != "kv_cache":
            dtype = f"{quant} + {dtype}"
        self.live[key] = Held(f"{what} ({dtype})", real_shape_bytes(obj, what))
        weakref.finalize(obj, self.live.pop, key, None)
        fp32 = sum(1 for h in self.live.values() if "weights (float32)" in h.label)
        self.most_fp32_models = max(self.most_fp32_models, fp32)
        total = self.current
        if total > self.peak:
            self.peak, self.at_peak = total, [h.label for h in self.live.values()]

    @property
    def current(self) -> int:
        return self.workspace + sum(h.nbytes for h in self.live.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit and self.most_fp32_models <= 1

    def report(self) -> str:
        gib = 2**-30
        lines = [f"peak at the real model's shape: {self.peak * gib:.1f} GiB of the {self.limit * gib:.0f} GiB "
                 f"T4 budget, at most {self.most_fp32_models} fp32 model(s) at once "
                 f"({'fits' if self.fits else 'DOES NOT FIT'}); held at the peak: "
                 + ", ".join(self.at_peak or ["nothing"]) + f", + {self.workspace * gib:.1f} GiB activations"]
        # the measured GPU peak is book.peak_memory_line's, printed beside this report
        return "\n".join([*(textwrap.fill(line, WIDTH) for line in lines), self.host.report()])

    def check(self) -> None:
        if not self.fits:
            raise AssertionError("this chapter would not fit a T4:\n" + self.report())
        self.host.check()
