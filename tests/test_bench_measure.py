"""engine_lib/bench/measure.py: the profiler helpers count operators and print nothing on the page; the CPU is
labelled by the instructions it runs."""

import subprocess
import sys

import torch

from engine_lib.bench import measure
from engine_lib.bench.measure import cpu_profile, top_level_ops


def test_top_level_ops_counts_the_eager_operators():
    x = torch.ones(4)
    assert top_level_ops(lambda: (x + 1) * 2) >= 2  # an add and a mul at least
    assert top_level_ops(lambda: None) == 0


def test_the_profilers_native_lines_never_reach_the_output(capfd):
    """Kineto writes 'USDT: ... profiler_start' to file descriptor 2; a notebook shows fd 2."""
    with cpu_profile():
        torch.ones(3).sum()
    out, err = capfd.readouterr()
    assert "USDT" not in out + err and "profiler_start" not in out + err
    print("still here", file=sys.stderr)  # fd 2 is back afterwards
    assert "still here" in capfd.readouterr().err


def test_git_commit_says_when_the_engine_code_differs_from_the_commit(tmp_path, monkeypatch):
    from engine_lib.bench import measure

    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        out = "abc1234\n" if cmd[1] == "rev-parse" else (" M engine_lib/x.py\n" if dirty else "")
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    monkeypatch.setattr(measure.subprocess, "run", run)
    dirty = False
    assert measure.git_commit() == "abc1234"
    dirty = True
    assert measure.git_commit() == "abc1234+uncommitted"
    assert calls[-1][:4] == ["git", "status", "--porcelain", "--"] and calls[-1][4].endswith("engine_lib")


def test_a_cpu_held_back_to_avx2_is_never_labelled_an_avx2_machine(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    assert measure.cpu_instructions() == "AVX2"
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)  # ATEN_CPU_CAPABILITY=avx2 on it
    assert measure.cpu_instructions() == "AVX2 of an AVX512 CPU"
    assert "AVX2 of an AVX512 CPU" in measure.device_name("cpu")
