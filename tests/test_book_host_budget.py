"""Colab's host memory (12.7 GB beside the T4), simulated on a CPU: every load a chapter makes is priced
at the real model's shape (``book/host_budget.py``), and a chapter's ``budget.check()`` fails when the
peak passes the limit. Runs the real loading code on the tiny checkpoint."""

import pytest
import torch

from engine_lib import Engine
from engine_lib.bench import reference, reference_outputs
from engine_lib.bench.reference import ensure_ground_truth, load_hf_model, record_reference
from engine_lib.book import host_budget
from engine_lib.book.host_budget import COLAB_HOST_BYTES, HostBudget
from engine_lib.book.memory_budget import MemoryBudget

PARAMS = 1_543_714_304  # the real model
EMBED_BF16 = 151_936 * 1536 * 2  # its largest tensor, as the checkpoint stores it


def test_transformers_fp32_load_is_priced_at_the_real_shape_and_fits(budget, tiny_dir):
    """What ensure_ground_truth's fallback (and chapters 00 and 03) do on Colab: transformers builds the
    fp32 model on the host (6.2 GB) before moving it to the GPU. With this process's baseline and the
    stated CUDA allowance, it fits under 12.7 GB."""
    host = budget.host
    assert host.limit == 12_700_000_000 and host.baseline > 0
    hf = load_hf_model(tiny_dir, torch.float32)
    assert host.peak - host.baseline == PARAMS * 4 + EMBED_BF16
    assert "loading transformers weights (float32)" in " ".join(host.report().split())
    budget.check()  # fits: baseline + 6.6 GB
    del hf


def test_the_check_fails_past_the_limit(budget, tiny_dir):
    """The same load on a host 5 GB above the baseline (less than one fp32 copy): the chapter's check fails."""
    budget.host.limit = budget.host.baseline + 5_000_000_000
    hf = load_hf_model(tiny_dir, torch.float32)
    with pytest.raises(AssertionError, match="would not fit Colab's host memory"):
        budget.check()
    assert "DOES NOT FIT" in " ".join(budget.report().split())
    del hf


def test_engine_streams_its_weights(budget, tiny_dir):
    """The engine's loader holds one tensor at a time on the host: at most the bf16 embedding and its
    fp32 conversion, 1.4 GB, whatever the model's size."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache")
    engine.generate([1, 2, 3], max_new_tokens=2, do_sample=False)  # a KV cache: on the GPU there, no host cost
    assert budget.host.peak - budget.host.baseline == EMBED_BF16 + 151_936 * 1536 * 4
    budget.check()


def test_a_shipped_reference_costs_no_host_memory(budget, tiny_dir, tmp_path, monkeypatch):
    """With a record shipped for the checkpoint, ensure_ground_truth loads nothing: the 6.2 GB load
    of the fallback never happens."""
    out = record_reference(tiny_dir, root=tmp_path, max_new_tokens=2)  # its own budget entry
    fresh = MemoryBudget.start()
    monkeypatch.setattr(reference_outputs, "SHIPPED", tmp_path)
    monkeypatch.setattr(reference, "load_hf_model", lambda *a, **k: pytest.fail("transformers loaded"))
    assert ensure_ground_truth(tiny_dir, max_new_tokens=2) == out
    assert fresh.host.peak == fresh.host.baseline
    fresh.check()


def test_baseline_adds_the_cuda_allowance_only_without_a_cuda_context():
    b = HostBudget()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        assert b.allowance == 0
    else:
        assert b.allowance == int(host_budget.CUDA_HOST_ALLOWANCE_GIB * 2**30)
        assert "assumed for CUDA" in " ".join(b.report().split())
    assert HostBudget(baseline_bytes=1).baseline == 1 and COLAB_HOST_BYTES == 12.7e9
