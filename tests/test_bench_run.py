"""The benchmark's --quick mode runs end to end and writes an honest, labelled record."""

import json
import os
import subprocess
import sys

import pytest


def test_quick_bench_writes_json_markdown_and_chart(tmp_path):
    """Also: asked for the llama.cpp peer where node-llama-cpp is missing (an empty folder stands for
    its install), the bench says so in one line and runs the rest (CI has no binding)."""
    from engine_lib.bench.llamacpp import PACKAGE_ENV

    (tmp_path / "empty").mkdir()
    out = subprocess.run([sys.executable, "-m", "engine_lib", "bench", "--quick", "--out", str(tmp_path),
                          "--name", "quick", "--peer", "llama.cpp", "--peer-types", "F16"], capture_output=True,
                         text=True, timeout=1200, env={**os.environ, PACKAGE_ENV: str(tmp_path / "empty")})
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "peer" in line]
    assert len(said) == 1 and said[0].startswith("[bench] skipping the llama.cpp peer: "), said
    record = json.loads((tmp_path / "quick.json").read_text())
    assert record["meta"]["peer_skipped"] and not any(s["kind"] == "peer" for s in record["systems"].values())
    assert "peer_ratios" not in record
    meta = record["meta"]
    assert meta["device"] == "cpu" and not meta["real_weights"] and meta["git_commit"]
    assert meta["cpu_model"] and meta["huge_pages"]  # which host, and whether the weights had 2 MiB pages
    assert f"- CPU: {meta['cpu_model']}; {meta['huge_pages']}" in (tmp_path / "quick.md").read_text()
    assert {"naive", "kv_cache", "half", "fused", "hf_naive", "hf_generate_float32"} <= set(record["systems"])
    for name, system in record["systems"].items():
        for workload, r in system["workloads"].items():
            assert "error" not in r, (name, workload, r)
            assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0
    assert any(" vs hf_generate_float32 [seed]" in k for k in record["ratios"])
    assert "naive step / kv_cache step @512" not in record["ratios"]  # quick contexts are 64 and 256
    assert "fused step growth 64 -> 256" in record["ratios"] and "fused decode / half decode [seed]" in record["ratios"]
    assert record["roofline"]["kv_cache"]["roofline_tok_s"] > 0
    assert meta["complete"] and {t["target"] for t in record["targets"]} >= {"fused decode / half decode (seed prompts)"}
    fused = record["systems"]["fused"]
    assert fused["step_form"] == "compiled" and not fused["fallbacks"]
    # a bf16 cache's decode attention: our C++ kernel where it builds (cpu/kv_attention.py), else SDPA's
    from engine_lib.cpu import kernels as cpu_kernels

    if cpu_kernels.available():
        assert fused["attention_kernels"]["decode"] == "engine_lib_cpu.kv_attention"
    else:
        assert fused["attention_kernels"]["decode"].startswith("_scaled_dot_product")
    assert fused["attention_kernels"]["prefill"].startswith("_scaled_dot_product")
    assert record["systems"]["naive"]["attention_kernels"]["decode"].startswith("written out")
    assert fused["eager_ops_per_token"]["greedy"] <= 2 < record["systems"]["kv_cache"]["eager_ops_per_token"]["greedy"]
    md = (tmp_path / "quick.md").read_text()
    assert "RANDOM" in md and "| kv_cache |" in md and "## Targets" in md and "attention kernel" in md
    assert "- llama.cpp peer: skipped (" in md and "- machine load" in md
    assert (tmp_path / "quick.png").stat().st_size > 10_000


def test_the_triton_rung_is_not_benchmarked_where_it_would_be_labelled_wrongly(monkeypatch):
    """Under the interpreter it would time numpy; without Triton it would run as fused but be named triton."""
    import torch

    from engine_lib.bench.run import run_benchmark, stage_blocker
    from engine_lib.errors import UnsupportedOptionError

    cpu = torch.device("cpu")
    assert stage_blocker("fused", cpu) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in stage_blocker("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "need a CUDA GPU" in stage_blocker("triton", cpu)
    with pytest.raises(UnsupportedOptionError, match="stage 'triton' cannot run on cpu"):
        run_benchmark("unused", device="cpu", stages=["triton"])


def test_quantization_values_are_measured_on_a_model_that_learned_something(tiny_dir):
    """A random checkpoint is timed as itself, but its quantization damage is measured on the trained preset."""
    from engine_lib.bench.report import quant_accuracy_lines
    from engine_lib.bench.run import values_model_dir
    from engine_lib.model.checkpoints import STDLIB_SMALL, ensure_checkpoint

    trained = ensure_checkpoint(STDLIB_SMALL)
    assert values_model_dir(tiny_dir) == trained
    assert values_model_dir(trained) == trained
    acc = {"model": STDLIB_SMALL, "prompts": 3, "n_tokens": 8, "dtype": "bfloat16",
           "half_vs_fp32": {"max_dlogit": 0.01}}
    assert f"({STDLIB_SMALL}, 3 prompts, bfloat16)" in quant_accuracy_lines(acc)[1]


def test_a_decode_above_the_copy_roofline_is_explained_in_the_record():
    """A rung that decodes faster than the copy's bandwidth allows (a read stream beats a copy) gets a sentence
    that says why, and only then."""
    import copy
    from pathlib import Path

    from engine_lib.bench.report import markdown

    path = Path(__file__).parent / "data/ladder-4l-llamacpp.json"  # a 4-layer record with llama.cpp, for its layout
    record = json.loads(path.read_text())
    record["roofline"]["int8"]["fraction"] = 1.34
    assert "Above 100% (int8): a decode step only reads" in markdown(record)
    below = copy.deepcopy(record)
    for r in below["roofline"].values():
        r["fraction"] = 0.5
    assert "Above 100%" not in markdown(below)


def test_a_target_value_never_prints_as_its_goal_when_it_misses_or_meets_by_less():
    """Two decimals, three where two would print the goal's own number: a missed 1.0993 against >= 1.1x."""
    from engine_lib.bench.report import target_value

    def shown(value, goal, target="x / y", met=False):
        return target_value({"value": value, "goal": goal, "target": target, "met": met})

    assert shown(1.0993, ">= 1.1x") == "1.099"
    assert shown(1.1004, ">= 1.1x", met=True) == "1.100"
    assert shown(2.449, ">= 1.3x", met=True) == "2.45"
    assert shown(0.501, "<= 55%", met=True) == "50%"
    assert shown(-0.021, "<= 10%", target="fused step growth", met=True) == "-2.1%"
