"""The prefix-cache part of the serving record: cold/warm TTFT through the openai client on the
tiny checkpoint (timings are not asserted, only that the warm requests hit), and its merge into
an existing record keeps every other key."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from engine_lib.bench import loadtest, prefix_ttft  # noqa: E402
from engine_lib.serve.server import BackgroundServer, ServerOptions, build_state  # noqa: E402


def test_system_prompt_has_the_asked_length_and_differs_by_seed(engines):
    tok = engines("kv_cache").tokenizer
    a, b = prefix_ttft.system_prompt(tok, 200, seed=1), prefix_ttft.system_prompt(tok, 200, seed=2)
    assert abs(len(tok.encode(a, add_special_tokens=False)) - 200) <= 2
    assert tok.encode(a)[:16] != tok.encode(b)[:16]  # no block of one is a block of the other


@pytest.mark.parametrize("caching", [True, False])
def test_warm_requests_hit_only_with_prefix_caching(engines, caching):
    engine = engines("kv_cache")
    state, _ = build_state(ServerOptions(model="unused", served_model_name="t", kv_cache_gib=0.02,
                                         max_model_len=512, prefix_caching=caching), engine=engine)
    with BackgroundServer(state) as srv:
        out = prefix_ttft.measure_prefix_ttft(srv.url, engine.tokenizer, system_tokens=160, repeats=2,
                                              log=lambda s: None)
    assert len(out["cold_ttft_s"]) == len(out["warm_ttft_s"]) == 2 and out["speedup"] > 0
    cold, warm = out["prompt_tokens_cold_warm"][0]
    assert 160 < cold and 160 < warm
    if caching:  # each warm request finds at least the system prompt's full blocks
        assert out["hit_tokens"] >= 2 * (160 // 16 - 1) * 16
    else:
        assert out["hit_tokens"] == out["query_tokens"] == 0


def test_merge_keeps_the_record_and_renders_both_parts(tmp_path):
    record = {"meta": {"model": "m", "device_name": "d", "requests": 1, "prompt_tokens_min": 1, "prompt_tokens_max": 2,
                       "max_tokens": 3, "stage": "half", "dtype": "bfloat16", "batch_invariant": True,
                       "kv_cache_gib": 1.0, "timestamp": "t", "git_commit": "c", "torch": "x", "note": "n."},
              "levels": [], "checks": {"nothing_lost": True}, "target": {"name": "x", "value": 7.0, "goal": ">= 5x",
                                                                          "met": True}}
    loadtest.write_record(record, tmp_path, "r")
    part = {"system_prompt_tokens": 1000, "repeats": 3, "prompt_tokens_cold_warm": [[1020, 1024]],
            "cold_ttft_p50_s": 2.0, "warm_ttft_p50_s": 0.25, "speedup": 8.0, "hit_tokens": 2000, "query_tokens": 4000,
            "target": {"met": True}, "model": "m", "device_name": "d", "stage": "half", "dtype": "bfloat16",
            "prefix_caching": True, "max_model_len": 1256, "timestamp": "t2", "git_commit": "c2", "note": ""}
    assert loadtest.merge_prefix_part(part, tmp_path, "r") == 0
    merged = json.loads((tmp_path / "r.serve.json").read_text())
    assert merged == {**record, "prefix_cache": part}
    md = (tmp_path / "r.serve.md").read_text()
    assert "| 1020 / 1024 | 2000 ms | 250 ms | 8.0x |" in md and "Target: x: measured 7.00x" in md and "n." in md
    assert loadtest.merge_prefix_part(part, tmp_path, "missing") == 1
