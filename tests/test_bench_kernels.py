"""engine_lib/bench/kernels.py: every kernel beside the op it replaces, checked equal; timings only off the interpreter."""

import math

import pytest

from engine_lib.bench import kernels as bench_kernels
from engine_lib.model.checkpoints import preset_config

pytest.importorskip("triton")


def test_every_kernel_is_checked_against_what_it_replaces_and_not_timed_in_the_interpreter():
    record = bench_kernels.run("cpu", cfg=preset_config("tiny"), quick=True)
    rows = record["rows"]
    assert {r["kernel"] for r in rows} == {"add_rmsnorm", "rope_kv_write", "decode_attention", "int8_matvec"}
    for r in rows:
        assert r["max_abs_diff"] < 0.05, r  # bf16 on both sides
        assert math.isnan(r["ours_us"]) and r["bytes"] > 0
    text = bench_kernels.report(record)
    assert "not timed" in text and "GB/s" not in text
    assert max(len(line) for line in text.splitlines()) <= 90  # the book's column limit


def test_a_gpu_record_reads_as_time_speedup_and_share_of_the_copy_roofline():
    record = {"meta": {"device": "cuda", "device_name": "NVIDIA H200", "dtype": "bfloat16", "torch": "2.x",
                       "triton": "3.x", "interpreter": False, "copy_bandwidth_bytes_s": 4.0e12},
              "rows": [{"kernel": "decode_attention", "shape": "batch 1, context 4096", "baseline": "SDPA",
                        "bytes": 4_000_000, "ours_us": 2.0, "baseline_us": 5.0, "max_abs_diff": 0.0,
                        "speedup": 2.5, "gbps": 2000.0}]}
    text = bench_kernels.report(record)
    assert "copy roofline 4000 GB/s" in text and "(2.50x)" in text and "2000 GB/s =  50% of copy" in text
