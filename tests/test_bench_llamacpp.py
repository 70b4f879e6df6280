"""llama.cpp as a bench peer (engine_lib/bench/llamacpp.py): where its systems sit in a run, the
ratios per width computed from a record, the one-line skip when the binding is missing, and, where
node-llama-cpp is installed, a quick bench that times it beside the half rung."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from engine_lib.bench.llamacpp import (
    add_peer_systems,
    gguf_types_for,
    load_line,
    peer_lines,
    peer_ratios,
    peer_targets,
    turn_about,
    unavailable_reason,
)
from engine_lib.bench.run import PRESETS, systems_for


def test_gguf_widths_follow_the_rungs_timed():
    assert gguf_types_for(["kv_cache", "half", "fused", "int8"]) == ["F16", "BF16", "Q8_0"]
    assert gguf_types_for(["int4"]) == ["Q4_0", "Q4_K_M"]
    assert gguf_types_for(["kv_cache"]) == ["F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M"]  # no width: all of them
    assert gguf_types_for(["half"], ["Q8_0", "Q8_0"]) == ["Q8_0"]  # asked for wins


def test_each_peer_is_timed_right_after_the_rungs_of_its_width():
    stages = ["kv_cache", "half", "fused", "int8", "int4"]
    systems = systems_for(torch.device("cpu"), stages, None, True, PRESETS["focused"])
    names = [s.name for s in add_peer_systems(systems, gguf_types_for(stages))]
    assert names[:10] == ["kv_cache", "half", "fused", "llama.cpp_F16", "llama.cpp_BF16", "int8", "llama.cpp_Q8_0",
                          "int4", "llama.cpp_Q4_0", "llama.cpp_Q4_K_M"]
    assert names[10:] == [s.name for s in systems if s.kind == "hf"]
    alone = add_peer_systems(systems_for(torch.device("cpu"), ["kv_cache"], None, False, PRESETS["quick"]), ["Q8_0"])
    assert [s.name for s in alone] == ["kv_cache", "llama.cpp_Q8_0"]


def _workload(ttfts, rates):
    return {"ttft_ms": sorted(ttfts)[len(ttfts) // 2], "decode_tok_s": sorted(rates)[len(rates) // 2],
            "ttft_ms_runs": ttfts, "decode_tok_s_runs": rates}


def test_ratios_per_width_with_their_spread_and_targets():
    record = {"meta": {"load_average": {"start": [1.5, 1.0, 0.5], "end": [2.0, 1.0, 0.5]}, "cpu_count": 2},
              "systems": {
                  "half": {"kind": "engine", "stage": "half", "dtype": "bfloat16", "peak_memory_bytes": 2 << 30,
                           "workloads": {"seed": _workload([100, 110, 120], [10, 11, 12])}},
                  "int8": {"kind": "engine", "stage": "int8", "dtype": "bfloat16", "peak_memory_bytes": 1 << 30,
                           "workloads": {"seed": _workload([50, 50, 50], [30, 31, 32])}},
                  "llama.cpp_F16": {"kind": "peer", "peer": "F16", "dtype": "F16", "peak_memory_bytes": 1 << 30,
                                    "workloads": {"seed": _workload([40, 40, 40], [20, 20, 20])}},
                  "llama.cpp_Q8_0": {"kind": "peer", "peer": "Q8_0", "dtype": "Q8_0", "skipped": "not installed",
                                     "workloads": {}}}}
    record["peer_ratios"] = ratios = peer_ratios(record)
    assert list(ratios) == ["half vs llama.cpp_F16 [seed]"]  # int8's peer was skipped: no ratio
    r = ratios["half vs llama.cpp_F16 [seed]"]
    assert r["bits"] == 16 and r["decode_x"] == pytest.approx(11 / 20) and r["ttft_x"] == pytest.approx(40 / 110)
    assert r["decode_x_range"] == pytest.approx([10 / 20, 12 / 20])
    assert r["decode_words"].endswith("slower than") and r["memory_x"] == 2
    targets = {t["target"]: t for t in peer_targets(record)}
    assert targets["half decode / llama.cpp_F16 decode (seed prompts)"]["met"] is False
    assert targets["llama.cpp_F16 TTFT / half TTFT (seed prompts)"]["met"] is False
    md = "\n".join(peer_lines(record))
    assert "| 16 | half | llama.cpp_F16 | seed | 11.0 / 20.0 | 0.55x (0.50-0.60) |" in md
    assert load_line(record["meta"]) == ("- machine load (1 / 5 / 15-minute load average, 2 cores): "
                                         "1.50 / 1.00 / 0.50 at the start; 2.00 / 1.00 / 0.50 at the end")


def test_turn_about_alternates_who_goes_first_and_keeps_pairs():
    calls = []

    def runner(name, ttft, rate):
        def run(prompts, n, batch):
            calls.append((name, prompts[0], n, batch))
            return ttft, rate, n
        return run

    turns = turn_about(runner("rung", 0.05, 30.0), runner("peer", 0.04, 20.0), [[1], [2], [3]], 8, 2)
    timed = calls[2:]  # after one warm-up each
    assert calls[:2] == [("rung", [1], 8, False), ("peer", [1], 8, False)]
    assert [c[0] for c in timed] == ["rung", "peer", "peer", "rung", "rung", "peer",  # round 1: prompts 1, 2, 3
                                     "peer", "rung", "rung", "peer", "peer", "rung"]  # round 2: the other way
    assert [c[1] for c in timed[::2]] == [[1], [2], [3]] * 2
    assert turns["rung_ttft_ms"] == pytest.approx([50.0] * 6) and turns["peer_decode_tok_s"] == [20.0] * 6


def test_turn_about_pairs_decide_the_seed_ratios_and_targets():
    record = {"systems": {
        "int4": {"kind": "engine", "stage": "int4", "dtype": "bfloat16", "peak_memory_bytes": 2 << 30,
                 "workloads": {"seed": _workload([60, 60, 60], [100, 100, 100]),
                               "long": _workload([900, 900, 900], [90, 90, 90])}},
        "llama.cpp_Q4_0": {"kind": "peer", "peer": "Q4_0", "dtype": "Q4_0", "peak_memory_bytes": 1 << 30,
                           "workloads": {"seed": _workload([50, 50, 50], [50, 50, 50]),
                                         "long": _workload([1000, 1000, 1000], [60, 60, 60])}}}}
    # alone, minutes apart, the rung's first token looked slower (50 / 60); side by side it came first in every pair
    record["peer_paired"] = {"int4 vs llama.cpp_Q4_0": {
        "rung": "int4", "peer": "llama.cpp_Q4_0", "rounds": 2, "prompts": 2, "new_tokens": 32,
        "rung_ttft_ms": [40, 42, 44, 40], "peer_ttft_ms": [44, 46, 44, 48],
        "rung_decode_tok_s": [100, 110, 90, 100], "peer_decode_tok_s": [50, 50, 50, 50]}}
    record["peer_ratios"] = ratios = peer_ratios(record)
    seed, long = ratios["int4 vs llama.cpp_Q4_0 [seed]"], ratios["int4 vs llama.cpp_Q4_0 [long]"]
    assert seed["paired"] and not long["paired"]
    assert seed["ttft_x"] == pytest.approx(statistics.median([44 / 40, 46 / 42, 44 / 44, 48 / 40]))
    assert seed["decode_x"] == pytest.approx(2.0) and long["ttft_x"] == pytest.approx(1000 / 900)
    assert seed["decode_words"] == "2.0x faster than"  # the pairs' median ratio, the figure printed beside it
    targets = {t["target"]: t for t in peer_targets(record)}
    assert targets["llama.cpp_Q4_0 TTFT / int4 TTFT (seed prompts, turn about)"]["met"] is True
    md = "\n".join(peer_lines(record))
    assert "| 4 | int4 | llama.cpp_Q4_0 | seed (turn about) | 100.0 / 50.0 | 2.00x" in md
    assert "| 41 / 45 |" in md and "Turn about: after each system was timed alone" in md


def _bench(tmp_path, env):
    cmd = [sys.executable, "-m", "engine_lib", "bench", "--quick", "--stage", "half", "--no-baselines", "--repeats", "2",
           "--batch", "0", "--peer", "llama.cpp", "--peer-types", "F16", "--out", str(tmp_path), "--name", "peer"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads((tmp_path / "peer.json").read_text()), (tmp_path / "peer.md").read_text()


def test_the_bench_times_llama_cpp_beside_the_half_rung(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp peer unavailable: {reason}")
    out, record, md = _bench(tmp_path, dict(os.environ))
    peer = record["systems"]["llama.cpp_F16"]
    assert list(record["systems"]) == ["half", "llama.cpp_F16"]
    for w in ("seed", "long"):
        r = peer["workloads"][w]
        assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 and r["new_tokens"] == record["meta"]["workloads"][w][
            "max_new_tokens"]
    assert peer["threads"] == torch.get_num_threads() and peer["gguf"]["type"] == "F16"
    assert peer["peak_memory_bytes"] > peer["base_rss_bytes"]  # the model's pages on top of the interpreter's
    assert {"half vs llama.cpp_F16 [seed]", "half vs llama.cpp_F16 [long]"} <= set(record["peer_ratios"])
    turns = record["peer_paired"]["half vs llama.cpp_F16"]  # then side by side, turn about
    assert len(turns["rung_ttft_ms"]) == len(turns["peer_ttft_ms"]) == turns["rounds"] * turns["prompts"]
    assert record["peer_ratios"]["half vs llama.cpp_F16 [seed]"]["paired"] and "seed (turn about)" in md
    assert "## llama.cpp at the same weight width" in md and "node-llama-cpp" in md
