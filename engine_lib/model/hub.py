"""Fetching a checkpoint from the Hugging Face hub: its size said before the download, one copy per machine.

Defined in chapter 00; the chapters that load a model go through it (``book.pick_model``), and so does
``python -m engine_lib generate``. The files land in the Hugging Face cache (``HF_HUB_CACHE``,
``~/.cache/huggingface/hub`` unless set), so every chapter of a Colab runtime, and every later
run on the same machine, reuses the one copy instead of downloading it again. Before a download,
one line says how large it is: the sum of the hub's own file sizes when the hub answers, else
the size computed from the config shipped with the package (the real model only).
"""

from __future__ import annotations

import fnmatch
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import Qwen2Config
from .loader import HUB_PATTERNS, resolve_model_dir

REAL_MODEL_ID = "Qwen/Qwen2.5-1.5B-Instruct"
REAL_CONFIG = Path(__file__).parents[1] / "assets" / "reference" / "qwen2.5-1.5b-instruct.config.json"  # shipped


@dataclass(frozen=True)
class DownloadPlan:
    repo_id: str
    cached: Path | None  # the copy already in the cache (nothing to download), else None
    nbytes: int | None  # what a download would fetch, None when neither the hub nor the package can say
    source: str  # where ``nbytes`` comes from, in words
    listed: bool = False  # the hub answered with its file sizes

    def line(self) -> str:
        """One sentence for the reader, said before anything is downloaded."""
        if self.cached is not None:
            return (f"{self.repo_id}: using the copy already in the Hugging Face cache ({self.cached}); "
                    "nothing to download.")
        size = f"{self.nbytes / 1e9:.2f} GB" if self.nbytes is not None else "size unknown"
        where = (f"into the Hugging Face cache ({hub_cache_dir()}); later chapters and runs on this machine "
                 "reuse this one copy.")
        if self.listed:
            return f"Downloading {self.repo_id} ({size}, {self.source}) {where}"
        return (f"{self.repo_id} is not in the local cache and the hub did not list its files; trying to "
                f"download it ({size}, {self.source}) {where}")


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def cached_copy(repo_id: str) -> Path | None:
    """The repo's snapshot already in the local cache (no network), or None."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache the hub client cannot read
        return None
    return path if any(path.glob("*.safetensors")) else None  # a config-only copy is not a checkpoint


def hub_size(repo_id: str) -> int:
    """Bytes of the files ``resolve_model_dir`` downloads (``HUB_PATTERNS``), from the hub's listing."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, files_metadata=True)
    return sum(s.size or 0 for s in info.siblings if any(fnmatch.fnmatch(s.rfilename, p) for p in HUB_PATTERNS))


def config_size(repo_id: str) -> tuple[int, str] | None:
    """The real model's download, computed from the config shipped with the package: every parameter in
    bfloat16 (2 bytes; the checkpoint's ``torch_dtype``). Its tokenizer and JSON files are not counted."""
    if repo_id != REAL_MODEL_ID:
        return None
    n = Qwen2Config.from_json(REAL_CONFIG).num_parameters()
    return 2 * n, f"computed from its config: {n:,} parameters x 2 bytes (bfloat16), tokenizer files not counted"


def plan_download(repo_id: str) -> DownloadPlan:
    """What fetching ``repo_id`` will cost, found out without downloading anything."""
    cached = cached_copy(repo_id)
    if cached is not None:
        return DownloadPlan(repo_id, cached, 0, "cached")
    if not _offline():
        try:
            return DownloadPlan(repo_id, None, hub_size(repo_id), "the hub's file sizes", listed=True)
        except Exception:  # unreachable or unknown: say what the package knows instead
            pass
    known = config_size(repo_id)
    return DownloadPlan(repo_id, None, *(known or (None, "the hub did not answer")))


def _print_wrapped(text: str) -> None:
    print(textwrap.fill(text, 76, break_long_words=False, break_on_hyphens=False), flush=True)  # the book's width


def fetch_model(model: str | os.PathLike, say: Callable[[str], None] = _print_wrapped) -> Path:
    """A checkpoint folder as given, or a hub repo id fetched into the Hugging Face cache, its size said
    first. Raises ``ModelNotFoundError`` (from ``resolve_model_dir``) when it cannot be had."""
    path = Path(model).expanduser()
    text = str(model)
    if path.is_dir() or path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return resolve_model_dir(model)  # a folder (or not a repo id: its own error)
    plan = plan_download(text)
    if plan.cached is not None:
        say(plan.line())
        return plan.cached
    if not _offline():
        say(plan.line())
    return resolve_model_dir(text)
