"""Load a Hugging Face Qwen2 checkpoint (safetensors only) into the from-scratch model.

Defined in chapter 02 (from tokens to vectors). Tensors are read one at a time from
memory-mapped files and cast straight to the target dtype and device, so host memory
never holds a second full copy of the weights. Nothing is ever unpickled. A quantized
model (chapter 10) gets each linear layer's weight quantized as soon as it is read.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..cpu.huge_pages import Placer, drop_file_pages, file_ranges, move_to_huge_pages, unavailable_reason
from ..cpu.matmul import use_cpu_kernels
from ..errors import ModelNotFoundError, WeightLoadError
from ..quant.linear import quantized_linears
from ..tracking import note
from . import quantized_file
from .config import Qwen2Config
from .paths import read_into
from .qwen2 import ModelOptions, Qwen2ForCausalLM

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
    checkpoint tensors it is made of, straight into its final buffer. With ``options.quant``,
    each linear layer's weight (packed ones after concatenation) is quantized as soon as it is
    read, so at most one layer's weight exists in full precision at a time; a tied LM head is
    quantized from the embedding tensor, which is read once for both. On a CPU the quantized model
    is saved once beside the checkpoint and read back on later starts (``quantized_file``).
    """
    cfg = config or Qwen2Config.from_json(model_dir)
    files = weight_files(model_dir)
    saved = None
    if options is not None and options.quant and device.type == "cpu" and quantized_file.enabled():
        saved = quantized_file.saved_path(model_dir, options.quant, dtype), \
            quantized_file.signature(model_dir, list(files.values()), options.quant, dtype)
        model = _on_meta(cfg, options)
        meta = quantized_file.load_or_none(model, *saved)
        if meta is not None:
            model = _finish(model, device, placed=True)
            if quantized_file.verified(model, saved[0], meta):  # checked in memory, after the move
                note(model, "engine weights")
                return model
    model = _on_meta(cfg, options)
    quantized = quantized_linears(model)
    shapes, sources = load_plan(model, cfg, quantized, files)
    reader = TensorReader(files, [src for parts in sources.values() for src, _ in parts])
    try:
        fill(model, shapes, sources, quantized, reader, dtype, device)
    finally:
        reader.close()
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model = _finish(model, device)
    if saved:
        quantized_file.save(model, *saved)
    note(model, "engine weights")
    return model


def _on_meta(cfg: Qwen2Config, options: ModelOptions | None) -> Qwen2ForCausalLM:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg, options)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def _finish(model: Qwen2ForCausalLM, device: torch.device, placed: bool = False
            ) -> Qwen2ForCausalLM:
    """After the weights are in: on a CPU, the embedding from a quantized head, huge pages (unless the weights were
    ``placed`` already: mapped from a saved model) and the kernels; the RoPE table moved to ``device``."""
    if device.type == "cpu":
        table = getattr(model.model.embed_tokens, "weight", None)
        if table is not None and model.embed_from_head():  # the table's file pages, if it was a view, go with it
            drop_file_pages(table.data_ptr(), table.nbytes, file_ranges())
        del table
        if not placed:
            move_to_huge_pages(model)  # before the kernels look at the weights (a blocked copy is made from them)
        use_cpu_kernels(model)
    model.rotary = model.rotary.to(device)  # the RoPE table is made on the CPU, even on meta (``RotaryEmbedding``)
    model.requires_grad_(False)
    return model.eval()


def load_plan(model: Qwen2ForCausalLM, cfg: Qwen2Config, quantized: dict, files: dict[str, Path]
              ) -> tuple[dict[str, tuple[int, ...]], dict[str, list[tuple[str, int]]]]:
    """What to read: every parameter by name and full-precision shape (a tied lm_head appears once, as
    embed_tokens; a quantized layer's integer tensors stand in for one ``<layer>.weight``), and the checkpoint
    tensors (name, rows) each is made of. A checkpoint tensor nothing reads is an error."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()
              if name.rpartition(".")[0] not in quantized or name.endswith(".bias")}
    shapes.update({f"{name}.weight": (m.out_features, m.in_features) for name, m in quantized.items()})
    packed = model.packed_sources()
    sources = {name: packed.get(name, [(name, shape[0])]) for name, shape in shapes.items()}
    if cfg.tie_word_embeddings and "lm_head" in quantized:
        sources["lm_head.weight"] = [("model.embed_tokens.weight", cfg.vocab_size)]
    wanted = {src for parts in sources.values() for src, _ in parts}
    # a tied checkpoint may still carry a copy of lm_head.weight: it is ignored, as in transformers
    unexpected = sorted(set(files) - wanted - {"lm_head.weight"})
    if unexpected:
        raise WeightLoadError(f"unexpected tensors in {files[unexpected[0]].name}: {unexpected[:5]}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    return shapes, sources


class TensorReader:
    """Checkpoint tensors by name, each read once, checked against the shape the config implies, and kept
    only while another target still needs it (the tied embedding)."""

    def __init__(self, files: dict[str, Path], reads: list[str]):
        self.files, self.handles, self.kept, self.headers = files, {}, {}, {}
        self.uses = Counter(reads)  # how many targets read each tensor

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.kept.pop(name) if name in self.kept else self.read(name, shape)
        self.uses[name] -= 1
        if self.uses[name] > 0:
            self.kept[name] = tensor
        return tensor

    def take_into(self, name: str, shape: tuple[int, ...], out: torch.Tensor) -> None:
        """``take`` into ``out`` (contiguous, CPU). Where the file holds the tensor in ``out``'s dtype and nothing
        else will read it, its bytes are read from the file straight into ``out``: the OS copies them from its page
        cache, where a copy from the file's mapping takes a page fault every few KiB. Measured on a 2-core EPYC VM
        held to AVX2, the 28-layer bf16 checkpoint into the half and fused rungs' regions (one start each): 1.85 to
        2.0 s against 2.4 to 2.6 s, of which populating the fresh pages takes about 0.9 s either way. Anything
        else (a cast, a bad header or shape, whose errors ``take`` names) is taken and copied."""
        span = self.span(name) if self.uses[name] == 1 and name not in self.kept else None
        if span is None or span[1] != out.dtype or span[2] != shape or span[4] - span[3] != out.nbytes:
            chunk = self.take(name, shape)
            out.copy_(chunk)
            self.release(name, chunk)
            return
        path, start, end = span[0], span[3], span[4]
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            got = read_into(f, memoryview(out.view(-1).view(torch.uint8).numpy()))
        if got < end - start:
            raise WeightLoadError(f"{path.name}: corrupt or truncated safetensors file (tensor {name!r} ends at byte "
                                  f"{end}, the file at {start + got})")
        self.uses[name] -= 1

    def span(self, name: str) -> tuple[Path, torch.dtype, tuple[int, ...], int, int] | None:
        """Where ``name``'s bytes are in its file: (path, dtype, shape, first byte, end), from the file's own
        header; None where the header cannot say (``take`` then reports why)."""
        path = self.files.get(name)
        if path is None:
            return None
        if path not in self.headers:
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(n)) if 0 < n < (100 << 20) else {}
                self.headers[path] = (8 + n, header)
            except (OSError, ValueError):
                self.headers[path] = (0, {})
        data, header = self.headers[path]
        entry = header.get(name)
        try:
            a, b = entry["data_offsets"]
            return path, quantized_file.DTYPES[entry["dtype"]], tuple(entry["shape"]), data + a, data + b
        except (TypeError, KeyError, ValueError):
            return None

    def release(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` (``take``'s) has been copied or quantized and nothing keeps it: let go of the file pages
        it was read from, once no other target will read it. Without this every page of the checkpoint that a
        quantized layer came from stays in this process until the file closes, and an int8 load peaks at the
        bf16 file plus its int8 copy."""
        if self.uses[name] <= 0 and tensor.device.type == "cpu":
            drop_file_pages(tensor.data_ptr(), tensor.nbytes, file_ranges())

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.files:
            where = ", ".join(sorted({p.name for p in self.files.values()}))
            raise WeightLoadError(f"tensor {name!r} is missing from the checkpoint ({where})")
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = _open(path)
        try:
            tensor = self.handles[path].get_tensor(name)
        except Exception as exc:
            raise WeightLoadError(f"{path.name}: cannot read tensor {name!r} ({exc})") from exc
        if tuple(tensor.shape) != shape:
            raise WeightLoadError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {shape} from config.json")
        return tensor

    def close(self) -> None:
        self.handles.clear()
        self.kept.clear()


def fill(model: Qwen2ForCausalLM, shapes: dict, sources: dict, quantized: dict, reader: TensorReader,
         dtype: torch.dtype, device: torch.device) -> None:
    """Every parameter from its checkpoint tensors: a quantized layer's weight quantized on the device as soon
    as it is read, a packed one concatenated in place, the others cast and moved (a 16-bit model on a CPU: read
    into its region, ``Placer``)."""
    # a 16-bit model on a CPU: every weight read straight into one region on 2 MiB pages (``Placer``), where a
    # quantized one is made on the heap and moved there afterwards (its float embedding may be dropped, ``_finish``)
    placer = None
    if device.type == "cpu" and not quantized and unavailable_reason() is None:
        placer = Placer([math.prod(shape) * dtype.itemsize for shape in shapes.values()])
    # targets that share a source tensor are filled one after the other, so it is held only briefly
    first = {}
    for i, name in enumerate(shapes):
        first.setdefault(sources[name][0][0], i)
    for name in sorted(shapes, key=lambda name: first[sources[name][0][0]]):
        shape = shapes[name]
        parts, tail = sources[name], shape[1:]
        layer = quantized.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if layer is not None:  # read in the checkpoint's dtype, quantize on the device, drop the floats
            chunks = [reader.take(src, (rows, *tail)) for src, rows in parts]
            weight = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            layer.quantize_(weight.to(device), dtype)
            del weight
            for (src, _), chunk in zip(parts, chunks):
                reader.release(src, chunk)
            del chunks
            continue
        if placer is not None:  # straight into the weights' region, cast as it is copied
            value = placer.empty(shape, dtype)
            start = 0
            for src, rows in parts:
                reader.take_into(src, (rows, *tail), value[start:start + rows])
                start += rows
        elif len(parts) == 1:
            src = reader.take(parts[0][0], shape)
            value = src.to(device=device, dtype=dtype)
            if value.data_ptr() != src.data_ptr():  # a cast or a move made a copy: the file's pages can go
                reader.release(parts[0][0], src)
            del src
        else:
            value = torch.empty(shape, dtype=dtype, device=device)
            start = 0
            for src, rows in parts:  # concatenate along the output rows, in place
                chunk = reader.take(src, (rows, *tail))
                value[start:start + rows].copy_(chunk)
                reader.release(src, chunk)
                start += rows
        _assign(model, name, value)


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
