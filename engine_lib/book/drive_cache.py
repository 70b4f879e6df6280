"""Keep a Colab runtime's slow work on Google Drive: the model download and the reference outputs (chapter 00).

Every chapter opened in Colab starts a fresh runtime with an empty disk, so each one would download the
real model again and record ``transformers``' fp32 reference outputs again. ``keep_on_drive()`` mounts the
reader's Google Drive (Colab asks for permission) and points both caches at one folder there: the Hugging
Face cache (``HF_HUB_CACHE``), where the model lands, and the engine's own (``ENGINE_LIB_CACHE``), where
reference outputs are recorded. A later chapter that calls it first finds both. It is optional: without
it nothing changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

DRIVE = Path("/content/drive")  # where Colab mounts Google Drive
FOLDER = "MyDrive/qwen-engine-book"  # the book's folder on the reader's Drive


def _colab_mount(root: str) -> None:
    if "google.colab" not in sys.modules:
        raise RuntimeError("keep_on_drive() mounts Google Drive, which only Colab can do; elsewhere the caches "
                           "already persist on your disk (or pass mount= and root= for a folder of your own)")
    from google.colab import drive  # type: ignore[import-not-found]

    drive.mount(root)


def keep_on_drive(folder: str = FOLDER, root: str | Path = DRIVE,
                  mount: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Mount Drive at ``root`` (unless it is mounted already) and cache the model and the reference outputs
    under ``root/folder``. -> the two cache folders, {"hub": ..., "engine": ...}."""
    root = Path(root)
    if not (root / "MyDrive").is_dir():
        (mount or _colab_mount)(str(root))
    base = root / folder
    caches = {"hub": base / "huggingface" / "hub", "engine": base / "engine_lib"}
    for path in caches.values():
        path.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HUB_CACHE"] = str(caches["hub"])
    os.environ["ENGINE_LIB_CACHE"] = str(caches["engine"])
    if "huggingface_hub.constants" in sys.modules:  # already imported: it read HF_HUB_CACHE then
        sys.modules["huggingface_hub.constants"].HF_HUB_CACHE = str(caches["hub"])
    print(f"Caching on Google Drive: the model in {caches['hub']}, reference outputs in {caches['engine']}. "
          "Run this cell first in later chapters too.")
    return caches
