"""Reference outputs shipped with the package, so that no chapter has to run ``transformers`` in fp32.

Defined in chapter 00; chapters 00, 04, 05, 07, 08 and the kernels chapter read them through
``bench.reference.ensure_ground_truth``, and ``bench.reference.record_reference`` writes them.
Recording the real model's reference (``transformers`` in float32, 100 greedy tokens for each of
the ten prompts) takes 6.2 GB of Colab's host memory while the model loads, and is redone in
every fresh runtime. So it is recorded once, by
``python -m engine_lib reference``, and committed under ``engine_lib/assets/reference/outputs/``.
A chapter uses a shipped record only when it was made from the very same weights; for any
other checkpoint (the offline ones in CI included) it records its own as before.

Format: one folder per record, ``outputs/<name>-<sha256 prefix>/``, holding

- ``ground_truth.json``: ``bench.reference.record_ground_truth``'s file (``max_new_tokens``,
  ``repetition_penalty`` 1.0, ``do_sample`` false, ``dtype``, and ``prompts``: for each of the ten
  seed prompts its ``input_ids`` and the 100 greedy ``generated_ids``), plus ``weights`` (each
  weight file's name -> ``{"sha256", "bytes"}``: the identity a checkpoint must match) and
  ``recorded`` (the ``transformers`` and ``torch`` versions, the device, the seconds it took);
- ``first_token_logits.safetensors``: float32 tensors ``prompt_0`` ... ``prompt_9``, each the
  (vocab,) logits of the token after its prompt (151,936 x 4 bytes, 0.6 MB each).

A weight file's sha256 is the hub's own name for it (the Hugging Face cache stores each large
file as ``blobs/<sha256>``), so a copy fetched from the hub is matched without reading it; any
other copy is hashed, and only when a record has a file of the same size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

IDS_FILE, LOGITS_FILE = "ground_truth.json", "first_token_logits.safetensors"  # a record's two files
SHIPPED = Path(__file__).parent.parent / "assets" / "reference" / "outputs"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name."""
    return sorted(Path(model_dir).glob("*.safetensors"))


def file_sha256(path: Path) -> str:
    """The sha256 of a file: the blob's name when ``path`` links into the Hugging Face cache, else read."""
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _SHA256.match(target.name):
        return target.name
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(model_dir: str | os.PathLike) -> dict[str, dict]:
    """Each weight file's name -> ``{"sha256", "bytes"}``."""
    return {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size} for p in weight_files(model_dir)}


def shipped_records(root: Path | None = None) -> list[tuple[Path, dict]]:
    """(folder, ground_truth.json) of every record under ``root`` (default: the package's)."""
    root = Path(root or SHIPPED)
    found = []
    for folder in sorted(root.glob("*/")) if root.is_dir() else []:
        if (folder / IDS_FILE).is_file() and (folder / LOGITS_FILE).is_file():
            found.append((folder, json.loads((folder / IDS_FILE).read_text())))
    return found


def find_shipped(model_dir: str | os.PathLike, max_new_tokens: int, root: Path | None = None) -> Path | None:
    """The shipped record made from exactly these weights, the book's ten prompts and ``max_new_tokens``,
    or None. Files are hashed only when some record lists files of the same names and sizes."""
    from ..model.tokenizer import seed_prompts

    sizes = {p.name: p.stat().st_size for p in weight_files(model_dir)}
    prompts = [p["input_ids"] for p in seed_prompts()]  # a record of other prompts answers other questions
    candidates = [(folder, meta) for folder, meta in shipped_records(root)
                  if meta.get("max_new_tokens") == max_new_tokens
                  and [r["input_ids"] for r in meta.get("prompts", [])] == prompts
                  and {n: w["bytes"] for n, w in meta.get("weights", {}).items()} == sizes]
    if not candidates or not sizes:
        return None
    ours = fingerprint(model_dir)
    return next((folder for folder, meta in candidates if meta["weights"] == ours), None)


def record_name(model_dir: str | os.PathLike, weights: dict[str, dict]) -> str:
    """``<checkpoint name>-<first 12 hex digits of the first weight file's sha256>``. A hub snapshot
    (``models--Qwen--Qwen2.5-1.5B-Instruct/snapshots/<commit>``) is named after its repo."""
    path = Path(model_dir).resolve()
    name = path.name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        name = path.parent.parent.name.split("--")[-1]
    first = next(iter(weights.values()))["sha256"][:12]
    return f"{name.lower()}-{first}"
