import json
import os
import subprocess
import sys

import pytest

from engine_lib import Engine
from engine_lib.cli import CODE_PROMPT
from engine_lib.model.checkpoints import STDLIB_SMALL, ensure_checkpoint

PYTHON_WORDS = ("self", "def", "return", "if", "None", "import", "class", "raise", "for", "in", "not", "is")


def run(*args, timeout=600, **env):
    return subprocess.run([sys.executable, "-m", "engine_lib", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def between_rules(stdout: str) -> str:
    """The text ``generate`` prints between its two rules of dashes."""
    parts = stdout.split("-" * 60 + "\n")
    assert len(parts) == 3, stdout
    return parts[1].removesuffix("\n")


def python_words(text: str) -> int:
    """How many whitespace-separated pieces of ``text`` are Python keywords or ``self`` (after stripping
    punctuation): a continuation of a Python prompt by a model that learned Python has many."""
    import re

    return sum(w in PYTHON_WORDS for w in re.split(r"[^A-Za-z_]+", text))


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


def test_offline_default_runs_the_trained_preset_on_python(tmp_path):
    """No hub: ``generate`` with no option runs the small model trained here, says so before any text,
    continues a Python prompt as raw text, and prints exactly what the engine makes of it on that preset."""
    out = run("generate", "--greedy", "--max-new-tokens", "40", ENGINE_LIB_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "not reachable" in out.stderr and f"using {STDLIB_SMALL}" in out.stderr and "NOT Qwen2.5" in out.stderr
    assert "RANDOM" not in out.stdout + out.stderr
    head = out.stdout.split("-" * 60)[0]
    assert f"model: {STDLIB_SMALL} [small model trained here" in head and "not Qwen2.5" in head
    text = between_rules(out.stdout)
    assert text.startswith(CODE_PROMPT)
    engine = Engine.from_pretrained(ensure_checkpoint(STDLIB_SMALL, root=tmp_path / "own"), device="cpu")
    ids = engine.tokenizer(CODE_PROMPT, add_special_tokens=False)["input_ids"]
    assert text == CODE_PROMPT + engine.generate(ids, max_new_tokens=40, do_sample=False).text  # the preset's text
    assert python_words(text.removeprefix(CODE_PROMPT)) >= 6, text  # recognisable Python
    assert "40 new tokens" in out.stdout and "TTFT" in out.stdout


def test_python_words_tells_the_trained_preset_from_random_weights(tiny_dir):
    """The check above can fail: the random tiny checkpoint's continuation of the same prompt has
    (almost) no Python in it."""
    engine = Engine.from_pretrained(tiny_dir, device="cpu")
    ids = engine.tokenizer(CODE_PROMPT, add_special_tokens=False)["input_ids"]
    assert python_words(engine.generate(ids, max_new_tokens=40, do_sample=False).text) < 6


def test_random_presets_stay_labelled(tmp_path):
    gen = run("generate", "--preset", "tiny", "--greedy", "--max-new-tokens", "3", "--prompt", "Hi",
              ENGINE_LIB_CACHE=str(tmp_path))
    assert gen.returncode == 0, gen.stderr
    assert "RANDOM weights" in gen.stdout and "not reachable" not in gen.stderr  # no hub call for a preset
    both = run("generate", "--preset", "tiny", "--model", str(tmp_path))
    assert both.returncode == 2 and "not both" in both.stderr


def test_reference_needs_the_real_model_or_a_folder():
    out = run("reference", "--out", "unused")
    assert out.returncode == 2 and "Qwen/Qwen2.5-1.5B-Instruct" in out.stderr
    listed = run("reference", "--list")
    assert listed.returncode == 0 and "shipped reference record(s)" in listed.stdout
