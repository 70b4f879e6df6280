"""Chapter 15's scoreboard (engine_lib/book/scoreboard.py): every number on a board is the one in
its record, boards measured on a GPU come first, the GPU sentence is counted from the folder, and a
live board on the tiny checkpoint is labelled and complete."""

import json
from pathlib import Path

import pytest

from engine_lib.book import scoreboard
from engine_lib.book.scoreboard import HEADER, board_from_records, committed_boards, gpu_sentence

RESULTS = Path(__file__).resolve().parents[1] / "book" / "results"
KINDS = (".check.json", ".serve.json", ".kernels.json", ".quant.json", ".train.json", ".depth.json", ".kvcache.json",
         ".suffix.json")


def records(kind: str) -> list[dict]:
    """The committed records read straight from the folder (not through the module under test)."""
    out = []
    for p in sorted(RESULTS.glob("*.json")):
        if (kind == "bench" and not p.name.endswith(KINDS)) or p.name.endswith(f".{kind}.json"):
            out.append({**json.loads(p.read_text()), "file": p.name})
    return out


def test_every_committed_record_is_on_a_board_with_its_own_numbers():
    boards = committed_boards()
    benches, serves = records("bench"), records("serve")
    assert benches or serves, "no committed records to show"
    for rec in benches:
        board = next(b for b in boards if rec["file"] in b.source)
        rungs = {e.system: e for e in board.entries if e.part == "rung"}
        engines = {n: s for n, s in rec["systems"].items() if s["kind"] == "engine"}
        assert set(rungs) == set(engines)
        for name, s in engines.items():
            w = s["workloads"]["seed"]
            assert rungs[name].tok_s == pytest.approx(w["decode_tok_s"])
            assert rungs[name].ttft_ms == pytest.approx(w["ttft_ms"])
            assert rungs[name].dtype == s["dtype"]
        first = next(iter(engines.values()))["workloads"]["seed"]["decode_tok_s"]
        for name, e in rungs.items():
            assert e.ratio == pytest.approx(engines[name]["workloads"]["seed"]["decode_tok_s"] / first)
        if rec.get("speculative"):
            spec = [e for e in board.entries if e.part == "speculative"]
            for prompt, p in rec["speculative"]["prompts"].items():
                lookup = next(e for e in spec if e.system == f"prompt lookup · {prompt}")
                assert lookup.tok_s == pytest.approx(p["runs"]["prompt lookup"]["decode_tok_s"])
                assert lookup.ratio == pytest.approx(p["runs"]["prompt lookup"]["speedup"])
    for rec in serves:
        board = next(b for b in boards if rec["file"] in b.source)
        assert (board.device_name, board.model) == (rec["meta"]["device_name"], rec["meta"]["model"])
        lines = [e for e in board.entries if e.part == "server" and e.system.startswith(f"{rec['meta']['stage']} rung, ")
                 and "cached" not in e.system]
        levels = [lv for lv in rec["levels"] if not lv.get("skipped")]
        got = {e.system.rsplit(", ", 1)[1]: e for e in lines}
        for lv in levels:
            c = lv["concurrency"]
            e = got[f"{c} user{'s' if c > 1 else ''}"]
            assert e.tok_s == pytest.approx(lv["throughput_tok_s"])
            assert e.ttft_ms == pytest.approx(1e3 * lv["ttft_p50_s"])
    assert sum(len(b.entries) for b in boards) > 0
    for b in boards:
        assert all(len(row) == len(HEADER) for row in b.rows())
        assert ("RANDOM" in b.caption()) == (not b.real_weights)


def test_every_full_depth_record_is_a_board_of_its_rungs_best_readings():
    from engine_lib.bench.cpu_depth import best

    boards = committed_boards()
    for rec in records("depth"):
        board = next(b for b in boards if b.source == rec["file"])
        rungs = {e.system: e for e in board.entries}
        engines = {n.split(":")[1]: s for n, s in rec["systems"].items() if n.startswith("engine:")}
        assert set(rungs) == set(engines) and board.device == "cpu" and not board.real_weights
        for name, s in engines.items():
            assert rungs[name].tok_s == pytest.approx(best(s, "decode_tok_s")[0])
            assert rungs[name].ttft_ms == pytest.approx(best(s, "ttft_ms")[0])
        assert rungs["kv_cache"].dtype == "float32" and rungs["int4"].dtype == "bfloat16"


def test_the_gpu_sentence_is_counted_from_the_folder():
    metas = [r["meta"] for r in records("bench") + records("serve")]  # a full-depth record is a CPU one
    on_gpu = [m for m in metas if m["device"].startswith("cuda")]
    sentence = gpu_sentence(committed_boards())
    if on_gpu:
        assert "measured on a GPU (" in sentence and "None of" not in sentence
    else:
        assert sentence.startswith("None of the") and "no GPU numbers" in sentence


def fake_bench(device: str, stamp: str, rate: float) -> dict:
    seed = {"ttft_ms": 10.0, "decode_tok_s": rate, "new_tokens": 8, "prompt_tokens": [35]}
    return {"meta": {"model": "m", "real_weights": False, "device": device, "device_name": device.upper(),
                     "timestamp": stamp},
            "systems": {"kv_cache": {"kind": "engine", "dtype": "float32", "workloads": {"seed": seed}},
                        "half": {"kind": "engine", "dtype": "bfloat16",
                                 "workloads": {"seed": {**seed, "decode_tok_s": 2 * rate}}},
                        "broken": {"kind": "engine", "dtype": "bfloat16", "workloads": {"seed": {"error": "boom"}}},
                        "hf_generate_float32": {"kind": "hf", "dtype": "float32", "workloads": {"seed": seed}}},
            "file": f"{device}.json"}


def test_gpu_boards_come_first_then_the_newest(monkeypatch):
    fake = {"bench": [fake_bench("cpu", "2026-12-02T00:00:00Z", 5.0), fake_bench("cuda", "2026-01-01T00:00:00Z", 90.0),
                      {**fake_bench("cpu", "2026-12-03T00:00:00Z", 6.0), "file": "newer.json"}],
            "serve": [], "depth": []}
    fake["bench"][2]["meta"] = {**fake["bench"][2]["meta"], "device_name": "OTHER CPU"}
    import engine_lib.book as book

    monkeypatch.setattr(book, "committed_records", lambda kind="bench": fake[kind])
    boards = committed_boards()
    assert [b.source for b in boards] == ["cuda.json", "newer.json", "cpu.json"]
    assert gpu_sentence(boards).startswith("1 of the 3 committed board(s) were measured on a GPU (CUDA, m)")
    rungs = boards[0].entries
    assert [e.system for e in rungs] == ["kv_cache", "half", "broken"]  # transformers baselines are not rungs
    assert rungs[1].ratio == pytest.approx(2.0) and rungs[1].ratio_to == "kv_cache rung"
    assert rungs[2].tok_s is None and boards[0].rows()[2][3] == "n/a"


def test_a_board_from_a_serving_record_alone():
    serve = {"meta": {"model": "m", "device": "cpu", "device_name": "CPU", "stage": "half", "dtype": "bfloat16",
                      "max_tokens": 8, "timestamp": "2026-12-02T00:00:00Z"},
             "levels": [{"concurrency": 1, "requests": 4, "throughput_tok_s": 10.0, "ttft_p50_s": 0.1,
                         "speedup_vs_sequential": 1.0},
                        {"concurrency": 4, "skipped": True}]}
    board = board_from_records(None, [serve], "x.serve.json")
    assert [e.system for e in board.entries] == ["half rung, 1 user"]
    assert board.entries[0].ttft_ms == pytest.approx(100.0)


def test_a_live_board_on_the_tiny_checkpoint(tiny_dir):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    heard = []
    board = scoreboard.live_board(tiny_dir, "cpu", stages=["naive", "kv_cache"], new_tokens=4, repeats=1,
                                  users=(1, 2), requests=2, log=heard.append)
    assert board.source == "live" and not board.real_weights and "measured live" in board.caption()
    parts = [e.part for e in board.entries]
    assert parts.count("rung") == 2 and parts.count("speculative") == 4 and parts.count("server") == 2
    for e in board.entries:
        assert e.tok_s is not None and e.tok_s > 0, e
        assert e.ratio is not None and e.ratio > 0, e
    assert board.entries[0].ratio == pytest.approx(1.0)
    assert [h.split(":")[0] for h in heard] == ["naive", "kv_cache", "speculative", "server"]
    assert all("4 new tokens" in e.measured_as for e in board.entries if e.part != "server")


def test_the_rung_chart_draws_each_measured_rung_of_each_board():
    boards = [b for b in committed_boards() if any(e.part == "rung" and e.tok_s for e in b.entries)]
    assert boards, "no committed board with a rung"
    fig = scoreboard.rung_chart(boards)
    axes = fig.axes
    assert len(axes) == 2 * len(boards)
    for board, left, right in zip(boards, axes[0::2], axes[1::2]):
        rungs = [e for e in board.entries if e.part == "rung" and e.tok_s]
        assert [round(b.get_width(), 6) for b in left.patches] == [round(e.tok_s, 6) for e in rungs]
        assert [round(b.get_width(), 6) for b in right.patches] == [round(e.ttft_ms, 6) for e in rungs]
        assert board.device_name in left.get_title(loc="left")
    empty = scoreboard.Board("x", "cpu", "CPU", "m", False, "t")
    with pytest.raises(ValueError, match="no board has a measured rung"):
        scoreboard.rung_chart([empty])
