"""A Hugging Face-layout Qwen2 checkpoint written as GGUF, the file format llama.cpp reads.

Defined for chapter 08 (results), where llama.cpp runs beside the engine's rungs on the same
weights (``bench/llamacpp.py``). Written with the ``gguf`` package from PyPI (llama.cpp's own
reader and writer of the format), at one of five widths:

- ``F16`` / ``BF16``: every matrix in 16 bits (the ``half`` rung's width);
- ``Q8_0``: blocks of 32 weights, int8 with one fp16 scale each (8.5 bits; the ``int8`` rung);
- ``Q4_0``: blocks of 32, 4-bit with one fp16 scale each (4.5 bits; the ``int4`` rung);
- ``Q4_K_M``: the 4-bit file most llama.cpp users download (also beside the ``int4`` rung), mixed
  as llama.cpp's quantize tool mixes it (``tensor_qtype``): Q4_K (super-blocks of 256 weights, 4.5
  bits) for most matrices, Q6_K (6.5625 bits) for the embedding and for ``attn_v`` and ``ffn_down``
  in about half the layers. The ``gguf`` package can read K-quants but not write them, so their
  blocks are encoded here (``bench/kquants.py``), with plain scales rather than llama.cpp's search.

Norm weights and biases stay float32, as llama.cpp's own converter leaves them. The tied LM
head is not written: llama.cpp's ``qwen2`` model reuses ``token_embd`` when ``output`` is
absent, so the head is quantized exactly as the embedding, as the engine's int rungs quantize it.
The tokenizer goes in the file too (llama.cpp will not load a model without one): the byte-level
BPE vocabulary and merges of ``tokenizer.json``, pre-tokenizer ``qwen2``.

``ensure_gguf`` caches each file beside the checkpoint (``<checkpoint>.gguf/``), keyed on the
checkpoint's config and weight files, and records how long the conversion took.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..model.config import Qwen2Config
from ..model.loader import _open, weight_files

GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
ROWS_PER_CHUNK = 4096  # quantize a matrix this many rows at a time: numpy's temporaries stay small
FORMAT_VERSION = 2  # bump when the written file changes, so cached files are rewritten


def gguf_names(cfg: Qwen2Config) -> dict[str, str]:
    """Checkpoint tensor name -> GGUF tensor name (llama.cpp's names for the ``qwen2`` model)."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight", "self_attn.o_proj.weight": "attn_output.weight"}
    for p in "qkv":
        per_layer[f"self_attn.{p}_proj.weight"] = f"attn_{p}.weight"
        per_layer[f"self_attn.{p}_proj.bias"] = f"attn_{p}.bias"
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in per_layer.items()})
    return names


def _check_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose from {GGUF_TYPES}")


def more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose ``attn_v`` and ``ffn_down`` a Q4_K_M file keeps at Q6_K (llama.cpp's
    ``use_more_bits``): the first and last eighth, and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_qtype(gguf_type: str, gguf_name: str, n_layers: int, tied: bool = True):
    """The GGML type of the matrix ``gguf_name`` in a ``gguf_type`` file (vectors stay float32 whatever
    this says: ``encode_tensor``). One type throughout, except in Q4_K_M, mixed as llama.cpp's quantize
    tool mixes it: Q6_K for the LM head (``token_embd`` when ``tied``: ``output`` is then absent and
    llama.cpp treats the embedding as the head) and for ``attn_v`` and ``ffn_down`` where ``more_bits``;
    Q4_K for every other matrix."""
    import gguf

    _check_type(gguf_type)
    T = gguf.GGMLQuantizationType
    if gguf_type != "Q4_K_M":
        return T[gguf_type]
    if gguf_name == ("token_embd.weight" if tied else "output.weight"):
        return T.Q6_K
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and more_bits(int(parts[1]), n_layers):
        return T.Q6_K
    return T.Q4_K


def encode_tensor(x: torch.Tensor, qtype) -> tuple[np.ndarray, object]:
    """One checkpoint tensor as GGUF data -> (array, its GGML type). Vectors stay float32. A matrix whose
    rows do not split into the type's blocks falls back: from a K-quant (256 weights a block) to Q8_0,
    as llama.cpp's quantize tool falls back (it picks Q5_0 for Q4_K, Q8_0 for Q6_K; never the case for
    Qwen2.5-1.5B, whose rows are 1536 and 8960 long); from any other type to F16."""
    import gguf
    from gguf.quants import quantize

    from .kquants import ENCODERS

    T = gguf.GGMLQuantizationType
    a = x.float().numpy()  # (rows, cols): bf16 has no numpy dtype, float32 holds it exactly
    if a.ndim == 1:
        return a, T.F32
    if qtype.name in ENCODERS and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = T.Q8_0
    if a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = T.F16
    if qtype == T.F16:
        return a.astype(np.float16), T.F16
    encode = ENCODERS.get(qtype.name) or (lambda chunk: quantize(chunk, qtype))
    chunks = [encode(a[r:r + ROWS_PER_CHUNK]) for r in range(0, a.shape[0], ROWS_PER_CHUNK)]
    return np.concatenate(chunks), qtype  # (rows, bytes per row) uint8


def token_table(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """The vocabulary of ``tokenizer.json`` as GGUF's token list and token types, padded to the
    embedding's rows (Qwen2.5 has 151,665 tokens and 151,936 rows: the rest are unused)."""
    import gguf

    raw = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens: dict[int, tuple[str, int]] = {i: (t, gguf.TokenType.NORMAL) for t, i in raw["model"]["vocab"].items()}
    for added in raw.get("added_tokens", []):
        text = added["content"]
        special = added.get("special") or (text.startswith("<|") and text.endswith("|>"))
        tokens[added["id"]] = (text, gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    if max(tokens) >= vocab_size:
        raise ValueError(f"tokenizer has id {max(tokens)}, but the embedding has only {vocab_size} rows")
    pad = ("[PAD{}]", gguf.TokenType.UNUSED)
    table = [tokens.get(i, (pad[0].format(i), pad[1])) for i in range(vocab_size)]
    return [t for t, _ in table], [int(k) for _, k in table]


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, gguf_type: str = "F16") -> int:
    """Write ``model_dir`` (config.json, safetensors, tokenizer.json) to the GGUF file ``out``.
    -> the bytes of its tensors (what one decode step reads: the tied head is the embedding)."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    cfg = Qwen2Config.from_json(model_dir)
    _check_type(gguf_type)
    names = gguf_names(cfg)
    files = weight_files(model_dir)
    missing = sorted(set(names) - set(files))
    if missing:
        raise ValueError(f"{model_dir} lacks tensors {missing[:5]}")

    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")  # this process's own: another may convert too
    w = gguf.GGUFWriter(str(tmp), arch="qwen2")
    w.add_name(model_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{gguf_type}"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = token_table(model_dir, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_tokenizer_pre("qwen2")  # llama.cpp's name for Qwen2's split regex
    w.add_token_list(tokens)
    w.add_token_types(types)
    # merges, eos/pad ids, add_bos_token = false and the chat template, read by the package itself
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=cfg.vocab_size).add_to_gguf(w, quiet=True)

    tensor_bytes = 0
    by_file: dict[Path, list[str]] = {}
    for hf in names:
        by_file.setdefault(files[hf], []).append(hf)
    for path, hf_names in by_file.items():
        with _open(path) as f:
            for hf in hf_names:
                qtype = tensor_qtype(gguf_type, names[hf], cfg.num_hidden_layers, cfg.tie_word_embeddings)
                data, t = encode_tensor(f.get_tensor(hf), qtype)
                w.add_tensor(names[hf], data, raw_dtype=t)
                tensor_bytes += data.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)  # only a complete file ever appears under its final name
    return tensor_bytes


def fingerprint(model_dir: Path) -> str:
    """What the cached file was made from (``paths.checkpoint_hash``, as for the saved quantized model) and by
    which writer (this module's format and the gguf package's version)."""
    from importlib.metadata import version

    from ..model.paths import checkpoint_hash

    h = hashlib.sha256(checkpoint_hash(model_dir, list(weight_files(model_dir).values())).encode())
    h.update(f"format {FORMAT_VERSION}, gguf {version('gguf')}".encode())
    return h.hexdigest()[:16]


def gguf_dir(model_dir: Path) -> Path:
    """``<checkpoint>.gguf/`` beside the checkpoint (or in the engine's cache: ``checkpoints.derived_dir``)."""
    from ..model.paths import derived_dir

    return derived_dir(model_dir, "gguf")


def ensure_gguf(model_dir: str | os.PathLike, gguf_type: str = "F16", out_dir: str | os.PathLike | None = None) -> dict:
    """The GGUF file of ``model_dir`` at ``gguf_type``, converted once and reused while the checkpoint
    is unchanged. -> {"path", "type", "bytes" (the file), "tensor_bytes" (its weights: what one decode
    step reads), "convert_s" (this call's conversion; 0.0 when cached), "made_s" (the seconds the
    cached file took to make)}."""
    model_dir = Path(model_dir)
    _check_type(gguf_type)
    folder = Path(out_dir) if out_dir else gguf_dir(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model_dir.resolve().name}-{gguf_type}.gguf"
    side = path.with_name(path.name + ".json")
    key = fingerprint(model_dir)
    note = json.loads(side.read_text()) if side.is_file() else {}
    convert_s = 0.0
    if not path.is_file() or note.get("fingerprint") != key:
        t0 = time.perf_counter()
        tensor_bytes = convert(model_dir, path, gguf_type)
        convert_s = time.perf_counter() - t0
        note = {"fingerprint": key, "type": gguf_type, "made_s": convert_s, "tensor_bytes": tensor_bytes,
                "source": str(model_dir)}
        side.write_text(json.dumps(note, indent=2))
    return {"path": str(path), "type": gguf_type, "bytes": path.stat().st_size, "tensor_bytes": note["tensor_bytes"],
            "convert_s": convert_s, "made_s": note["made_s"]}
