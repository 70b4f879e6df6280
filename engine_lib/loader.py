"""Load a Hugging Face Qwen2 checkpoint (safetensors only) into the from-scratch model.

Defined in chapter 02 (from tokens to vectors). Tensors are read one at a time from
memory-mapped files and cast straight to the target dtype and device, so host memory
never holds a second full copy of the weights. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import Qwen2Config
from .errors import ModelNotFoundError, WeightLoadError
from .memory_budget import note
from .model import ModelOptions, Qwen2ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model"]


def resolve_model_dir(path_or_repo_id: str | os.PathLike) -> Path:
    """A local checkpoint folder, or a hub repo id downloaded (or found in the cache)."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_repo_id)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelNotFoundError(f"no checkpoint folder at {text!r} (and it is not a hub repo id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        # tqdm progress bars come from huggingface_hub itself
        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except LocalEntryNotFoundError as exc:
        hint = ("HF_HUB_OFFLINE is set and the model is not in the local cache"
                if offline else "the hub could not be reached and the model is not cached")
        raise ModelNotFoundError(
            f"cannot load {text!r}: {hint}. Make an offline checkpoint with "
            f"`python -m engine_lib make-checkpoint --preset tiny --out DIR` and pass DIR.") from exc
    except Exception as exc:  # network errors, gated or missing repos
        raise ModelNotFoundError(f"cannot download {text!r} from the hub: {exc}") from exc


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise WeightLoadError(f"shard {f.name} listed in {index.name} is missing from {model_dir}")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        extra = f" (found {pickled}: pickle files are never loaded)" if pickled else ""
        raise WeightLoadError(f"no model.safetensors or {INDEX_FILE} in {model_dir}{extra}")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightLoadError(f"{path.name}: corrupt or truncated safetensors file ({exc})") from exc


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, options: ModelOptions | None = None,
               config: Qwen2Config | None = None) -> Qwen2ForCausalLM:
    """Build the model on the meta device, then fill it tensor by tensor from the checkpoint.

    A packed parameter (``qkv_proj``, ``gate_up_proj``) is filled by concatenating the
    checkpoint tensors it is made of, straight into its final buffer.
    """
    cfg = config or Qwen2Config.from_json(model_dir)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg, options)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    files = weight_files(model_dir)
    expected = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    packed = model.packed_sources()
    sources = {name: packed.get(name, [(name, param.shape[0])]) for name, param in expected.items()}
    wanted = {src for parts in sources.values() for src, _ in parts}
    # a tied checkpoint may still carry a copy of lm_head.weight: it is ignored, as in transformers
    unexpected = sorted(set(files) - wanted - {"lm_head.weight"})
    if unexpected:
        raise WeightLoadError(f"unexpected tensors in {files[unexpected[0]].name}: {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    handles: dict[Path, object] = {}

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in files:
            where = ", ".join(sorted({p.name for p in files.values()}))
            raise WeightLoadError(f"tensor {name!r} is missing from the checkpoint ({where})")
        path = files[name]
        if path not in handles:
            handles[path] = _open(path)
        try:
            tensor = handles[path].get_tensor(name)
        except Exception as exc:
            raise WeightLoadError(f"{path.name}: cannot read tensor {name!r} ({exc})") from exc
        if tuple(tensor.shape) != shape:
            raise WeightLoadError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {shape} from config.json")
        return tensor

    try:
        for name, param in expected.items():
            parts, tail = sources[name], tuple(param.shape[1:])
            if len(parts) == 1:
                value = read(name, tuple(param.shape)).to(device=device, dtype=dtype)
            else:
                value = torch.empty(param.shape, dtype=dtype, device=device)
                start = 0
                for src, rows in parts:  # concatenate along the output rows, in place
                    value[start:start + rows].copy_(read(src, (rows, *tail)))
                    start += rows
            _assign(model, name, value)
    finally:
        handles.clear()
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # buffers (the RoPE table) were made on meta: rebuild them for real
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta).to(device)
    model.requires_grad_(False)
    note(model, "engine weights")
    return model.eval()


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
