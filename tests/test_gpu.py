"""GPU-only checks: the CUDA-graph decode step in the configurations readers run, every SDPA
kernel forced in turn (eager and compiled, half precision and fp32), ragged batches, int8 at
batch 3, and a second GPU where there is one. Skipped without CUDA. ``scripts/gpu_check.sh
--full`` runs them; its default phases run the same rungs on the tiny model in less time."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from conftest import hf_greedy, strip_stop
from engine_lib import Engine
from engine_lib.bench.measure import attention_kernels
from engine_lib.bench.reference import margin_check
from engine_lib.loop.local import LocalLoop
from engine_lib.model.layers.sdpa import forced
from engine_lib.sampling import SamplingParams
from engine_lib.step import compiled as compiled_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 only where it is native (Ampere, sm_80, and later); a T4 runs fp16
HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() and
                          torch.cuda.get_device_capability() >= (8, 0) else [])
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


@pytest.fixture(scope="module")
def gpu(tiny_dir):
    cache = {}

    def get(stage, dtype):
        if (stage, dtype) not in cache:
            cache[stage, dtype] = Engine.from_pretrained(tiny_dir, device="cuda", dtype=dtype, stage=stage)
        return cache[stage, dtype]

    return get


def no_graph_tokens(engine, prompts, n, **options):
    """The same compiled step without the graph: the captured kernels are these kernels. The engine's own
    token loop (as ``Engine.generate`` runs it, reading the tokens every 16 steps) on a step never captured."""
    loop = LocalLoop(engine.model, engine.tokenizer, engine.max_model_len, compile_step=True, cuda_graph=False)
    params = engine.sampling(stop_token_ids=[], max_tokens=n, **options)
    *_, (seqs, _) = loop.run(prompts, params, reads_every=16)
    assert loop.step_form == "compiled" and not loop.fallbacks
    return [list(s.output_ids) for s in seqs]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_graph_replays_exactly_the_compiled_step_in_half_precision(gpu, prompts, dtype):
    fused = gpu("fused", dtype)
    runs = [dict(do_sample=False)] + ([dict(do_sample=True, seed=11)] if dtype == HALF[0] else [])  # + sampling
    for options in runs:
        got = fused.generate(prompts[0], max_new_tokens=40, stop_token_ids=[], **options).token_ids
        assert fused.step_form == "cuda_graph", fused.fallbacks
        assert [got] == no_graph_tokens(fused, [prompts[0]], 40, **options)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_graph_step_logits_agree_with_eager_by_margin(gpu, prompts, dtype):
    fused = gpu("fused", dtype)
    eager = LocalLoop(fused.model, fused.tokenizer, fused.max_model_len)  # same model, eager steps reading the exact span
    graph_logits, eager_logits = [], []
    for ids in prompts:
        for loop, out in ((fused.loop, graph_logits), (eager, eager_logits)):
            paused = loop.paused([ids], SamplingParams(max_tokens=4))  # prefilled: one decode step to run
            paused.decode()
            st = paused.runner.steps.state  # the decode state the step ran on (row 0: the one prompt)
            out.append(st.logits[st.order[0]].clone())
    assert eager.step_form == "eager"
    check = margin_check(graph_logits, eager_logits)
    assert check.ok and check.error < 0.15, check
    assert fused.step_form == "cuda_graph"


def test_ragged_batch_of_three_under_the_graph(gpu, prompts):
    fused = gpu("fused", HALF[0])  # fp16: the T4's dtype
    batch = [prompts[0], prompts[2], prompts[5]]
    assert len({len(p) for p in batch}) == 3
    out = fused.generate_batch(batch, max_new_tokens=24, do_sample=False, stop_token_ids=[])
    assert fused.step_form == "cuda_graph" and all(len(r.token_ids) == 24 for r in out)


def test_fp32_graph_equals_transformers_across_buckets_batches_and_engines(gpu, tiny_dir, hf_tiny, prompts):
    fused = gpu("fused", torch.float32)
    hf = hf_tiny.to("cuda")
    for ids in (prompts[1], prompts[4], list(range(1000, 1600))):  # the last one needs a larger bucket
        want = strip_stop(hf_greedy(hf, ids, 32))
        assert fused.generate(ids, max_new_tokens=32, do_sample=False).token_ids == want
    runner = fused.loop.core.runner  # the loop's runner over the cache of the last (longest) call
    spans = [span for _, span in runner.states]
    assert max(spans) > 256  # the cache (the span a step reads) grew mid-process ...
    assert any(length > 256 for _, length, _ in runner.steps.captures)  # ... and a new graph was captured for it
    batch = [prompts[0], prompts[2], prompts[5]]
    together = fused.generate_batch(batch, max_new_tokens=24, do_sample=False)
    for ids, out in zip(batch, together):
        assert out.token_ids == strip_stop(hf_greedy(hf, ids, 24))
    second = Engine.from_pretrained(tiny_dir, device="cuda", dtype=torch.float32, stage="fused")
    assert second.generate(prompts[1], max_new_tokens=32, do_sample=False).token_ids == \
        fused.generate(prompts[1], max_new_tokens=32, do_sample=False).token_ids
    hf_tiny.to("cpu")
    for engine in (fused, second):  # still on the graph at the end: nothing fell back
        assert engine.step_form == "cuda_graph" and not engine.fallbacks


def fresh_compiled_step():
    """A compiled step traced under the kernel forced now (the forced choice is baked in at trace time)."""
    compiled_step._COMPILED.clear()
    compiled_step._VARIANTS.clear()
    torch._dynamo.reset()


def refused(exc: Exception) -> bool:
    return "No available kernel" in str(exc)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=str)
@pytest.mark.parametrize("form", ["eager", "compiled"])
def test_each_sdpa_kernel_forced_in_turn(tiny_dir, prompts, kernel, dtype, form):
    """Decode (unmasked batch 1, masked ragged batch 3) and prefill on one forced kernel. A kernel
    that does not take a call on this GPU (flash with a mask or in fp32, cuDNN in fp32, either on
    sm_75) must say so with torch's "No available kernel", never fail another way."""
    fresh_compiled_step()
    stage = ("kv_cache" if dtype == torch.float32 else "half") if form == "eager" else "fused"
    engine = Engine.from_pretrained(tiny_dir, device="cuda", dtype=dtype, stage=stage)
    batch = [prompts[0], prompts[2], prompts[5]]
    try:
        with forced(KERNELS[kernel]):
            one = engine.generate(prompts[0], max_new_tokens=6, do_sample=False, stop_token_ids=[]).token_ids
            three = engine.generate_batch(batch, max_new_tokens=6, do_sample=False, stop_token_ids=[])
    except RuntimeError as exc:
        if refused(exc):
            pytest.skip(f"{kernel} does not take this call here: {str(exc)[:200]}")
        raise
    assert len(one) == 6 and all(len(r.token_ids) == 6 for r in three)
    if form == "compiled":
        assert not engine.fallbacks and engine.step_form == "cuda_graph"
    fresh_compiled_step()


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=str)
def test_the_engines_own_kernel_choice_is_never_math(gpu, dtype):
    """Prefill and decode on the engine's default choice run a fused kernel (on a T4 too)."""
    engine = gpu("half" if dtype != torch.float32 else "kv_cache", dtype)
    kernels = attention_kernels(engine.model)
    assert all("math" not in k and k.startswith("_scaled_dot_product") for k in kernels.values()), kernels


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_the_graph_step_on_a_second_gpu(tiny_dir, prompts):
    """Capture, streams and the kernel choice follow the engine's device, not the current one."""
    fresh_compiled_step()
    engine = Engine.from_pretrained(tiny_dir, device="cuda:1", dtype=HALF[0], stage="fused")
    out = engine.generate_batch([prompts[0], prompts[2]], max_new_tokens=8, do_sample=False, stop_token_ids=[])
    assert engine.step_form == "cuda_graph", engine.fallbacks
    assert all(len(r.token_ids) == 8 for r in out) and torch.cuda.current_device() == 0


def test_default_dtype_and_memory(gpu):
    engine = gpu("fused", None)
    native_bf16 = torch.cuda.get_device_capability()[0] >= 8  # a T4 (7.5) only emulates bf16
    assert engine.dtype == (torch.bfloat16 if native_bf16 else torch.float16)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() < 4 * 2**30  # tiny model: nothing near a full-size buffer


# ------------------------------------------------------------- weight-only int8 / int4 (chapter 10)
@pytest.mark.parametrize("quant, tolerance", [("int8", 0.1), ("int4", 0.8)])  # |dlogit| vs half, measured on CPU
def test_quantized_rungs_on_cuda(gpu, prompts, quant, tolerance):
    from engine_lib.bench.measure import matmul_kernels
    from engine_lib.quant.linear import DENSE

    engine, half = gpu(quant, None), gpu("half", None)
    out = engine.generate(prompts[0], max_new_tokens=16, do_sample=False, stop_token_ids=[])
    assert len(out.token_ids) == 16
    assert engine.step_form == "cuda_graph", engine.fallbacks
    check = margin_check([engine.logits(ids)[-1] for ids in prompts], [half.logits(ids)[-1] for ids in prompts])
    assert check.ok and check.error < tolerance, check
    tinygemm = quant == "int4" and engine.dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    kernels = matmul_kernels(engine.model)
    assert kernels["decode"] == ("_weight_int4pack_mm" if tinygemm else DENSE), (kernels, engine.model.lm_head.kernel_note)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_int8_decode_at_batch_3_makes_no_weight_sized_temporary(gpu, prompts, dtype):
    """The compiled int8 step (no graph: its allocations are visible) at batch 3: the decode steps'
    memory peak stays far below one fp16 copy of the LM head's weight."""
    engine = gpu("int8", dtype)
    loop = LocalLoop(engine.model, engine.tokenizer, engine.max_model_len, compile_step=True, cuda_graph=False)
    ids = [prompts[0][:9], prompts[2][:9], prompts[5][:9]]
    paused = loop.paused(ids, engine.sampling(do_sample=False, max_tokens=12))  # prefilled, batch 3
    runner = paused.runner
    paused.decode()  # compiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(8):
        paused.decode()
    torch.cuda.synchronize()
    head = engine.model.lm_head
    assert torch.cuda.max_memory_allocated() - base < head.in_features * head.out_features * 2 // 4
    assert runner.step_form == "compiled" and not runner.fallbacks


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
    from engine_lib.cache.paged import PagedKVCache
    from engine_lib.loop.config import SchedulerConfig
    from engine_lib.loop.serving import ServingLoop

    engine = gpu("kv_cache", torch.float32)
    want = [engine.generate(ids, max_new_tokens=16, do_sample=False, stop_token_ids=[]).token_ids for ids in prompts]
    cache = PagedKVCache.from_budget(engine.config, 0.05, engine.dtype, "cuda")
    sched = ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(prefill_chunk=32)).start()
    try:
        got = sched.generate(prompts, engine.sampling(do_sample=False, stop_token_ids=[], max_tokens=16))
    finally:
        sched.stop()
    assert [r.token_ids for r in got] == want
    assert cache.allocator.num_free == cache.allocator.usable


# ------------------------------------------------------------- our Triton kernels (chapter 14)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_each_triton_kernel_compiled_for_this_gpu_matches_its_reference(dtype):
    """The kernels CI checks in Triton's interpreter, here compiled by Triton for this GPU."""
    pytest.importorskip("triton")
    from engine_lib.book.kernel_references import (
        add_rmsnorm_reference,
        decode_attention_reference,
        int8_matvec_reference,
        rope_kv_write_reference,
    )
    from engine_lib.kernels.add_rmsnorm import add_rmsnorm_
    from engine_lib.kernels.decode_attention import decode_attention
    from engine_lib.kernels.int8_matvec import int8_matvec
    from engine_lib.kernels.rope_kv_write import rope_kv_write_
    from engine_lib.model.layers.rope import RotaryEmbedding
    from engine_lib.quant.formats import quantize_int8

    dev = "cuda"
    x, res, w = (torch.randn(3, 1536, device=dev, dtype=dtype) for _ in range(3))
    want_n, want_r = add_rmsnorm_reference(x, res, w[0], 1e-6)
    got_n = add_rmsnorm_(x, res, w[0], 1e-6)
    torch.testing.assert_close(res, want_r), torch.testing.assert_close(got_n, want_n)

    q = torch.randn(2, 12, 3, 128, device=dev, dtype=dtype)
    k = torch.randn(2, 2, 4096, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    pos = torch.tensor([[4000, 4001, 4002], [100, 101, 102]], device=dev)
    valid = torch.ones(2, 4096, dtype=torch.bool, device=dev)
    valid[1, :7] = False  # left padding in row 1
    torch.testing.assert_close(decode_attention(q, k, v, pos, valid), decode_attention_reference(q, k, v, pos, valid),
                               atol=2e-2, rtol=2e-2)

    qkv = torch.randn(2, 3, 16 * 128, device=dev, dtype=dtype).view(2, 3, 16, 128).transpose(1, 2)
    caches = [torch.zeros(2, 2, 64, 128, device=dev, dtype=dtype) for _ in range(4)]
    rope = RotaryEmbedding(128, 4096, 1e6).to(dev)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11]], device=dev)
    a, b = qkv.clone().split([12, 2, 2], dim=1), qkv.clone().split([12, 2, 2], dim=1)
    rope_kv_write_(*a, positions, rope.cos_table, rope.sin_table, caches[0], caches[1], positions)
    rope_kv_write_reference(*b, positions, rope.cos_table, rope.sin_table, caches[2], caches[3], positions)
    for got, want in ((a[0], b[0]), (caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    qw, scales = quantize_int8(torch.randn(8960, 1536, device=dev) * 0.03, dtype)
    xs = torch.randn(4, 1536, device=dev, dtype=dtype)
    torch.testing.assert_close(int8_matvec(xs, qw, scales), int8_matvec_reference(xs, qw, scales), atol=5e-2, rtol=2e-2)


def test_triton_rung_captures_its_kernels_and_matches_fused(gpu, prompts):
    """fp32 (exact dot products, no tf32): the rung's graph replays our kernels and its greedy tokens equal fused's."""
    pytest.importorskip("triton")
    triton_rung, fused = gpu("triton", torch.float32), gpu("fused", torch.float32)
    assert triton_rung.stage.name == "triton"
    for ids in prompts[:3]:
        got = triton_rung.generate(ids, max_new_tokens=16, do_sample=False, stop_token_ids=[]).token_ids
        assert got == fused.generate(ids, max_new_tokens=16, do_sample=False, stop_token_ids=[]).token_ids
    assert triton_rung.step_form == "cuda_graph" and triton_rung.fallbacks == []
