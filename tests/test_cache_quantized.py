"""The int8 KV cache: its rounding, its bytes, and an engine and a server that read it on every cached rung."""

import pytest
import torch

from engine_lib import Engine
from engine_lib.cache.paged import PagedKVCache
from engine_lib.cache.quantized import bytes_per_token, check_kv_cache_dtype, dequantize, quantize
from engine_lib.errors import UnsupportedOptionError
from engine_lib.model.checkpoints import ensure_checkpoint, preset_config

CACHED_RUNGS = ["kv_cache", "half", "fused", "int8", "int4"]


def test_quantize_keeps_each_value_within_half_a_step_of_its_row():
    x = torch.randn(3, 5, 2, 128) * torch.logspace(-3, 2, 5)[None, :, None, None]  # rows of very different sizes
    x[0, 0, 0] = 0.0  # an all-zero row: scale 0, zeros, no NaN
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1] and q.abs().max() <= 127
    assert scale[0, 0, 0] == 0 and not q[0, 0, 0].any()
    back = dequantize(q, scale, torch.float32)
    assert ((back - x).abs() <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12).all()
    assert (q.abs().amax(-1)[scale > 0] == 127).all()  # each row's largest value uses the whole range
    half = torch.tensor([[0.5, -0.5, 127.0]])  # ties round away from zero, as the Triton writer does
    assert quantize(half)[0].tolist() == [[1, -1, 127]]


def test_an_int8_token_takes_at_most_053_of_a_16_bit_one_at_the_real_shape():
    cfg = preset_config("qwen2.5-1.5b-random")
    fp16, int8 = bytes_per_token(cfg, torch.float16, None), bytes_per_token(cfg, torch.float16, "int8")
    assert fp16 == 28 * 1024 and int8 == 2 * 28 * 2 * (128 + 4)  # 28 KiB; 128 integers and a scale per head
    assert int8 / fp16 <= 0.53
    # a server's cache of the same GiB holds the tokens that fit (two reserved blocks aside)
    plain = PagedKVCache.from_budget(cfg, 0.25, torch.bfloat16, "meta")
    small = PagedKVCache.from_budget(cfg, 0.25, torch.bfloat16, "meta", kv_cache_dtype="int8")
    assert small.capacity_tokens >= 1.9 * plain.capacity_tokens
    assert small.nbytes <= 0.25 * 2**30 and small.k[0].dtype == torch.int8 and small.k_scale[0].shape[1] == 2


def test_unknown_kv_cache_dtypes_and_the_naive_rung_say_what_to_do():
    assert check_kv_cache_dtype("auto") is None and check_kv_cache_dtype("int8") == "int8"
    with pytest.raises(UnsupportedOptionError, match="unknown kv_cache_dtype 'fp8'"):
        Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(UnsupportedOptionError, match="needs a KV cache"):
        Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage="naive", kv_cache_dtype="int8")


def _same_as_full_prefills(engine, ids: list[int], got: list[int], rel: float) -> bool:
    """Whether each of ``got`` is the greedy token of a fresh int8 cache filled by one prefill of everything before
    it (no decode step): a token's integers and scale do not depend on when it was written, so the decode loop
    must agree. In bf16 the two paths round differently, so the first token that differs may only be a near-tie
    (within ``rel`` of the largest logit); after it the sequences part, and nothing more is compared."""
    from engine_lib.bench.kv_quality import _window_logits

    seq = list(ids)
    for tok in got:
        logits = _window_logits(engine.model, torch.tensor(seq), "int8", chunk=len(seq))[-1].float()
        best = int(logits.argmax())
        if tok != best:
            return bool(logits[best] - logits[tok] <= rel * logits.abs().max())
        seq.append(tok)
    return True


@pytest.mark.parametrize("stage", CACHED_RUNGS)
def test_every_cached_rung_decodes_from_the_int8_cache_as_a_prefill_of_everything_would(stage):
    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage=stage, kv_cache_dtype="int8")
    ids = engine.encode("Count the ducks in the pond, please.")
    out = engine.generate(ids, max_new_tokens=8, do_sample=False)
    assert _same_as_full_prefills(engine, ids, out.token_ids, rel=0.0 if engine.dtype == torch.float32 else 0.02)
    cfg = engine.config
    assert engine.kv_cache_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert engine.kv_cache_bytes == engine.loop.cache.batch * engine.loop.cache.max_len * engine.kv_cache_bytes_per_token


def test_the_int8_cache_barely_moves_the_trained_model(monkeypatch):
    """The trained preset's next-token distributions over held-out text, int8 cache against the bf16 one (the
    committed record measures 8,000 tokens; this, 1,000)."""
    from engine_lib.bench.kv_quality import compare_caches
    from engine_lib.bench.perplexity import text_ids
    from engine_lib.model.checkpoints import HELDOUT_TEXT

    engine = Engine.from_pretrained(ensure_checkpoint("qwen2-stdlib-small"), device="cpu", stage="half")
    ids = text_ids(engine.tokenizer, HELDOUT_TEXT.read_text(), 1024)
    r = compare_caches(engine.model, ids, context=128, chunk=32)
    assert r["tokens"] == 1016 and r["mean_kl_nats"] < 0.01 and abs(r["ppl_change"]) < 0.01
    assert r["greedy_agreement"] > 0.95
    # and it is measuring something: a cache that keeps 3 levels, not 255, moves the model far more
    import engine_lib.cache.quantized as quantized

    monkeypatch.setattr(quantized, "QMAX", 1.0)
    monkeypatch.setattr(quantized, "write_quantize", lambda x, kernel: quantized.quantize(x))  # torch's, coarse
    assert compare_caches(engine.model, ids[:256], context=128, chunk=32)["mean_kl_nats"] > 10 * r["mean_kl_nats"]


def test_prompt_lookup_on_the_int8_cache_gives_plain_greedy_output():
    model = ensure_checkpoint("tiny")
    plain = Engine.from_pretrained(model, device="cpu", stage="kv_cache", kv_cache_dtype="int8")
    spec = Engine.from_pretrained(model, device="cpu", stage="kv_cache", kv_cache_dtype="int8",
                                  speculative="prompt_lookup")
    ids = plain.encode("a b c d a b c d a b c d a b c d")
    want = plain.generate(ids, max_new_tokens=16, do_sample=False).token_ids
    assert spec.generate(ids, max_new_tokens=16, do_sample=False).token_ids == want


def test_the_server_reads_its_paged_int8_cache_as_the_engine_reads_its_own():
    """Paged (prefix caching, chunked prefill) and contiguous int8 caches store the same integers and scales, so in
    fp32 a server's greedy replies equal the engine's; /metrics reports the capacity."""
    from engine_lib.sampling import SamplingParams
    from engine_lib.serve.server import ServerOptions, build_state

    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage="kv_cache", kv_cache_dtype="int8")
    prompts = [engine.encode(p) for p in ("Name three rivers.", "Name three rivers and a lake.", "Hi")]
    want = [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens=6, do_sample=False)]
    state, _ = build_state(ServerOptions(model="unused", served_model_name="t", kv_cache_dtype="int8",
                                         kv_cache_gib=0.01, prefill_chunk=4), engine=engine)
    try:
        got = state.loop.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        got += state.loop.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.0))  # a prefix hit
        assert [g.token_ids for g in got] == [*want, want[0]]
        gauges = state.loop.gauges()
        cache = state.loop.cache
        assert cache.kv_cache_dtype == "int8"
        assert gauges["kv_cache_capacity_tokens"] == cache.capacity_tokens and gauges["kv_cache_bytes"] == cache.nbytes
    finally:
        state.loop.stop()
        state.loop.release()
