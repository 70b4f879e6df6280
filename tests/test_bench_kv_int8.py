"""The int8 KV cache's record: the capacity load test on 127.0.0.1, the decode-step timing, targets and report."""

import torch

from engine_lib import Engine
from engine_lib.bench import kv_int8
from engine_lib.bench.kv_capacity import capacity, prompts
from engine_lib.model.checkpoints import ensure_checkpoint


def test_the_capacity_load_test_holds_as_many_more_requests_as_the_bytes_allow():
    """Tiny checkpoint (head_dim 32, bf16): an int8 token takes 2 x (32 + 4) bytes a head against 2 x 64, so the
    same memory holds 1.78x the tokens, and the server runs about that many more requests at once."""
    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage="half")
    out = capacity(engine, gib=0.0003, requests=24, prompt_words=20, max_tokens=4, timeout=60)
    auto, int8 = out["runs"]["auto"], out["runs"]["int8"]
    assert auto["errors"] == int8["errors"] == 0
    assert int8["capacity_tokens"] / auto["capacity_tokens"] > 1.7
    assert 3 <= auto["peak_running"] < int8["peak_running"] < out["runs"]["int8"]["requests"]
    assert 1.4 <= out["ratio"] <= 2.2  # whole prompts fit a whole number of times
    assert len(set(prompts(24, 20))) == 24


def test_a_decode_step_over_a_filled_cache_is_timed_for_both_caches():
    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage="half")
    r = kv_int8.step_times(engine.model, rows=2, context=64, rounds=2, steps=2)
    assert r["steps_each"] == 4 and set(r["step_ms"]) == {"auto", "int8"} and r["speedup"] > 0
    st = kv_int8.filled_cache(engine.model, 2, 64, "int8")
    assert st.cache.k[0].dtype == torch.int8 and st.cache.k[0][:, :, :64].abs().max() == 127
    assert st.positions.flatten().tolist() == [64, 64]


def test_the_report_states_each_target_from_the_numbers():
    rungs = {"half": {"dtype": "bfloat16", "tokens": 2000, "context": 128, "chunk": 32, "mean_kl_nats": 0.02,
                      "max_kl_nats": 0.1, "ppl_ref": 10.0, "ppl_int8": 10.05, "ppl_change": 0.005,
                      "greedy_agreement": 0.97}}
    run = {"kv_cache_gib": 0.001, "requests": 40, "prompt_tokens": 100, "max_tokens": 8, "bytes_per_token": 1024,
           "blocks": 62, "capacity_tokens": 992, "peak_running": 9, "errors": 0}
    record = {"meta": {"cpu_model": "EPYC", "device_name": "CPU", "commit": "abc", "torch": "2", "threads": 2,
                       "timestamp": "now"},
              "bytes_per_token": {"real_shape": {"fp16": 28672, "int8": 14784}, "bytes_x": 14784 / 28672},
              "quality": {"model": "m", "text": "t", "rungs": rungs},
              "speed": {"model": "s", "layers": 28, "stage": "half", "dtype": "bfloat16", "runs": [
                  {"rows": 1, "context": 512, "step_ms": {"auto": 10.0, "int8": 10.0}, "speedup": 1.0},
                  {"rows": 1, "context": 4096, "step_ms": {"auto": 10.0, "int8": 10.0}, "speedup": 1.0}]},
              "capacity": {"model": "c", "runs": {"auto": run, "int8": {**run, "peak_running": 19}}, "ratio": 19 / 9}}
    met = {t["what"]: t["met"] for t in kv_int8.targets(record)}
    assert met["bytes per token, int8 / fp16 (real shape)"] and met["requests held at once, int8 / model dtype"]
    assert not met["mean KL divergence, nats (bf16)"] and met["perplexity change (bf16)"]
    assert met["decode step speed-up, 1 row(s) at 512 tokens"]  # no slower
    assert not met["decode step speed-up, 1 row(s) at 4096 tokens"]  # equal is not faster
    record["targets"] = kv_int8.targets(record)
    text = kv_int8.markdown(record)
    assert "Targets met: 4 of 6." in text and "| half (bfloat16) | 2,000 | 0.02000 |" in text
    assert kv_int8.capacity_rows(record)[0][:2] == ["model dtype", "1024"]
    assert "NOT met: mean KL divergence" in text
