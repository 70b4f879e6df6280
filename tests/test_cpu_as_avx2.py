"""scripts/cpu_as_avx2.sh: a command run under it sees an AVX2 CPU everywhere, and says it is one held back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cpu_as_avx2.sh"
PROBE = """
import os, torch
from engine_lib.cpu import kernels as cpu_kernels
from engine_lib.cpu import matmul as cpu_matmul
from engine_lib.bench.measure import device_name
print(torch.backends.cpu.get_cpu_capability())
print(cpu_matmul.half_matmul_is_native(), cpu_kernels.isa())
print(device_name("cpu"))
print(os.environ["ONEDNN_MAX_CPU_ISA"], os.environ["MKL_ENABLE_INSTRUCTIONS"])
print(os.environ["TORCHINDUCTOR_CACHE_DIR"])
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AVX2 is an x86 instruction set")
def test_the_command_runs_on_avx2_paths_and_is_labelled_so(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "ENGINE_LIB_NODE_LLAMA_CPP": str(tmp_path / "none")}
    out = subprocess.run(["bash", str(SCRIPT), sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, check=True).stdout.splitlines()
    assert out[0] == "AVX2"
    assert out[1].startswith("False")  # bf16 layers on the fp32 path of a CPU without bf16 instructions
    assert out[1].endswith(("avx2", "None"))  # our kernels' AVX2 variant (None: not built here)
    assert "AVX2" in out[2] and "AVX512" not in out[2].replace("AVX2 of an AVX512 CPU", "")
    assert out[3] == "AVX2 AVX2"
    assert out[4] == str(tmp_path / "engine_lib-inductor-avx2")  # never the full-width runs' cache


def test_without_a_command_it_says_how_to_use_it():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2 and "cpu_as_avx2.sh python -m engine_lib bench" in done.stdout
