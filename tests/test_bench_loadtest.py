"""The serving record's engine-only references (bench/loadtest.py): what batching alone gives the engine, and
how the record says it. Timings are not asserted, only that both sides ran the same requests."""

from engine_lib.bench import loadtest

META = {"model": "m", "device_name": "d", "requests": 1, "prompt_tokens_min": 1, "prompt_tokens_max": 2,
        "max_tokens": 3, "stage": "fused", "dtype": "float32", "batch_invariant": False, "kv_cache_gib": 1.0,
        "timestamp": "t", "git_commit": "c", "torch": "x", "note": "n."}


def test_batch_reference_times_the_same_prompts_both_ways(engines, monkeypatch):
    engine = engines("kv_cache")
    calls = {"generate": [], "generate_batch": []}
    def spy(name):  # record what each side was asked, and still run it
        real = getattr(engine, name)

        def call(p, *args, **kw):
            calls[name].append(p)
            return real(p, *args, **kw)
        return call
    for name in calls:
        monkeypatch.setattr(engine, name, spy(name))
    prompts = loadtest.make_prompts(3, seed=0)
    out = loadtest.batch_reference(engine, prompts, max_tokens=4, rounds=2)
    assert out["rows"] == 3 and out["rounds"] == 2 and len(out["one_by_one_s"]) == len(out["batch_s"]) == 2
    assert calls["generate"] == prompts * 2  # every prompt alone, each round
    batches = [b for b in calls["generate_batch"] if len(b) > 1]  # generate asks it for one prompt at a time
    assert batches == [prompts] * 3  # the warm-up and one batch per round
    assert 0 < out["speedup_min"] <= out["speedup_p50"] <= out["speedup_max"]


def test_the_record_says_what_batching_alone_gives():
    record = {"meta": META, "levels": [], "checks": {"nothing_lost": True},
              "batch_reference": {"rows": 16, "rounds": 2, "one_by_one_s": [20.0, 22.0], "batch_s": [4.0, 4.0],
                                  "speedup_p50": 5.25, "speedup_min": 5.0, "speedup_max": 5.5},
              "ops": {"stage": "fused", "layers": 4, "rows": 4, "generate_per_token": 1.3125,
                      "generate_per_layer": 0.33, "served_per_step": 22, "served_per_layer": 5.5}}
    md = loadtest.markdown(record)
    assert "the first 16 of these prompts through one `Engine.generate_batch`" in md
    assert "5.25x (median of 2 interleaved rounds, 5.00-5.50x)" in md
    assert "`Engine.generate` 1.3 per token" in md  # not rounded to a whole operator


def test_the_median_of_an_even_number_of_rounds_is_the_mean_of_the_middle_two():
    out = loadtest.batch_speedups([10.0, 20.0], [2.0, 2.0])  # 5x and 10x
    assert out == {"speedup_p50": 7.5, "speedup_min": 5.0, "speedup_max": 10.0}


def test_rounds_pair_each_level_with_the_one_by_one_run_beside_it(monkeypatch):
    """A level's speed-up is the median of its rounds' own ratios (the host drifts between rounds); its other
    figures are the first round's; every round's replies are checked."""
    speeds = iter([40.0, 280.0, 50.0, 300.0, 45.0, 330.0])  # round by round: concurrency 1, then 16

    async def fake_level(base_url, model, prompts, max_tokens, c, api_key="none", timeout=300.0, ignore_eos=False):
        tok_s = next(speeds)
        results = [{"error": None, "text": f"reply {i}", "ttft_s": 0.1, "itl_s": [0.02], "completion_tokens": 2,
                    "decode_s": 0.02} for i in range(len(prompts))]
        return {"concurrency": c, "wall_s": 1.0, "results": results, **loadtest.summarize(results, 1.0),
                "throughput_tok_s": tok_s}

    monkeypatch.setattr(loadtest, "run_level", fake_level)
    monkeypatch.setattr(loadtest, "scrape", lambda url, key: {})
    record = loadtest.run_load("http://x", ["a", "b"], 2, [16, 1], model="m", log=lambda s: None, warm=False, rounds=3)
    one, sixteen = record["levels"]
    assert (one["concurrency"], sixteen["concurrency"]) == (1, 16)
    assert sixteen["round_speedups"] == [7.0, 6.0, 330.0 / 45.0] and sixteen["speedup_vs_sequential"] == 7.0
    assert sixteen["throughput_tok_s"] == 280.0 and one["round_tok_s"] == [40.0, 50.0, 45.0]
    assert record["checks"]["nothing_lost"] and record["checks"]["nothing_mixed"]
    md = loadtest.markdown({"meta": META, **record})
    assert "| 16 | 2/2 | 0 | 280.0 | 7.00x |" in md
    assert "concurrency 16 7.00x, 6.00x, 7.33x (tok/s 280.0, 300.0, 330.0); one by one 40.0, 50.0, 45.0 tok/s" in md


def test_replies_that_differ_from_solo_are_named_for_what_they_are():
    """Without batch invariance a differing reply is expected (and counted); with it, it is a fault."""
    row = {"completed": 4, "requests": 4, "errors": 0, "throughput_tok_s": 1.0, "speedup_vs_sequential": 1.0,
           "ttft_p50_s": 0.1, "ttft_p99_s": 0.1, "itl_p50_s": 0.1, "itl_p99_s": 0.1}
    levels = [{**row, "concurrency": 1, "mismatches": 0, "compared": 4},
              {**row, "concurrency": 16, "mismatches": 3, "compared": 4}]
    for invariant, want in ((False, "every reply equal to its solo run: no (3 of 4 at concurrency 16; this server is "
                                    "not batch-invariant"),
                            (True, "every reply equal to its solo run: NO (3 of 4 at concurrency 16)")):
        record = {"meta": {**META, "batch_invariant": invariant}, "levels": levels,
                  "checks": {"nothing_lost": True, "nothing_mixed": False}}
        assert want in loadtest.markdown(record)
    record["checks"]["nothing_mixed"] = True
    assert "every reply equal to its solo run: yes" in loadtest.markdown(record)
