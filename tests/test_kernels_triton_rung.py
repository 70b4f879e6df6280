"""The ``triton`` rung (chapter 14): the fused rung with our Triton kernels in the decode step.

On this CPU the kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1``),
so the rung runs end to end here: its greedy tokens must equal the fused rung's, through a
left-padded batch, speculative verify and the serving scheduler's paged cache. Where the
kernels cannot run, the engine says why once and runs the fused rung.
"""

import warnings

import pytest
import torch

from engine_lib import Engine
from engine_lib.cache.blocks import blocks_for
from engine_lib.cache.paged import BLOCK_SIZE, PagedKVCache
from engine_lib.kernels import unavailable_reason
from engine_lib.step.forward import Row, paged_forward

pytest.importorskip("triton")


def greedy(engine, batch, n=8):
    return [r.token_ids for r in engine.generate_batch(batch, max_new_tokens=n, do_sample=False)]


@pytest.fixture(scope="module")
def fused_fp32(tiny_dir):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="fused")
    engine.loop.compile_step = False  # eager, as the triton rung runs on CPU: no compile in this file
    return engine


def eager_decode_logits(engine, ids: list[int]) -> torch.Tensor:
    """The fp32 logits of the first decode step after ``ids``, run eagerly (a loop core of its own, no compile)."""
    saved = engine.loop.compile_step, engine.loop.core
    engine.loop.compile_step, engine.loop.core = False, None
    try:
        paused = engine.loop.paused([ids], engine.sampling(do_sample=False, max_tokens=4))
        assert paused.runner.step_form == "eager"
        paused.decode()
        return paused.core.runner.steps.state.logits.clone()
    finally:
        engine.loop.compile_step, engine.loop.core = saved


def test_the_triton_rung_uses_the_kernels_and_decodes_eagerly_on_cpu(engines):
    engine = engines("triton", torch.float32)
    assert engine.stage.name == "triton" and engine.model.options.kernels
    assert engine.step_form == "eager"  # compiled steps would hide the kernels from inductor


def counting(monkeypatch, module, name: str) -> list:
    """Count the calls of a kernel launcher the model looks up at call time."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_greedy_tokens_equal_the_fused_rung_on_a_padded_batch(engines, fused_fp32, prompts, monkeypatch):
    import engine_lib.kernels.add_rmsnorm as norm
    import engine_lib.kernels.decode_attention as attention
    import engine_lib.kernels.rope_kv_write as rope

    calls = {name: counting(monkeypatch, mod, name) for mod, name in
             ((norm, "add_rmsnorm_"), (attention, "decode_attention"), (rope, "rope_kv_write_"))}
    batch = [prompts[1], prompts[2][:9], prompts[5][:4]]  # ragged: left padding in the cache
    got = greedy(engines("triton", torch.float32), batch)
    layers = engines("triton", torch.float32).config.num_hidden_layers
    # 7 decode steps (the 8th token comes from the last of them) through every layer
    assert len(calls["decode_attention"]) == len(calls["rope_kv_write_"]) == 7 * layers, calls
    assert len(calls["add_rmsnorm_"]) >= 2 * 7 * layers - 1
    assert got == greedy(fused_fp32, batch)


def test_decode_logits_match_the_fused_rung_in_bf16(engines, prompts):
    fused, triton = engines("fused", torch.bfloat16), engines("triton", torch.bfloat16)
    got, want = triton.logits(prompts[0][:12]), fused.logits(prompts[0][:12])
    torch.testing.assert_close(got.float(), want.float(), atol=0.05 * want.abs().max().item(), rtol=0)
    # one decode step each, from the same prompt: the kernels' path (the prefill above was SDPA's)
    a, b = (eager_decode_logits(e, prompts[0][:12]) for e in (triton, fused))
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err < 0.02, f"bf16 decode logits differ from the fused rung's by {err:.3g} of their range"


def test_speculative_verify_runs_through_the_kernels_with_unchanged_output(tiny_dir, fused_fp32, prompts):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="triton",
                                    speculative="prompt_lookup")
    ids = prompts[3] + prompts[3][-12:]  # a repeat, so prompt lookup drafts something
    got = engine.generate(ids, max_new_tokens=10, do_sample=False)
    assert got.extra["drafted"] > 0, got.extra
    assert got.token_ids == fused_fp32.generate(ids, max_new_tokens=10, do_sample=False).token_ids


def test_the_serving_forward_reads_the_paged_cache_through_the_kernel(engines, prompts, monkeypatch):
    import engine_lib.kernels.decode_attention as attention

    calls = []
    real = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: calls.append(a[5] is not None) or real(*a, **k))

    def two_steps(engine):
        cfg = engine.config
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=40,
                             dtype=torch.float32, device="cpu")
        rows = [prompts[0][:20], prompts[4][:7]]
        tables = [cache.allocator.allocate(blocks_for(len(p) + 1, BLOCK_SIZE)) for p in rows]
        first = paged_forward(engine.model, cache, [Row(p, 0, t) for p, t in zip(rows, tables)])
        nxt = [int(r.argmax()) for r in first]
        return paged_forward(engine.model, cache, [Row([t], len(p), tb) for p, t, tb in zip(rows, nxt, tables)])

    got, want = two_steps(engines("triton", torch.float32)), two_steps(engines("fused", torch.float32))
    assert calls and all(calls), "the decode step did not read the paged cache through the block table"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_where_the_kernels_cannot_run_the_engine_says_why_and_runs_fused(tiny_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.warns(RuntimeWarning, match="runs as 'fused': Triton kernels need a CUDA GPU"):
        engine = Engine.from_pretrained(tiny_dir, device="cpu", stage="triton")
    assert engine.stage.name == "fused" and not engine.model.options.kernels


def test_unavailable_reasons_name_the_missing_piece(monkeypatch):
    import engine_lib.kernels as kernels

    assert unavailable_reason("cpu", torch.float32) is None  # the interpreter is on in tests
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert "bf16 needs compute capability 8.0" in unavailable_reason("cuda", torch.bfloat16)
    assert unavailable_reason("cuda", torch.float16) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert "7.0 or later" in unavailable_reason("cuda", torch.float16)
    monkeypatch.setattr(kernels, "triton_version", lambda: None)
    assert "not installed" in unavailable_reason("cpu", torch.float32)


def test_kernels_need_the_fused_model():
    from engine_lib.errors import UnsupportedOptionError
    from engine_lib.model.qwen2 import ModelOptions

    with pytest.raises(UnsupportedOptionError, match="needs fused"):
        ModelOptions(sdpa=True, kernels=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelOptions(sdpa=True, fused=True, kernels=True)
