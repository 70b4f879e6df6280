"""The full-depth CPU record (engine_lib/bench/cpu_depth.py): the order systems are taken in, the ratios and
targets from the best later starts with their spread, the report, and one real run of a rung in its own process."""

import json
import shutil
import time

import pytest
from depth_helpers import GIB, depth_record, reading

from engine_lib.bench import cpu_depth
from engine_lib.bench.measure import peak_memory_bytes
from engine_lib.model import quantized_file


def test_each_width_is_taken_beside_its_llama_cpp_files():
    order = cpu_depth.systems(list(cpu_depth.ENGINE_RUNGS), list(cpu_depth.HF_DTYPES), list(cpu_depth.GGUF_TYPES))
    assert order == ["hf:float32", "engine:kv_cache", "hf:bfloat16", "engine:half", "engine:fused", "llama.cpp:F16",
                     "llama.cpp:BF16", "engine:int8", "llama.cpp:Q8_0", "engine:int4", "llama.cpp:Q4_0",
                     "llama.cpp:Q4_K_M"]
    assert cpu_depth.systems(["int8"], [], []) == ["engine:int8"]


def test_ratios_come_from_the_best_later_starts_with_their_spread():
    rec = depth_record(int4_rate=40.0, q4_rate=35.0)
    r = {(v["rung"], v["peer"]): v for v in rec["ratios"]}
    assert set(r) == {("int8", "Q8_0"), ("int4", "Q4_0"), ("int4", "Q4_K_M")}
    v = r["int4", "Q4_0"]
    assert v["decode_x"] == pytest.approx(40 * 1.05 / (35 * 1.05))  # best against best
    assert v["decode_x_range"] == pytest.approx([40 * 0.95 / (35 * 1.05), 40 * 1.05 / (35 * 0.95)])
    assert v["ttft_x"] == pytest.approx(440 / 350) and v["rss_x"] == pytest.approx(1.4 / 1.9)
    assert v["start_x"] == pytest.approx(3.0 / 2.0)
    met = {(t["rung"], t["peer"], t["what"]): t["met"] for t in rec["targets"]}
    assert met["int4", "Q4_0", "decode_x"] is True and met["int4", "Q4_0", "start_x"] is True
    assert met["int8", "Q8_0", "rss_x"] is True  # 2.1 / 1.8 = 1.17 <= 1.25
    assert met["int8", "Q8_0", "decode_x"] is True and met["int4", "Q4_K_M", "ttft_x"] is True
    slower = depth_record(int4_rate=36.0, q4_rate=35.0)  # 1.03x: the goal is 1.1x
    assert {(t["rung"], t["peer"], t["what"]): t["met"] for t in slower["targets"]}["int4", "Q4_0", "decode_x"] is False


def test_a_failed_start_is_left_out_of_the_best():
    s = {"rounds": [reading(10, 100, 1), {"error": "exit 1"}, reading(12, 90, 1)]}
    assert cpu_depth.best(s, "decode_tok_s") == (12, 10, 12) and cpu_depth.best(s, "ttft_ms") == (90, 90, 100)
    assert cpu_depth.best({"rounds": [{"error": "x"}]}, "decode_tok_s") is None


def test_the_report_says_what_was_met_and_what_was_not():
    md = cpu_depth.markdown(depth_record(int4_rate=36.0, q4_rate=35.0))
    assert "| engine:int4 | 12.0 / 1.68 |" in md and "| int4 | Q4_0 | 1.03 (0.93-1.14) |" in md
    assert "- not met: int4 vs Q4_0, decode_x 1.03 (goal >= 1.1)" in md


def test_readings_count_the_first_token_from_the_launch():
    calls = []

    def reply(prompt, n):
        calls.append(n)
        return 0.5, 10.0 + len(calls)

    t0 = time.time() - 2.0  # launched two seconds ago
    out = cpu_depth.readings(reply, [[1], [2], [3]], t0, 1.5, 16, 2)
    assert calls == [8] + [16] * 6 and out["decode_tok_s"] == 14.5 and out["ttft_ms"] == 500
    assert 2.4 < out["first_token_s"] < 3.5 and out["load_s"] == 1.5 and out["peak_rss_bytes"] > 10 << 20
    assert peak_memory_bytes("cpu") > 10 << 20


def test_readings_say_how_much_sat_on_huge_pages_while_the_replies_were_timed():
    """The engine's probe is read as the timed replies begin and as they end (not at the start-up reply), and the
    report lists it for every later start; a system without a probe (transformers) has none."""
    probes = []

    def probe():
        probes.append(len(probes))
        return (1 + len(probes)) * GIB // 4

    out = cpu_depth.readings(lambda p, n: (0.1, 5.0), [[1], [2]], time.time(), 1.0, 4, 1, probe)
    assert out["huge_page_bytes"] == [GIB // 2, 3 * GIB // 4] and len(probes) == 2
    assert "huge_page_bytes" not in cpu_depth.readings(lambda p, n: (0.1, 5.0), [[1]], time.time(), 1.0, 4, 1)
    rec = depth_record(int4_rate=40.0, q4_rate=35.0)
    rec["systems"]["engine:int4"]["rounds"][1]["huge_page_bytes"] = [0, GIB]
    md = cpu_depth.markdown(rec)
    assert "On 2 MiB pages while the replies were timed" in md and "- engine:int4: 0.00 -> 1.00" in md


def test_a_rung_runs_in_its_own_process_first_quantizing_then_mapping(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(quantized_file.ENV, "1")  # the children inherit it: round 0 saves, round 1 maps
    ckpt = shutil.copytree(tiny_dir, tmp_path / "tiny")
    assert cpu_depth.main(["--model", str(ckpt), "--rungs", "int8", "--hf", "--rounds", "1", "--prompts", "1",
                           "--new-tokens", "4", "--out", str(tmp_path / "out"), "--name", "t"]) == 0
    rec = json.loads((tmp_path / "out" / "t.depth.json").read_text())
    s = rec["systems"]["engine:int8"]
    assert "error" not in s["first_start"] and len(s["rounds"]) == 1 and "error" not in s["rounds"][0]
    assert s["rounds"][0]["peak_rss_bytes"] > 100 << 20 and s["rounds"][0]["threads"] >= 1
    assert list(quantized_file.saved_path(ckpt, "int8", __import__("torch").bfloat16).parent.glob("*.safetensors"))
    assert rec["meta"]["layers"] == 4 and (tmp_path / "out" / "t.depth.md").is_file()
    assert s["rounds"][0]["peak_rss_bytes"] < 8 * GIB
