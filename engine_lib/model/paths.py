"""Where the engine keeps what it makes: its cache folder, and the files it derives from a checkpoint.

Defined in chapter 01 (the model and its files); chapter 08 and 10 add the derived files (GGUF for llama.cpp,
the saved quantized model).
"""

from __future__ import annotations

import hashlib
import os
import struct
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


def checkpoint_hash(model_dir: str | os.PathLike, files: list[Path]) -> str:
    """What a derived file was made from: config.json's bytes, and each weight file's (``files``) name, size, time
    and safetensors header (the names, shapes and offsets of its tensors). Hashing every weight byte would cost
    seconds at each start; a rewritten file changes its time."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in sorted(set(files)):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(min(n, 1 << 24)))
    return h.hexdigest()


def read_into(f, view: memoryview) -> int:
    """Read from ``f`` (unbuffered, at its position) into ``view`` until it is full or the file ends, 64 MiB a call:
    the OS copies from its page cache, and no page of the file is mapped into this process. -> bytes read (fewer
    than ``view`` holds where the file ended first; the caller names that error)."""
    got = 0
    while got < len(view):
        step = f.readinto(view[got:min(len(view), got + (64 << 20))])
        if not step:
            break
        got += step
    return got
