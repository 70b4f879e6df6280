"""Colab's host memory: what loading a model at the real shape costs the 12.7 GB of RAM beside the T4.

Defined in chapter 00, beside the T4 ledger (``memory_budget.py``, which starts and checks this one
too). On Colab every chapter puts its models on the GPU, so host memory holds a model only while it
loads. This ledger prices each load the engine announces (``tracking.note``) at the real model's
shape, as it happens there:

- ``transformers weights``: ``from_pretrained`` builds the whole model on the host in its dtype,
  then ``.to("cuda")`` moves it; the host holds every parameter (6.2 GB in fp32) plus the largest
  checkpoint tensor being read (the bf16 embedding table, 0.47 GB);
- ``engine weights``: the loader reads one tensor at a time; the host holds the largest (the bf16
  embedding table) and, conservatively, its conversion to the model's dtype;
- a KV cache lives on the GPU: nothing.

The checkpoint file itself is memory-mapped: its pages are page cache, which the kernel drops under
pressure, so they are not counted. The baseline is this process's resident memory when the ledger
starts, plus, when no CUDA context exists yet (CI, a CPU), ``CUDA_HOST_ALLOWANCE_GIB`` for the one
Colab's kernel would hold: an assumption (no GPU was at hand to measure it), stated as one. The
peak is the baseline plus the largest load; ``check`` fails when it passes the limit.
"""

from __future__ import annotations

import textwrap

import torch

COLAB_HOST_BYTES = 12.7e9  # a free Colab runtime's "System RAM 12.7 GB", read as 10^9 bytes (the smaller reading)
CUDA_HOST_ALLOWANCE_GIB = 2.0  # host RAM assumed for the CUDA context and libraries when none is loaded here


def rss_bytes() -> int:
    """This process's resident memory now."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB, the peak so far


def load_bytes(obj, what: str) -> int:
    """Host bytes that loading ``obj`` takes at the real model's shape, on a machine whose models go to the GPU."""
    from ..model.checkpoints import preset_config

    if what == "kv_cache":
        return 0
    cfg = preset_config("qwen2.5-1.5b-random")  # exactly the real model's shape
    itemsize = next(obj.parameters()).dtype.itemsize
    embedding_bf16 = cfg.vocab_size * cfg.hidden_size * 2  # the checkpoint's largest tensor
    if what == "transformers weights":
        return cfg.num_parameters() * itemsize + embedding_bf16
    return embedding_bf16 + cfg.vocab_size * cfg.hidden_size * itemsize


class HostBudget:
    """The host memory peak of a chapter's loads on Colab, priced at the real shape."""

    def __init__(self, limit_bytes: float = COLAB_HOST_BYTES, baseline_bytes: int | None = None):
        self.limit = int(limit_bytes)
        cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.allowance = 0 if cuda_ready else int(CUDA_HOST_ALLOWANCE_GIB * 2**30)
        self.baseline = rss_bytes() + self.allowance if baseline_bytes is None else int(baseline_bytes)
        self.peak, self.at_peak = self.baseline, "nothing loaded"

    def add(self, obj, what: str) -> None:
        total = self.baseline + load_bytes(obj, what)
        if total > self.peak:
            dtype = str(next(obj.parameters()).dtype).removeprefix("torch.") if what != "kv_cache" else ""
            self.peak, self.at_peak = total, f"loading {what} ({dtype})"

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit

    def report(self) -> str:
        assumed = f", {self.allowance / 2**30:.1f} GiB of it assumed for CUDA" if self.allowance else ""
        line = (f"Colab host memory at the real model's shape: peak {self.peak / 1e9:.1f} GB of "
                f"{self.limit / 1e9:.1f} GB ({'fits' if self.fits else 'DOES NOT FIT'}), while {self.at_peak}; "
                f"baseline {self.baseline / 1e9:.1f} GB{assumed}")
        return textwrap.fill(line, 76)

    def check(self) -> None:
        if not self.fits:
            raise AssertionError("this chapter would not fit Colab's host memory:\n" + self.report())
