"""The one token loop: served decode batches run the engine's own step over the paged cache,
padded to batch buckets, compiled where the rung compiles. Served tokens equal ``Engine.generate``
on every rung the server runs, padding rows never touch a real row, and a steady-state decode step
on the fused rung dispatches no eager per-layer work."""

import pytest
import torch

from engine_lib.bench.loop_ops import GreedyRow, served_op_names
from engine_lib.cache.blocks import blocks_for
from engine_lib.cache.paged import SCRATCH_BLOCK, PagedKVCache
from engine_lib.cpu.kernels import BF16_OPS
from engine_lib.cpu.packed import PACKED_LINEAR
from engine_lib.loop.config import SchedulerConfig
from engine_lib.loop.model_runner import ModelRunner, ScheduledBatch
from engine_lib.loop.serving import ServingLoop
from engine_lib.step.forward import Row, paged_forward
from engine_lib.step.paged import BATCH_BUCKETS, SPAN_BUCKET, batch_bucket, span_bucket

PROMPTS = ["Tell me about the sea.", "Why is the sky blue?", "Write a haiku about autumn leaves falling.",
           "What is 12 times 7?", "Name three rivers."]
SEEDED = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=11)
GREEDY = dict(do_sample=False)


def test_each_batch_size_gets_its_bucket():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 64]
    assert batch_bucket(1, smallest=2) == 2  # batch invariance: a lone row still runs as a batch
    assert all(b >= n for n in range(1, 200) for b in [batch_bucket(n)])
    assert list(BATCH_BUCKETS[:6]) == [1, 2, 4, 8, 16, 32]
    assert span_bucket(1, 4096) == SPAN_BUCKET and span_bucket(SPAN_BUCKET + 1, 4096) == 2 * SPAN_BUCKET
    assert span_bucket(5000, 4096) == 4096  # never past the context
    with pytest.raises(ValueError, match="largest decode bucket"):
        batch_bucket(BATCH_BUCKETS[-1] + 1)


def _prefilled(engine, prompts, cache):
    """Prefill each prompt through its own blocks; -> (first tokens, block tables)."""
    tables, firsts = [], []
    for p in prompts:
        table = cache.allocator.allocate(blocks_for(len(p) + 4, cache.block_size))
        logits = paged_forward(engine.model, cache, [Row(p, 0, table)])
        firsts.append(int(logits[0].float().argmax()))
        tables.append(table)
    return firsts, tables


def test_padding_rows_never_change_a_real_row(engines):
    """Bucket 4 holding 3 real rows and 1 padding row: each real row's logits equal its logits when a
    4th real row fills the bucket, bit for bit, and the padded step writes nowhere but the real rows'
    own slots and the scratch block."""
    engine = engines("kv_cache")
    cfg = engine.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64, torch.float32, "cpu")
    prompts = [engine.encode(p) for p in PROMPTS[:4]]
    firsts, tables = _prefilled(engine, prompts, cache)
    runner = ModelRunner(engine.model, cache, max_model_len=512, pad_to_bucket=True)  # as on a GPU
    rows = tuple(Row([t], len(p), tb) for t, p, tb in zip(firsts, prompts, tables))
    assert batch_bucket(3) == 4
    before = [t.clone() for t in cache.k + cache.v]
    runner.execute(ScheduledBatch((GreedyRow(),) * 3, rows[:3], prefill=False))
    three = runner.states[(4, SPAN_BUCKET)].logits[:3].clone()
    after = [t.clone() for t in cache.k + cache.v]
    runner.execute(ScheduledBatch((GreedyRow(),) * 4, rows, prefill=False))
    four = runner.states[(4, SPAN_BUCKET)].logits[:3].clone()
    assert torch.equal(three, four)
    bs = cache.block_size
    owned = {tb[len(p) // bs] * bs + len(p) % bs for p, tb in zip(prompts[:3], tables[:3])}
    scratch = set(range(SCRATCH_BLOCK * bs, (SCRATCH_BLOCK + 1) * bs))
    for b, a in zip(before, after):
        changed = set(torch.nonzero((b != a).flatten(1).any(dim=1)).flatten().tolist())
        assert changed <= owned | scratch, sorted(changed - owned - scratch)
        assert owned <= changed  # the real rows did write their token


def served(engine, prompts, n, config: SchedulerConfig | None = None, **options):
    cache = PagedKVCache.from_budget(engine.config, 0.02, engine.dtype, "cpu")
    sched = ServingLoop(engine.model, engine.tokenizer, cache, config or SchedulerConfig(), compile_step=engine.compile_step,
                      cuda_graph=engine.cuda_graph).start()
    try:
        ids = [engine.encode(p) for p in prompts]
        return [r.token_ids for r in sched.generate(ids, engine.sampling(stop_token_ids=[], max_tokens=n, **options))], sched
    finally:
        sched.stop()


@pytest.mark.parametrize("stage", ["kv_cache", "fused"])
def test_served_tokens_equal_generate_in_fp32(engines, stage):
    """Greedy and seeded, in fp32: each served request (five at once) equals ``Engine.generate``
    alone, token for token, and so does a lone request (bucket 1). The fused rung compiles the paged
    step (its batch-1 and batch >= 2 variants)."""
    engine = engines(stage, torch.float32)
    for options in (GREEDY, SEEDED, {**SEEDED, "repetition_penalty": 1.3}):
        want = [engine.generate(p, max_new_tokens=10, stop_token_ids=[], **options).token_ids for p in PROMPTS]
        for steps in (1, 4):  # one token per host read, and four (the batch runs ahead on the device)
            got, sched = served(engine, PROMPTS, 10, SchedulerConfig(decode_steps=steps), **options)
            assert got == want, (stage, options, steps)
            assert sched.runner.step_form == ("compiled" if engine.compile_step else "eager")
    alone, _ = served(engine, PROMPTS[:1], 10, **GREEDY)
    assert alone[0] == engine.generate(PROMPTS[0], max_new_tokens=10, stop_token_ids=[], **GREEDY).token_ids


@pytest.mark.parametrize("stage", ["int8", "int4"])
def test_served_quantized_tokens_equal_generate_in_fp32(engines, stage):
    """The quantized rungs compile too: greedy served requests equal ``Engine.generate`` (one compile each)."""
    engine = engines(stage, torch.float32)
    want = [engine.generate(p, max_new_tokens=6, stop_token_ids=[], **GREEDY).token_ids for p in PROMPTS]
    got, sched = served(engine, PROMPTS, 6, **GREEDY)
    assert got == want and sched.runner.step_form == "compiled", stage


def first_difference_is_a_near_tie(engine, prompt: str, got: list[int], want: list[int], ulps: int = 4) -> bool:
    """True when ``got`` equals ``want``, or first leaves it where the reference's logits put the two tokens
    within ``ulps`` bf16 steps of each other (a tie that rounding may break either way)."""
    if got == want:
        return True
    i = next(k for k in range(min(len(got), len(want))) if got[k] != want[k])
    logits = engine.logits(engine.encode(prompt) + want[:i])[-1]  # (vocab,) fp32
    tol = ulps * float(logits.abs().max()) * 2.0**-8  # bf16 keeps 8 significant bits
    return abs(float(logits[want[i]] - logits[got[i]])) <= tol


def test_served_tokens_agree_with_generate_in_bf16_up_to_ties(engines):
    """In bf16 a batch of 8 rows and a lone row round differently (other matrix kernels), so greedy
    replies may part where two tokens tie to within rounding; they must agree up to such a tie.
    (The eager ``half`` rung: the compiled path's equality is the fp32 test's; this one is about
    rounding, and each bf16 compile would cost CI about half a minute.)"""
    stage = "half"
    engine = engines(stage, torch.bfloat16)
    want = [engine.generate(p, max_new_tokens=10, stop_token_ids=[], **GREEDY).token_ids for p in PROMPTS]
    got, _ = served(engine, PROMPTS, 10, **GREEDY)
    for p, g, w in zip(PROMPTS, got, want):
        assert first_difference_is_a_near_tie(engine, p, g, w), (stage, p, g, w)


def test_the_near_tie_rule_can_fail(engines):
    engine = engines("kv_cache")
    want = engine.generate(PROMPTS[0], max_new_tokens=4, stop_token_ids=[], **GREEDY).token_ids
    worst = int(engine.logits(engine.encode(PROMPTS[0]))[-1].argmin())  # far from the top: no tie
    assert not first_difference_is_a_near_tie(engine, PROMPTS[0], [worst, *want[1:]], want)


# the operators a layer's work is made of: none may be dispatched by the host in a compiled step
LAYER_OPS = ("mm", "addmm", "bmm", "linear", "matmul", *BF16_OPS, PACKED_LINEAR, "index_select", "index_copy_", "mul",
             "add", "rsqrt", "silu", "softmax", "_softmax", "scaled_dot_product_attention",
             "_scaled_dot_product_flash_attention_for_cpu")


def test_fused_decode_dispatches_no_eager_per_layer_ops(engines):
    """The eager rung's host dispatches every layer's operators; the fused rung's compiled step leaves
    the host only its buffer copies and the token read: none of a layer's operators, and a count that
    does not grow with the layers."""
    layers = engines("fused", torch.bfloat16).config.num_hidden_layers
    eager = served_op_names(engines("half", torch.bfloat16))
    compiled = served_op_names(engines("fused", torch.bfloat16))
    # ours on a CPU where they build
    matmuls = eager["mm"] + eager["addmm"] + eager["linear"] + sum(eager[op] for op in BF16_OPS) + eager[PACKED_LINEAR]
    assert matmuls >= 4 * layers, eager  # q/k/v/o, MLP, per layer
    assert not {name: n for name, n in compiled.items() if name in LAYER_OPS}, compiled
    assert sum(compiled.values()) < sum(eager.values()) / 4, (compiled, eager)


def test_a_failing_compile_falls_back_to_eager_with_one_warning(engines, monkeypatch):
    """The server's runner falls back as the engine does: one warning, and the same tokens."""
    import warnings

    from engine_lib.step import compiled as compiled_step

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C compiler found (simulated)")

    monkeypatch.setattr(compiled_step, "BACKEND", broken_backend)
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    fused, eager = engines("fused", torch.float32), engines("kv_cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, sched = served(fused, PROMPTS[:3], 6, **GREEDY)
    ours = [w for w in caught if "torch.compile failed" in str(w.message)]
    assert len(ours) == 1 and "no C compiler" in str(ours[0].message)
    assert sched.runner.step_form == "eager"
    assert got == served(eager, PROMPTS[:3], 6, **GREEDY)[0]


def test_one_compile_serves_every_read_span(engines, monkeypatch):
    """A decode batch's read span grows in steps of 256 positions as its rows grow. The span is a symbol in
    the compiled step (the size of the state's ``span`` buffer), so a longer span reuses the compile: an int
    there made every span a compile of its own, until dynamo's recompile limit turned the step eager."""
    from torch._dynamo.utils import counters

    from engine_lib.step import compiled as compiled_step

    monkeypatch.setattr(compiled_step, "BACKEND", "eager")  # dynamo's tracing and guards, no inductor build
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    monkeypatch.setattr(compiled_step, "_VARIANTS", {})
    torch._dynamo.reset()
    fused = engines("fused")
    cache = PagedKVCache.from_budget(fused.config, 0.05, fused.dtype, "cpu")
    sched = ServingLoop(fused.model, fused.tokenizer, cache, SchedulerConfig(prefix_caching=False), compile_step=True)
    before = counters["stats"]["unique_graphs"]
    prompt = list(range(1000, 1000 + SPAN_BUCKET - 4))  # its decode crosses from a span of 256 into one of 512
    sched.start()
    try:
        sched.generate([prompt], fused.sampling(do_sample=False, stop_token_ids=[], max_tokens=12))
    finally:
        sched.stop()
    assert {span for _, span in sched.runner.states} == {SPAN_BUCKET, 2 * SPAN_BUCKET}
    assert sched.runner.step_form == "compiled" and not sched.runner.steps.step.fallbacks
    assert counters["stats"]["unique_graphs"] - before == 1
