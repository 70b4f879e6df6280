"""Every cached rung under a T4's and an H200's SDPA rules, on CPU (issue 14).

``tests/cuda_contracts.py`` makes each ``F.scaled_dot_product_attention`` call pick the kernel
the simulated GPU would pick, refuse what that kernel refuses, and return that kernel's
output layout (from torch's meta kernels). Tokens must equal an unsimulated run through
CPU's math kernel (the same numbers, whatever the layout), and no hot path may land on
the math kernel. Before issue 14 the folded GQA decode ended in ``out.view(b, h, t, d)``,
which CUDA's memory-efficient kernel's layout does not allow: every rung failed here.
"""

import pytest
import torch
from cuda_contracts import CUDNN, EFFICIENT, MATH, CudaContractError, simulate
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine_lib import Engine
from engine_lib.bench.loop_ops import GreedyRow
from engine_lib.cache.blocks import blocks_for
from engine_lib.cache.paged import BLOCK_SIZE, PagedKVCache
from engine_lib.loop.model_runner import ModelRunner, ScheduledBatch
from engine_lib.step.forward import Row, paged_forward

# (device, rung, dtype): each GPU's dtypes; fused and int8 compile their decode step
CASES = [(dev, rung, dtype)
         for dev, half in (("t4", torch.float16), ("h200", torch.bfloat16))
         for rung, dtype in (("kv_cache", torch.float32), ("half", half), ("fused", half), ("int8", half),
                             ("triton", half))]  # triton: our kernels under Triton's interpreter (chapter 14)
ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def run(engine, prompts, n=6):
    """A ragged batch of two (masked prefill and decode) and, eager, a batch of one (unmasked causal
    prefill, unmasked decode). A compiled rung runs the batch only: one compiled variant.
    -> the tokens and the fp32 logits of the batch's first decode step."""
    batch = [prompts[1], prompts[2][:9]]
    paused = engine.loop.paused(batch, engine.sampling(do_sample=False, max_tokens=n))
    paused.decode()
    st = paused.core.runner.steps.state
    logits = st.logits[st.order].clone()
    tokens = [r.token_ids for r in engine.generate_batch(batch, max_new_tokens=n, do_sample=False)]
    if not engine.compile_step:  # eager: the batch of one too
        tokens.append(engine.generate(prompts[0], max_new_tokens=n, do_sample=False).token_ids)
    return tokens, logits


def reference(engine, prompts, **kw):
    """The same, unsimulated, through CPU's math kernel, eagerly (no second compile): a loop whose cores
    run the eager step."""
    saved = engine.loop.compile_step, engine.loop.core
    engine.loop.compile_step, engine.loop.core = False, None
    try:
        with sdpa_kernel(SDPBackend.MATH):
            return run(engine, prompts, **kw)
    finally:
        engine.loop.compile_step, engine.loop.core = saved


def assert_no_math(sim, what):
    """The decode and prefill hot paths stay on a fused kernel, and never on cuDNN, which builds a
    plan for every new shape (an eager decode step changes the key length every token)."""
    assert sim.picks, f"{what}: no SDPA call reached the simulation"
    slow = [p for p in sim.picks if p.backend == MATH]
    assert not slow, f"{what}: {len(slow)} SDPA calls fell to the math kernel, e.g. {slow[0]}"
    planned = [p for p in sim.picks if p.backend == CUDNN]
    assert not planned, f"{what}: {len(planned)} SDPA calls ran on cuDNN (a plan per shape), e.g. {planned[0]}"


@pytest.mark.parametrize("device,rung,dtype", CASES, ids=[f"{d}-{r}-{ID[t]}" for d, r, t in CASES])
def test_rung_runs_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, rung, dtype):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage=rung)
    want = reference(engine, prompts)
    with simulate(device) as sim:
        got = run(engine, prompts)
    if not engine.compile_step:  # eager: the same operations on the same numbers
        assert got[0] == want[0]
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    else:  # compiled under the same rules; fused kernels round differently, a misread layout would not be close
        assert engine.fallbacks == [] and engine.step_form == "compiled"
        err = ((got[1] - want[1]).abs().max() / want[1].abs().max()).item()
        assert err < 0.03, f"compiled decode logits differ from eager by {err:.3g} of their range"
    assert_no_math(sim, f"{device} {rung}")
    if device == "t4" or dtype == torch.float32:  # flash and cuDNN take no fp32, and need sm_80
        assert {p.backend for p in sim.picks} == {EFFICIENT}


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16), ("h200", torch.float32)],
                         ids=["t4-fp16", "h200-bf16", "h200-fp32"])
def test_speculative_verify_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half",
                                    speculative="prompt_lookup")
    ids = prompts[3] + prompts[3][-12:]  # a repeat, so prompt lookup drafts something
    with sdpa_kernel(SDPBackend.MATH):
        want = engine.generate(ids, max_new_tokens=10, do_sample=False).token_ids
    with simulate(device) as sim:
        got = engine.generate(ids, max_new_tokens=10, do_sample=False).token_ids
    assert got == want
    assert any(p.q_shape[2] > 1 and p.masked for p in sim.picks), "no verify call was simulated"
    assert_no_math(sim, f"{device} verify")


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16)], ids=["t4", "h200"])
def test_an_int8_cache_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype):
    """Where no kernel reads int8 (a GPU's half rung without Triton), the span is dequantized to the model's dtype
    and goes to SDPA: a layout the GPU's kernel takes, in decode, in a ragged batch and in a speculative verify."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half", kv_cache_dtype="int8",
                                    speculative="prompt_lookup")
    ids = prompts[3] + prompts[3][-12:]  # a repeat, so prompt lookup drafts something
    batch = [prompts[1], prompts[2][:9]]

    def both():
        return (engine.generate(ids, max_new_tokens=8, do_sample=False).token_ids,
                [r.token_ids for r in engine.generate_batch(batch, max_new_tokens=6, do_sample=False)])

    with sdpa_kernel(SDPBackend.MATH):
        want = both()
    with simulate(device) as sim:
        got = both()
    assert got == want
    assert any(p.q_shape[2] > 1 and p.masked for p in sim.picks), "no verify call was simulated"
    assert_no_math(sim, f"{device} int8 cache")


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16)], ids=["t4", "h200"])
def test_paged_serving_forward_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype):
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half")
    cfg = engine.config

    def two_steps():
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=40,
                             dtype=dtype, device="cpu")
        rows, newcomer = [prompts[0][:20], prompts[4][:7]], prompts[2][:12]
        tables = [cache.allocator.allocate(blocks_for(len(p) + 2, BLOCK_SIZE)) for p in rows]
        first = paged_forward(engine.model, cache, [Row(p, 0, t) for p, t in zip(rows, tables)])
        nxt = [int(r.argmax()) for r in first]
        # the served decode step: the engine's fixed-shape step over the paged cache (bucket 2, span 256)
        runner = ModelRunner(engine.model, cache, max_model_len=256)
        decode = tuple(Row([t], len(p), tb) for p, t, tb in zip(rows, nxt, tables))
        runner.execute(ScheduledBatch((GreedyRow(),) * len(rows), decode, prefill=False))
        step = next(iter(runner.states.values())).logits[:2]
        # a newcomer's prompt with the running rows riding along (the scheduler's mixed forward, real tokens only)
        after = [int(r.argmax()) for r in step]
        mixed = paged_forward(engine.model, cache, [Row(newcomer, 0, cache.allocator.allocate(blocks_for(12, BLOCK_SIZE)))]
                              + [Row([t], len(p) + 1, tb) for p, t, tb in zip(rows, after, tables)])
        return first.float(), step.float(), mixed.float()

    with sdpa_kernel(SDPBackend.MATH):
        want = two_steps()
    with simulate(device) as sim:
        got = two_steps()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert_no_math(sim, f"{device} paged")


def test_the_simulation_refuses_what_the_kernels_refuse():
    """The rules bite: GQA without equal heads on a T4, bf16 on sm_75, and only math left."""
    q = torch.randn(1, 4, 3, 32, dtype=torch.float16)
    k = torch.randn(1, 2, 5, 32, dtype=torch.float16)
    with simulate("t4"), pytest.raises(CudaContractError, match="GQA is flash/math only"):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    with simulate("t4"), pytest.raises(CudaContractError, match="bf16 needs sm_80"):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), q.bfloat16())


def test_the_simulated_layout_is_the_meta_kernels(tiny_dir):
    """The issue's example: memory-efficient attention on (1, 2, 6, 128) gives strides (1536, 128, 256, 1)."""
    q = torch.randn(1, 2, 6, 128, dtype=torch.float16)
    with simulate("t4") as sim:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert sim.picks[-1].backend == EFFICIENT and out.stride() == (1536, 128, 256, 1)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(),
                                                                                     q.float()).half())


def served_under(tiny_dir, prompts, device, dtype, requests, what: str, **config) -> int:
    """The server's loop, run step by step in this thread (the SDPA choice is this thread's), under
    CPU's math kernel and then under the device's rules: the same tokens, a decode batch of every row
    simulated, and no hot path on the math kernel. -> the scheduler steps the simulated run took."""
    from engine_lib.loop.config import SchedulerConfig
    from engine_lib.loop.serving import ServingLoop

    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=dtype, stage="half")
    cfg, eos = engine.config, engine.sampling().stop_token_ids

    def served() -> list[list[int]]:
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=64,
                             dtype=dtype, device="cpu")
        core = ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(**config)).core
        seqs = [core.new_sequence(p[:16], engine.sampling(**s, **x, stop_token_ids=eos, max_tokens=8))
                for p, (s, x) in zip(prompts, requests)]
        for seq in seqs:
            core.add(seq)
        for _ in range(40):
            if all(s.done for s in seqs):
                break
            core.step()
        assert all(s.done for s in seqs)
        return [s.output_ids for s in seqs], core.steps

    with sdpa_kernel(SDPBackend.MATH):
        want, _ = served()
    with simulate(device) as sim:
        got, steps = served()
    assert got == want
    assert any(p.q_shape[0] == len(requests) for p in sim.picks), "no decode batch of every row was simulated"
    assert_no_math(sim, f"{device} {what}")
    return steps


GREEDY_ROW, SEEDED_ROW = dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=30, seed=11)


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16)], ids=["t4", "h200"])
def test_served_rows_that_sample_and_adjust_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype):
    """Rows that sample and adjust their logits inside the step (logit bias, penalties, min_tokens,
    min_p, seeded) beside plain greedy ones."""
    requests = [(GREEDY_ROW, {}), (GREEDY_ROW, dict(logit_bias=((int(prompts[1][0]), 6.0),))),
                (GREEDY_ROW, dict(presence_penalty=1.5, frequency_penalty=1.0, min_tokens=4)),
                (SEEDED_ROW, dict(min_p=0.2, frequency_penalty=0.5)), (SEEDED_ROW, {})]
    served_under(tiny_dir, prompts, device, dtype, requests, "served sampling")


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16)], ids=["t4", "h200"])
def test_served_decode_that_runs_ahead_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype):
    """Greedy and seeded rows whose decode batches run 4 steps before the host reads them (the GPU's
    default is 8): the positions move on the device between steps."""
    requests = [(GREEDY_ROW, {}), (SEEDED_ROW, {}), (GREEDY_ROW, {}), (SEEDED_ROW, {})]
    steps = served_under(tiny_dir, prompts, device, dtype, requests, "served run ahead", decode_steps=4)
    assert steps == 3  # one prefill step, then runs of 4 and 3 tokens (8 each, the prefill's first)


@pytest.mark.parametrize("device,dtype", [("t4", torch.float16), ("h200", torch.bfloat16)], ids=["t4", "h200"])
def test_served_speculation_under_the_gpus_sdpa_contract(tiny_dir, prompts, device, dtype, monkeypatch):
    """Greedy rows verify drafts (several query positions per row over the paged cache, masked) beside seeded
    rows that decode; every draft is (up to) 2 copies of the row's newest token, so every step verifies."""
    from engine_lib.speculative import PromptLookup

    verified = []

    def copies(self, requests):
        verified.extend(seq.id for seq, _ in requests)
        assert all(seq.params.greedy for seq, _ in requests)  # a server's sampled rows do not draft
        return [[seq.last_token] * min(2, k) for seq, k in requests]

    monkeypatch.setattr(PromptLookup, "propose", copies)
    requests = [(GREEDY_ROW, {}), (SEEDED_ROW, {}), (GREEDY_ROW, {}), (SEEDED_ROW, {})]
    served_under(tiny_dir, prompts, device, dtype, requests, "served speculation", speculative="prompt_lookup")
    assert verified
