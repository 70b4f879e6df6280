"""scripts/check_env.py: the test run refuses an environment that is not the locked one."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_env", ROOT / "scripts" / "check_env.py")
check_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_env)

LOCK = """# header
torch==2.13.0
Jupyter_Book==1.0.4.post1
pytest==9.2.0  # trailing comment
"""


def test_the_locked_set_passes_and_a_local_build_label_is_the_same_release():
    pins = check_env.read_lock(LOCK)
    installed = {"torch": "2.13.0+cpu", "jupyter-book": "1.0.4.post1", "pytest": "9.2.0", "pip": "23.2.1"}
    assert check_env.mismatches(pins, installed) == []


@pytest.mark.parametrize("installed, problem", [
    ({"torch": "2.13.0", "jupyter-book": "1.0.4.post1"}, "missing: pytest==9.2.0"),
    ({"torch": "2.13.0", "jupyter-book": "1.0.4.post1", "pytest": "8.4.1"}, "wrong version: pytest 8.4.1"),
    ({"torch": "2.14.1+cu128", "jupyter-book": "1.0.4.post1", "pytest": "9.2.0"}, "wrong version: torch"),
    ({"torch": "2.13.0", "jupyter-book": "1.0.4.post1", "pytest": "9.2.0", "numpy": "2.4.6"}, "not in the lock: numpy"),
])
def test_drift_from_the_lock_is_named(installed, problem):
    problems = check_env.mismatches(check_env.read_lock(LOCK), installed)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_a_lock_line_without_an_exact_pin_is_refused():
    with pytest.raises(ValueError, match="name==version"):
        check_env.read_lock("torch>=2.5\n")


def test_the_committed_lock_pins_what_the_test_command_needs():
    pins = check_env.read_lock((ROOT / "requirements-lock.txt").read_text())
    for name in ("torch", "transformers", "pytest", "nbmake", "jupyter-book", "fastapi", "openai", "ruff",
                 "lm-eval", "tenacity"):  # tenacity: lm-eval's API models (tests/test_serve_lm_eval.py)
        assert name in pins, name
    assert pins["torch"] == "2.13.0"  # the CPU wheel; plain PyPI 'torch' would pull a CUDA build
    assert pins["jupyter-book"].startswith("1.")
