"""GPU-only checks: the CUDA-graph decode step in the configurations readers run, and attention
on a real kernel. Skipped without CUDA. ``scripts/gpu_check.sh`` runs them first."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import hf_greedy, strip_stop
from engine_lib import Engine
from engine_lib.bench.reference import margin_check
from engine_lib.generate import cached_tokens
from engine_lib.runner import CachedRunner
from engine_lib.sampling import SamplingParams
from engine_lib.stages import half_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 only where it is native (Ampere, sm_80, and later); a T4 runs fp16
HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() and
                          torch.cuda.get_device_capability() >= (8, 0) else [])
REAL_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


@pytest.fixture(scope="module")
def gpu(tiny_dir):
    cache = {}

    def get(stage, dtype):
        if (stage, dtype) not in cache:
            cache[stage, dtype] = Engine.from_pretrained(tiny_dir, device="cuda", dtype=dtype, stage=stage)
        return cache[stage, dtype]

    return get


def no_graph_tokens(engine, prompts, n, **options):
    """The same compiled step without the graph: the captured kernels are these kernels."""
    runner = CachedRunner(engine.model, compile_step=True, cuda_graph=False)
    params = engine.sampling(stop_token_ids=[], **options)
    ids = torch.tensor(prompts, device="cuda")
    return torch.cat(list(cached_tokens(runner, ids, None, [params] * len(prompts), n)), dim=1).tolist()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_graph_replays_exactly_the_compiled_step_in_half_precision(gpu, prompts, dtype):
    fused = gpu("fused", dtype)
    runs = [dict(do_sample=False)] + ([dict(do_sample=True, seed=11)] if dtype == HALF[0] else [])  # + sampling
    for options in runs:
        got = fused.generate(prompts[0], max_new_tokens=40, stop_token_ids=[], **options).token_ids
        assert fused.runner.step_form == "cuda_graph", fused.runner.fast.fallbacks
        assert [got] == no_graph_tokens(fused, [prompts[0]], 40, **options)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_graph_step_logits_agree_with_eager_by_margin(gpu, prompts, dtype):
    fused = gpu("fused", dtype)
    eager = CachedRunner(fused.model)  # same model, eager steps reading the exact span
    graph_logits, eager_logits = [], []
    for ids in prompts:
        for runner, out in ((fused.runner, graph_logits), (eager, eager_logits)):
            runner.prefill(torch.tensor([ids], device="cuda"), None, [SamplingParams()], 4)
            runner.decode()
            out.append(runner.state.logits[0].clone())
    check = margin_check(graph_logits, eager_logits)
    assert check.ok and check.error < 0.15, check
    assert fused.runner.step_form == "cuda_graph"


def test_ragged_batch_of_three_under_the_graph(gpu, prompts):
    fused = gpu("fused", HALF[0])  # fp16: the T4's dtype
    batch = [prompts[0], prompts[2], prompts[5]]
    assert len({len(p) for p in batch}) == 3
    out = fused.generate_batch(batch, max_new_tokens=24, do_sample=False, stop_token_ids=[])
    assert fused.runner.step_form == "cuda_graph" and all(len(r.token_ids) == 24 for r in out)


def test_fp32_graph_equals_transformers_across_buckets_batches_and_engines(gpu, tiny_dir, hf_tiny, prompts):
    fused = gpu("fused", torch.float32)
    hf = hf_tiny.to("cuda")
    for ids in (prompts[1], prompts[4], list(range(1000, 1600))):  # the last one needs a larger bucket
        want = strip_stop(hf_greedy(hf, ids, 32))
        assert fused.generate(ids, max_new_tokens=32, do_sample=False).token_ids == want
    assert fused.runner.state.max_len > 256  # the bucket changed mid-process and a new graph was captured
    batch = [prompts[0], prompts[2], prompts[5]]
    together = fused.generate_batch(batch, max_new_tokens=24, do_sample=False)
    for ids, out in zip(batch, together):
        assert out.token_ids == strip_stop(hf_greedy(hf, ids, 24))
    second = Engine.from_pretrained(tiny_dir, device="cuda", dtype=torch.float32, stage="fused")
    assert second.generate(prompts[1], max_new_tokens=32, do_sample=False).token_ids == \
        fused.generate(prompts[1], max_new_tokens=32, do_sample=False).token_ids
    hf_tiny.to("cpu")
    for engine in (fused, second):  # still on the graph at the end: nothing fell back
        assert engine.runner.step_form == "cuda_graph" and not engine.runner.fast.fallbacks


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_attention_runs_on_a_real_kernel(gpu, prompts, dtype):
    """With the math kernel excluded, a decode step (masked, ragged batch) and a 2k prefill still
    run: no call needs the slow fallback."""
    engine = gpu("half", dtype)  # eager, so SDPA runs under the context manager
    long_prompt = list(range(1000, 3048))
    with sdpa_kernel(REAL_KERNELS):
        engine.generate(long_prompt, max_new_tokens=2, do_sample=False)
        engine.generate_batch([prompts[0], prompts[3]], max_new_tokens=4, do_sample=False)


def test_default_dtype_and_memory(gpu):
    engine = gpu("fused", None)
    assert engine.dtype == half_dtype(torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() < 4 * 2**30  # tiny model: nothing near a full-size buffer


# ------------------------------------------------------------- weight-only int8 / int4 (chapter 10)
@pytest.mark.parametrize("quant, tolerance", [("int8", 0.1), ("int4", 0.8)])  # |dlogit| vs half, measured on CPU
def test_quantized_rungs_on_cuda(gpu, prompts, quant, tolerance):
    from engine_lib.bench.measure import matmul_kernels
    from engine_lib.quant import DENSE

    engine, half = gpu(quant, None), gpu("half", None)
    out = engine.generate(prompts[0], max_new_tokens=16, do_sample=False, stop_token_ids=[])
    assert len(out.token_ids) == 16
    assert engine.runner.step_form == "cuda_graph", engine.runner.fast.fallbacks
    check = margin_check([engine.logits(ids)[-1] for ids in prompts], [half.logits(ids)[-1] for ids in prompts])
    assert check.ok and check.error < tolerance, check
    tinygemm = quant == "int4" and engine.dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    kernels = matmul_kernels(engine.model)
    assert kernels["decode"] == ("_weight_int4pack_mm" if tinygemm else DENSE), (kernels, engine.model.lm_head.kernel_note)


# ------------------------------------------------------------- speculative decoding (chapter 11)
def test_speculative_greedy_equals_plain_greedy_on_cuda(tiny_dir, gpu, prompts):
    """fp32, where greedy speculation is token-exact: the verify forward runs on CUDA's kernels."""
    spec = Engine.from_pretrained(tiny_dir, device="cuda", dtype=torch.float32, stage="kv_cache",
                                  speculative="prompt_lookup")
    plain = gpu("kv_cache", torch.float32)
    for ids in prompts[:4]:
        got = spec.generate(ids, max_new_tokens=32, do_sample=False, stop_token_ids=[])
        assert got.token_ids == plain.generate(ids, max_new_tokens=32, do_sample=False, stop_token_ids=[]).token_ids
        assert got.extra["target_forwards"] <= 32


# ------------------------------------------------------------- serving (chapter 12)
def test_paged_scheduler_equals_solo_on_cuda(gpu, prompts):
    """Continuous batching over the paged cache on CUDA: each greedy reply equals its batch-1 run."""
    from engine_lib.serve.paged_cache import PagedKVCache
    from engine_lib.serve.scheduler import Scheduler, SchedulerConfig

    engine = gpu("kv_cache", torch.float32)
    want = [engine.generate(ids, max_new_tokens=16, do_sample=False, stop_token_ids=[]).token_ids for ids in prompts]
    cache = PagedKVCache.from_budget(engine.config, 0.05, engine.dtype, "cuda")
    sched = Scheduler(engine.model, engine.tokenizer, cache, SchedulerConfig(prefill_chunk=32)).start()
    try:
        got = sched.generate(prompts, engine.sampling(do_sample=False, stop_token_ids=[]), 16)
    finally:
        sched.stop()
    assert [r.token_ids for r in got] == want
    assert cache.allocator.num_free == cache.allocator.usable
