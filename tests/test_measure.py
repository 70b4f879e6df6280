"""engine_lib/bench/measure.py: the profiler helpers count operators and print nothing on the page."""

import sys

import torch

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
