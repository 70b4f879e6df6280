"""The GPU check's plan fits the machine it will get (issue 26): printed before anything runs, every
cost with where it comes from, the default run within 360 s and 8 files; the serve phase skips with
one line where the server's packages do not import. No GPU and no torch needed."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402
import gpu_rungs  # noqa: E402


def plan(full=False, dry=False, wheels=Path(".whl")):
    return gpu_check.phases(dry, full, Path("ckpt"), Path("out"), "h200", Path("work"), wheels)


def test_device_probe_needs_no_torch_import():
    info = gpu_check.device_info()  # this machine: a GPU, or the CPU where nvidia-smi is missing
    assert set(info) == {"cuda", "name", "torch", "capability"} and (info["name"] != "cpu") == info["cuda"]


def test_default_plan_fits_six_minutes_and_eight_files():
    phases = plan()
    assert [p.name for p in phases] == ["install", "rungs", "checkpoint", "kernels", "bench", "serve"]
    assert 1 + sum(p.estimate_s for p in phases) <= gpu_check.BUDGET_S == 360  # + the device probe
    assert 1 + sum(len(p.files) for p in phases) <= gpu_check.MAX_FILES == 8


def test_every_cost_says_where_it_comes_from():
    for p in plan() + plan(full=True):
        for count, unit, _ in p.items:
            assert count > 0 and gpu_check.UNITS[unit].seconds > 0
    for unit in gpu_check.UNITS.values():
        assert unit.basis in ("stated", "CPU-scaled") and len(unit.reason) > 20


def test_plan_text_shows_each_phase_and_the_total():
    text = gpu_check.plan_text(plan(), gpu_check.BUDGET_S, False)
    for name in ("install", "rungs", "checkpoint", "kernels", "bench", "serve", "total"):
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert "OVER BUDGET" not in text and "CPU-scaled" in text and "stated" in text


def test_the_waste_is_cut_from_the_default_run():
    cases = gpu_rungs.matrix(dry=False)
    compiled = [c for c in cases if c[0] in gpu_rungs.COMPILED]
    assert sorted(r for r, _, _ in compiled) == ["fused", "int8"]  # one compile per compiled rung
    assert all(k == "default" for _, _, k in compiled)  # "efficient" would compile the default's graph again
    assert {r for r, _, _ in cases} == {"kv_cache", "half", "fused", "int8", "triton"}  # every rung still runs
    bench = next(p for p in plan() if p.name == "bench").cmd
    stages = bench[bench.index("--stages") + 1:bench.index("--repeats")]
    assert stages == ["fused", "triton"]  # no no-cache rung over 2,000 tokens; transformers in bf16 alone
    assert bench[bench.index("--repeats") + 1] == "1"  # no paired decode, no quantization accuracy
    install = next(p for p in plan() if p.name == "install").cmd
    assert "--no-deps" in " ".join(install)  # the device's own torch, Triton and transformers


def test_full_keeps_what_the_default_moved():
    cases = gpu_rungs.matrix(dry=False, full=True)
    assert ("fused", "bfloat16", "cudnn") in cases and ("fused", "float32", "default") in cases
    assert ("fused", "bfloat16", "efficient") not in cases
    assert "gpu_tests" in [p.name for p in plan(full=True)]


def test_plan_flag_prints_the_plan_and_passes():
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--plan"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "where each unit cost comes from" in out.stdout and "of a 360 s budget" in out.stdout


@pytest.mark.parametrize("broken", ["fastapi", "openai"])
def test_serve_skips_with_one_line_without_its_packages(tmp_path, broken):
    (tmp_path / f"{broken}.py").write_text("raise ImportError('not in this image')\n")
    out = subprocess.run([sys.executable, str(SCRIPTS / "gpu_serve.py"), "--model", "m", "--out", str(tmp_path),
                          "--name", "n"], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("serve: skipped:") and broken in out.stdout and len(out.stdout.splitlines()) == 1
