import json
import subprocess
import sys

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "engine_lib", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("sub", [[], ["generate"], ["make-checkpoint"], ["reference"], ["bench"]])
def test_help(sub):
    out = run(*sub, "--help")
    assert out.returncode == 0 and "usage" in out.stdout


def test_make_checkpoint_and_generate(tmp_path):
    out = run("make-checkpoint", "--preset", "tiny", "--layers", "2", "--out", str(tmp_path / "ck"))
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["model_type"] == "qwen2"
    gen = run("generate", "--model", str(tmp_path / "ck"), "--greedy", "--max-new-tokens", "5", "--prompt", "Hi")
    assert gen.returncode == 0, gen.stderr
    assert "RANDOM weights" in gen.stdout and "TTFT" in gen.stdout and "tok/s" in gen.stdout


def test_clear_error_exit_for_a_missing_model(tmp_path):
    out = run("generate", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2 and "error: no checkpoint folder" in out.stderr
