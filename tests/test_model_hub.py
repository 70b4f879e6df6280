"""Fetching from the hub (``engine_lib/model/hub.py``): the size is said before any download, from the hub's
listing or else from the shipped config, and a copy already in the Hugging Face cache is reused."""

import pytest
from huggingface_hub import constants

from engine_lib.errors import ModelNotFoundError
from engine_lib.model import hub
from engine_lib.model.checkpoints import REAL_MODEL_ID

REAL_BF16_BYTES = 1_543_714_304 * 2


def fake_cache(root, repo_id=REAL_MODEL_ID, weights=True):
    """The Hugging Face cache layout: refs/main names a snapshot folder of files."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    (snap / "config.json").write_text("{}")
    if weights:
        (snap / "model.safetensors").write_bytes(b"\0" * 8)
    return snap


def test_size_from_the_config_when_the_hub_is_silent(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "hub_size", lambda repo: (_ for _ in ()).throw(OSError("no network")))
    plan = hub.plan_download(REAL_MODEL_ID)
    assert plan.cached is None and plan.nbytes == REAL_BF16_BYTES and not plan.listed
    assert "3.09 GB" in plan.line() and "1,543,714,304 parameters x 2 bytes" in plan.line()
    assert "did not list" in plan.line()
    assert hub.plan_download("someone/else").nbytes is None  # no config shipped for it: no guess


def test_size_said_before_the_download(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hub, "hub_size", lambda repo: 3_100_000_000)
    said = []

    def download(repo):
        assert said and "Downloading Qwen/Qwen2.5-1.5B-Instruct (3.10 GB, the hub's file sizes)" in said[0]
        raise ModelNotFoundError("cannot download: test")

    monkeypatch.setattr(hub, "resolve_model_dir", download)
    with pytest.raises(ModelNotFoundError):
        hub.fetch_model(REAL_MODEL_ID, say=said.append)
    assert str(tmp_path) in said[0] and "reuse this one copy" in said[0]


def test_a_cached_copy_is_reused_without_any_download(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snap = fake_cache(tmp_path)
    monkeypatch.setattr(hub, "resolve_model_dir", lambda repo: pytest.fail("downloaded although cached"))
    monkeypatch.setattr(hub, "hub_size", lambda repo: pytest.fail("asked the hub although cached"))
    said = []
    assert hub.fetch_model(REAL_MODEL_ID, say=said.append) == snap
    assert "already in the Hugging Face cache" in said[0] and "nothing to download" in said[0]


def test_a_config_only_copy_is_not_a_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    fake_cache(tmp_path, weights=False)
    assert hub.cached_copy(REAL_MODEL_ID) is None


def test_folders_pass_through_silently(tiny_dir):
    said = []
    assert hub.fetch_model(tiny_dir, say=said.append) == tiny_dir and said == []


def test_chapter_01_loads_only_the_tokenizer():
    """Chapter 01 is about tokens: on Colab it must not fetch the 3.1 GB model, nor load any weights."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "chapters" / "01_tokens.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for call in ("pick_model", "pick_speed_model", "fetch_model", "Engine", "load_hf_model", "ensure_ground_truth",
                 "ensure_checkpoint", "from_pretrained("):
        assert call not in code, f"chapter 01 calls {call}"
    assert "load_tokenizer()" in code and "downloads nothing" in code
