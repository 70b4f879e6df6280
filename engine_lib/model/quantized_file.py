"""A quantized model saved once in its kernels' own layout, and read back on every later start.

Defined in chapter 10 (fewer bytes); chapter 08's CPU record times both starts. The first start of a
quantized rung reads the bf16 checkpoint and quantizes it one tensor at a time (``loader``): on a
2-core CPU that is most of a 28-layer model's start-up. llama.cpp instead maps a file that is already
quantized. So, on a CPU, the loader writes the finished model once, beside the checkpoint
(``<checkpoint>.engine_lib/``) as safetensors, every tensor in the layout its kernel reads (int8 rows,
int4 two to a byte, AMX tiles); a later start maps that file, as llama.cpp maps its GGUF
(``cpu.huge_pages.mapped_file``): nothing is read or quantized again, the weights are held once, as the page
cache's, and Linux keeps most of a file written in large pieces there on 2 MiB folios, so most of them are on
huge pages from the first token.

The file says what it was made from, and a start uses it only if all of it still holds:

- ``format``: this module's version (bumped whenever the layout or the kernels' packing changes);
- ``source``: a hash of the checkpoint: config.json's bytes and each weight file's name, size, time and
  safetensors header (the names, shapes and offsets of its tensors). Hashing every weight byte would
  cost seconds at each start; a rewritten file changes its time;
- ``quant``, ``dtype``, ``isa`` (the instruction set the kernels were chosen for) and the torch version;
- a checksum of every tensor, and the header's own offsets against the file's size.

A stale file (any of the first three changed) or a corrupt one (truncated, unreadable, a checksum that
disagrees) is never used: the model is quantized from the checkpoint again and the file rewritten, with
a warning that says why (none for an older format alone, which every upgrade brings).
``ENGINE_LIB_QUANTIZED_FILE=0`` neither reads nor writes one.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import torch
from torch import nn

from ..quant.linear import quantized_linears
from .paths import checkpoint_hash, derived_dir

FORMAT = "engine_lib quantized model 3"  # 2: 64-bit word checksums; 3: the data starts on a page, for mapping
PAGE = 4096
ENV = "ENGINE_LIB_QUANTIZED_FILE"
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
NAMES = {v: k for k, v in DTYPES.items()}


class UnusableFile(Exception):
    """A saved file that must not be used: stale or corrupt (the message says which, and why). ``expected``: only
    its format is older than this version's, which every upgrade brings, so it is rebuilt without a warning."""

    def __init__(self, message: str, expected: bool = False):
        super().__init__(message)
        self.expected = expected


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def instruction_sets() -> str:
    """What the kernels and their layouts were chosen for: our kernels' set and PyTorch's (a CPU held to AVX2
    keeps a file of its own beside the full-width one)."""
    from ..cpu import kernels as cpu_kernels

    return f"{cpu_kernels.isa()}-{torch.backends.cpu.get_cpu_capability()}".lower()


def saved_path(model_dir: Path, quant: str, dtype: torch.dtype) -> Path:
    name = Path(model_dir).resolve().name
    dt = str(dtype).removeprefix("torch.")
    return derived_dir(model_dir, "engine_lib") / f"{name}-{quant}-{dt}-{instruction_sets()}.safetensors"


def signature(model_dir: Path, files: list[Path], quant: str, dtype: torch.dtype) -> dict[str, str]:
    """What a saved file must have been made from (``files``: the checkpoint's weight files) and for, to be used."""
    return {"format": FORMAT, "source": checkpoint_hash(model_dir, files), "quant": quant,
            "dtype": str(dtype).removeprefix("torch."), "isa": instruction_sets(), "torch": torch.__version__}


def checksum(t: torch.Tensor) -> int:
    """The sum of the tensor's bytes read as 64-bit words, wrapping around (the last few bytes, where the size is
    not a multiple of 8, added on their own): any byte changed, zeroed or cut off changes it, and it does not
    depend on where the tensor sits in memory. One read of the tensor, at memory speed."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    head = raw[:whole] if raw.data_ptr() % 8 == 0 else raw[:whole].clone()  # a 64-bit view needs 8-byte alignment
    total = int(head.view(torch.int64).sum()) if whole else 0
    return (total + int(raw[whole:].sum())) % (1 << 64)


# ------------------------------------------------------------------------------------------ saving
def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a start needs, by name: the parameters (a tied one once) and the int8 tile layout's
    column sums, which the kernel reads beside the tiles."""
    out = dict(model.named_parameters())  # a shared parameter is listed once
    for name, layer in quantized_linears(model).items():
        if hasattr(layer, "colsum"):
            out[f"{name}.colsum"] = layer.colsum
    return out


def save(model: nn.Module, path: Path, sig: dict[str, str]) -> int:
    """Write ``model`` to ``path`` (a temporary file renamed at the end, so a cut-off write never appears
    under the final name). -> bytes written."""
    tensors = state(model)
    layers = {name: {"kernel": m.kernel, "note": m.kernel_note} for name, m in quantized_linears(model).items()}
    meta = {**sig, "layers": json.dumps(layers), "checksums": json.dumps({k: checksum(t) for k, t in tensors.items()})}
    # largest element first, so every tensor starts on a multiple of its element size (no padding between)
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, at = {"__metadata__": meta}, 0
    for k in order:
        t = tensors[k]
        header[k] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % PAGE)  # the data starts on a page: each tensor as aligned as in a region
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for k in order:
            f.write(memoryview(tensors[k].detach().contiguous().view(-1).view(torch.uint8).numpy()))
    tmp.replace(path)
    return 8 + len(blob) + at


# ------------------------------------------------------------------------------------------ reading
def read(path: Path, sig: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of a saved file, mapped (``cpu.huge_pages.mapped_file``: copy on write, no copy made), and its
    metadata. Raises ``UnusableFile`` where it is stale or corrupt; the checksums are checked by ``verify``."""
    from ..cpu.huge_pages import mapped_file

    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            n = struct.unpack("<Q", f.read(8))[0]
            if n > size - 8:
                raise UnusableFile(f"corrupt: a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__", {})
            changed = [k for k in sig if meta.get(k) != sig[k]]
            if changed:
                raise UnusableFile(f"stale: its {', '.join(changed)} differ from this start's", changed == ["format"])
            end = max((e["data_offsets"][1] for e in header.values()), default=0)
            if end != size - 8 - n:
                raise UnusableFile(f"corrupt: the header's tensors end at {8 + n} + {end}, the file at {size}")
            if (8 + n) % PAGE:
                raise UnusableFile(f"corrupt: its tensors start at byte {8 + n}, not on a {PAGE}-byte page")
        data = mapped_file(path, 8 + n, end)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise UnusableFile(f"corrupt: {type(exc).__name__}: {exc}") from exc
    tensors = {k: data[e["data_offsets"][0]:e["data_offsets"][1]].view(DTYPES[e["dtype"]]).view(e["shape"])
               for k, e in header.items()}
    return tensors, meta


def restore(model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Point every parameter of ``model`` (built on the meta device) at its saved tensor and give each quantized
    layer its saved kernel. Raises ``UnusableFile`` on a missing tensor or a wrong shape; the checksums are checked
    by ``verify`` once the model is finished (one pass over the mapped file)."""
    sums, layers = json.loads(meta.get("checksums", "{}")), json.loads(meta.get("layers", "{}"))
    if set(sums) != set(tensors):
        raise UnusableFile("corrupt: its checksums and tensors do not match")
    quantized = quantized_linears(model)
    if set(layers) != set(quantized):
        raise UnusableFile(f"corrupt: it holds {len(layers)} quantized layers, the model {len(quantized)}")
    for name, how in layers.items():
        parts = {k.removeprefix(f"{name}."): t for k, t in tensors.items() if k.rpartition(".")[0] == name}
        quantized[name].restore_(parts, how["kernel"], how["note"])
    if "model.embed_tokens.weight" not in tensors and not model.embed_from_head():
        raise UnusableFile("corrupt: no embedding table, and the head's rows cannot stand in for one")
    missing = sorted(set(state(model)) - set(tensors))
    if missing:
        raise UnusableFile(f"corrupt: tensors missing: {missing[:3]}")
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        if owner in layers:
            continue
        module = model.get_submodule(owner)
        if tuple(getattr(module, attr).shape) != tuple(t.shape):
            raise UnusableFile(f"corrupt: {name} has shape {tuple(t.shape)}, the model "
                               f"{tuple(getattr(module, attr).shape)}")
        setattr(module, attr, nn.Parameter(t, requires_grad=False))


def verify(model: nn.Module, meta: dict) -> None:
    """Raises ``UnusableFile`` where a tensor of the restored model differs from the checksum saved with it."""
    sums = json.loads(meta.get("checksums", "{}"))
    for name, t in state(model).items():
        if name not in sums or checksum(t) != sums[name]:
            raise UnusableFile(f"corrupt: tensor {name!r} does not match its checksum")


def _refuse(path: Path, exc: UnusableFile) -> None:
    if exc.expected:
        return
    warnings.warn(f"{path.name} is not used and will be rebuilt from the checkpoint ({exc})", RuntimeWarning,
                  stacklevel=4)


def load_or_none(model: nn.Module, path: Path, sig: dict[str, str]) -> dict | None:
    """Fill ``model`` from the saved file at ``path`` -> its metadata, for ``verified`` once the tensors have moved;
    None (with a warning, unless there is no file) where there is none or it cannot be used."""
    if not path.is_file():
        return None
    try:
        tensors, meta = read(path, sig)
        restore(model, tensors, meta)
        return meta
    except UnusableFile as exc:
        _refuse(path, exc)
        return None


def verified(model: nn.Module, path: Path, meta: dict) -> bool:
    """Whether the restored ``model`` matches the checksums of ``path`` (a warning where it does not)."""
    try:
        verify(model, meta)
        return True
    except UnusableFile as exc:
        _refuse(path, exc)
        return False
