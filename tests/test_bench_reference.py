"""Reference outputs shipped with the package (``engine_lib.reference_outputs``), recorded by
``python -m engine_lib reference``: the record names its weights, and ``ensure_ground_truth`` reads it
instead of loading transformers only for those very weights; for any other checkpoint it records as before."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from engine_lib.bench import reference, reference_outputs
from engine_lib.bench.reference import IDS_FILE, LOGITS_FILE, ensure_ground_truth, load_ground_truth
from engine_lib.model.checkpoints import ensure_checkpoint

TOKENS = 3


@pytest.fixture(scope="module")
def record(tmp_path_factory, tiny_dir):
    """The command, run as a reader would, on the tiny checkpoint: one record in a folder of records."""
    root = tmp_path_factory.mktemp("shipped")
    out = root / "tiny-record"
    done = subprocess.run([sys.executable, "-m", "engine_lib", "reference", "--model", str(tiny_dir), "--out", str(out),
                           "--max-new-tokens", str(TOKENS), "--device", "cpu"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    assert "float32, cpu" in done.stdout
    return root, out


def test_record_format(record, tiny_dir, prompts):
    root, out = record
    meta, logits = load_ground_truth(out)
    sha = hashlib.sha256((tiny_dir / "model.safetensors").read_bytes()).hexdigest()
    assert meta["weights"] == {"model.safetensors": {"sha256": sha, "bytes": (tiny_dir / "model.safetensors").stat().st_size}}
    assert meta["max_new_tokens"] == TOKENS and meta["dtype"] == "torch.float32" and meta["repetition_penalty"] == 1.0
    assert meta["recorded"]["device"] == "cpu" and meta["recorded"]["transformers"]
    assert str(tiny_dir) not in json.dumps(meta)  # no local path in a file meant to ship
    assert [p["input_ids"] for p in meta["prompts"]] == prompts
    assert all(len(p["generated_ids"]) == TOKENS for p in meta["prompts"])
    assert len(logits) == len(prompts) and logits[0].dtype == torch.float32 and logits[0].shape == (151936,)
    assert reference_outputs.shipped_records(root)[0][0] == out


def test_shipped_record_is_used_and_transformers_not_loaded(record, tiny_dir, tmp_path, monkeypatch, capsys):
    root, out = record
    monkeypatch.setattr(reference_outputs, "SHIPPED", root)

    def no_transformers(*args, **kwargs):
        raise AssertionError("transformers was loaded although a record ships")

    monkeypatch.setattr(reference, "load_hf_model", no_transformers)
    assert ensure_ground_truth(tiny_dir, max_new_tokens=TOKENS) == out
    assert "shipped with engine_lib" in " ".join(capsys.readouterr().out.split())
    copy = tmp_path / "tiny-copy"  # the same weights elsewhere (no HF blob name): hashed, still matched
    shutil.copytree(tiny_dir, copy)
    assert ensure_ground_truth(copy, max_new_tokens=TOKENS) == out


def test_other_weights_fall_back_to_recording(record, tmp_path, monkeypatch, capsys):
    """Another checkpoint (seed 1: same shape, same file size, other values), or another token count,
    finds no shipped record and is recorded into the cache exactly as before."""
    root, out = record
    monkeypatch.setattr(reference_outputs, "SHIPPED", root)
    other = ensure_checkpoint("tiny", seed=1, root=tmp_path)
    assert reference_outputs.find_shipped(other, TOKENS) is None  # same size: hashed and told apart
    got = ensure_ground_truth(other, out=tmp_path / "gt", max_new_tokens=2)
    assert got == tmp_path / "gt" and (got / LOGITS_FILE).is_file() and (got / IDS_FILE).is_file()
    assert "recording them once with transformers" in " ".join(capsys.readouterr().out.split())
    assert reference_outputs.find_shipped(record[0] / "missing", TOKENS) is None


def test_hub_blob_names_are_their_sha256(tmp_path):
    blob = tmp_path / "blobs" / ("ab" * 32)
    blob.parent.mkdir()
    blob.write_bytes(b"not hashed")
    link = tmp_path / "snapshots" / "abc" / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(blob)
    assert reference_outputs.file_sha256(link) == "ab" * 32  # read from the name, not the bytes
    plain = tmp_path / "model.safetensors"
    plain.write_bytes(b"hashed")
    assert reference_outputs.file_sha256(plain) == hashlib.sha256(b"hashed").hexdigest()
    hub = tmp_path / "models--Qwen--Qwen2.5-1.5B-Instruct" / "snapshots" / "c0ffee"
    hub.mkdir(parents=True)
    assert reference_outputs.record_name(hub, {"m": {"sha256": "0123456789abcdef"}}) == "qwen2.5-1.5b-instruct-0123456789ab"
