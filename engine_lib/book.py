"""Small helpers the chapters share: the environment printout, the model choice, showing source.

Used by every chapter in ``chapters/``; engine code itself never lives in a notebook.
"""

from __future__ import annotations

import inspect
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints import REAL_MODEL_ID, ensure_checkpoint
from .errors import ModelNotFoundError
from .loader import resolve_model_dir

RANDOM_NOTE = ("NOTE: offline RANDOM-weight checkpoint. Generated text is meaningless, and "
               "timings are {device} timings at a reduced model size, not GPU figures.")


@dataclass(frozen=True)
class ModelChoice:
    path: Path
    name: str  # what every figure and table names
    is_real: bool
    device: str

    @property
    def note(self) -> str:
        return "real Qwen2.5-1.5B-Instruct weights" if self.is_real else RANDOM_NOTE.format(device=self.device.upper())


def device_name(device: str | torch.device | None = None) -> str:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment_report() -> str:
    """Versions and device, printed at the top of every chapter."""
    import transformers

    lines = [f"python {platform.python_version()} | torch {torch.__version__} | transformers {transformers.__version__}",
             f"device: {device_name()}"]
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        lines.append(f"compute capability {cc[0]}.{cc[1]} | native bf16: {cc >= (8, 0)}")
    return "\n".join(lines)


def pick_model(preset: str | None = None, layers: int | None = None) -> ModelChoice:
    """The real model on a GPU with hub access; else the offline random checkpoint.

    ``ENGINE_BOOK_MODEL`` (a folder or repo id) overrides the choice; ``ENGINE_BOOK_PRESET``
    picks the offline preset (default ``tiny``, which keeps CI fast).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    override = os.environ.get("ENGINE_BOOK_MODEL")
    if override:
        path = resolve_model_dir(override)
        from .checkpoints import is_random_checkpoint
        return ModelChoice(path, path.name, not is_random_checkpoint(path), device)
    if device == "cuda":
        try:
            return ModelChoice(resolve_model_dir(REAL_MODEL_ID), REAL_MODEL_ID, True, device)
        except ModelNotFoundError as exc:
            print(f"real model unavailable ({exc}); falling back to the offline checkpoint")
    preset = preset or os.environ.get("ENGINE_BOOK_PRESET", "tiny")
    path = ensure_checkpoint(preset, layers)
    return ModelChoice(path, f"{path.name} (random weights)", False, device)


def show_source(obj) -> None:
    """Display the source of an engine_lib function or class, highlighted, in a notebook."""
    source = inspect.getsource(obj)
    try:
        from IPython.display import Code, display

        display(Code(source, language="python"))
    except ImportError:
        print(source)
