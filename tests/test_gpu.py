"""GPU-only checks: the CUDA-graph decode path and half precision on the device. Skipped without CUDA."""

import pytest
import torch

from conftest import hf_greedy, strip_stop
from engine_lib import Engine
from engine_lib.stages import half_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_engines(tiny_dir):
    return {stage: Engine.from_pretrained(tiny_dir, device="cuda", dtype=torch.float32, stage=stage)
            for stage in ("kv_cache", "fused")}


def test_cuda_graph_decode_equals_eager_and_transformers(gpu_engines, hf_tiny, prompts):
    fused = gpu_engines["fused"]
    assert fused.runner.cuda_graph
    for ids in prompts[:3]:
        ref = strip_stop(hf_greedy(hf_tiny, ids, 48))
        assert gpu_engines["kv_cache"].generate(ids, max_new_tokens=48, do_sample=False).token_ids == ref
        assert fused.generate(ids, max_new_tokens=48, do_sample=False).token_ids == ref
    assert fused.runner.cuda_graph and fused.runner._graphs  # captured, not fallen back


def test_cuda_graph_batch_equals_batch_one(gpu_engines, prompts):
    fused = gpu_engines["fused"]
    batch = [prompts[0], prompts[2], prompts[5]]
    together = fused.generate_batch(batch, max_new_tokens=24, do_sample=False)
    for ids, out in zip(batch, together):
        assert out.token_ids == fused.generate(ids, max_new_tokens=24, do_sample=False).token_ids


def test_half_on_gpu_top1_agrees(tiny_dir, hf_tiny, prompts):
    engine = Engine.from_pretrained(tiny_dir, device="cuda", stage="fused")
    assert engine.dtype == half_dtype(torch.device("cuda"))
    for ids in prompts:
        ours = engine.logits(ids)[-1].cpu()
        ref = hf_tiny(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() < 0.1
        assert ours.argmax() == ref.argmax()
