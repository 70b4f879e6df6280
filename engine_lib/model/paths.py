"""Where the engine keeps what it makes: its cache folder, and the files it derives from a checkpoint.

Defined in chapter 01 (the model and its files); chapter 08 and 10 add the derived files (GGUF for llama.cpp,
the saved quantized model).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_LIB_CACHE", Path.home() / ".cache" / "engine_lib"))


def derived_dir(model_dir: str | os.PathLike, kind: str) -> Path:
    """Where files made from a checkpoint go (``kind``: "gguf" for llama.cpp's, "engine_lib" for the saved
    quantized model): ``<checkpoint>.<kind>/`` beside it, or inside the engine's cache when that folder is
    not ours to write (a Hugging Face hub snapshot, a read-only mount)."""
    model_dir = Path(model_dir).resolve()
    if model_dir.parent.name == "snapshots" or not os.access(model_dir.parent, os.W_OK):
        return default_cache_dir() / kind / model_dir.name
    return model_dir.parent / f"{model_dir.name}.{kind}"


