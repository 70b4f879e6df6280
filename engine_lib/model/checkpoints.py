"""Offline Qwen2 checkpoints in the Hugging Face layout: random ones made from a fixed seed,
and one small trained one that is committed.

Defined in chapter 00. Tests, CI and offline notebook runs use these instead of the
real weights, which cannot be downloaded everywhere. Speed does not depend on the
values, so a random checkpoint of the full 1.5B shape serves every speed and memory
measurement; its generated text is meaningless. ``qwen2-stdlib-small`` is the engine's
architecture at width 64, trained for 14 minutes on two CPU cores on the Python standard
library (``scripts/train_small_model.py``): for what depends on learned values (perplexity,
quantization damage, speculative acceptance, sampling).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import Qwen2Config
from .hub import REAL_CONFIG, REAL_MODEL_ID
from .paths import default_cache_dir
from .tokenizer import TOKENIZER_FILES, VENDORED_TOKENIZER

ASSETS = Path(__file__).parents[1] / "assets"
REAL_GENERATION_CONFIG = ASSETS / "reference" / "qwen2.5-1.5b-instruct.generation_config.json"
STDLIB_SMALL = "qwen2-stdlib-small"
STDLIB_SMALL_DIR = ASSETS / STDLIB_SMALL  # the committed trained checkpoint (no tokenizer files)
HELDOUT_TEXT = ASSETS / "heldout" / "python-stdlib-heldout.txt"  # its held-out split, vendored (PSF License)
HELDOUT_MANIFEST = ASSETS / "heldout" / "python-stdlib-heldout.json"


def preset_config(preset: str, layers: int | None = None) -> Qwen2Config:
    """``tiny``: 4 small layers, the real vocabulary, 4 query heads sharing 2 KV heads.
    ``qwen2.5-1.5b-random``: exactly the real model's shape (1,543,714,304 parameters).
    ``qwen2-stdlib-small``: width 64 (head_dim 16), 4 layers, the real vocabulary (trained)."""
    real = Qwen2Config.from_json(REAL_CONFIG)
    if preset == "tiny":
        cfg = dataclasses.replace(real, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    elif preset == STDLIB_SMALL:
        cfg = dataclasses.replace(real, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2)
    elif preset == "qwen2.5-1.5b-random":
        cfg = real
    else:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    return cfg


PRESETS = ("tiny", "qwen2.5-1.5b-random", STDLIB_SMALL)


def preset_name(preset: str, layers: int | None = None) -> str:
    return preset if layers is None else f"{preset}-{layers}l"


def random_state_dict(cfg: Qwen2Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Checkpoint tensors with the real names and shapes, drawn from a fixed seed.

    Projections are N(0, 1/fan_in), so every block writes O(1) values into the residual
    stream; the embedding is N(0, 0.02). With the small init that training starts from,
    the tied LM head would mostly see the input embedding again and greedy decoding
    would repeat the last token forever, which makes a weak test.

    ``device="cuda"`` draws on the GPU: seconds instead of a minute at the full shape, but
    other values than the CPU's for the same seed (so such a checkpoint is named apart).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    h, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size

    def normal(*shape, std, mean=0.0):
        return (torch.randn(*shape, generator=gen, device=device) * std + mean).to(dtype).cpu()

    def linear(out_f, in_f):
        return normal(out_f, in_f, std=in_f**-0.5)

    sd = {"model.embed_tokens.weight": normal(cfg.vocab_size, h, std=0.02)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = normal(h, std=0.1, mean=1.0)
        sd[p + "self_attn.q_proj.weight"] = linear(h, h)
        sd[p + "self_attn.q_proj.bias"] = normal(h, std=0.1)
        sd[p + "self_attn.k_proj.weight"] = linear(kv, h)
        sd[p + "self_attn.k_proj.bias"] = normal(kv, std=0.1)
        sd[p + "self_attn.v_proj.weight"] = linear(kv, h)
        sd[p + "self_attn.v_proj.bias"] = normal(kv, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = linear(h, h)
        sd[p + "post_attention_layernorm.weight"] = normal(h, std=0.1, mean=1.0)
        sd[p + "mlp.gate_proj.weight"] = linear(inter, h)
        sd[p + "mlp.up_proj.weight"] = linear(inter, h)
        sd[p + "mlp.down_proj.weight"] = linear(h, inter)
    sd["model.norm.weight"] = normal(h, std=0.1, mean=1.0)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = normal(cfg.vocab_size, h, std=0.02)
    return sd


def _scratch(out: Path) -> Path:
    """A folder of this process's own beside ``out``, to write a checkpoint into before it is published."""
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path, replace: bool = True) -> Path:
    """Give a completely written folder its final name: only whole checkpoints ever appear there.

    Several processes may make the same checkpoint at once (tests and notebooks run side by side).
    With ``replace`` False, a copy another process published first wins and ``tmp`` goes; with it
    True, an older ``out`` is moved aside in one rename, then deleted."""
    old = None
    if out.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        old = out.with_name(f"{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        out.rename(old)
    try:
        tmp.rename(out)
    except OSError:  # another process published in between: its copy is as good as ours
        if replace or not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_checkpoint(out: str | os.PathLike, cfg: Qwen2Config, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, label: str = "random", device: str = "cpu",
                     replace: bool = True) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer to ``out``
    (``replace`` False: keep a complete ``out`` that another process published meanwhile)."""
    out = Path(out)
    tmp = _scratch(out)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf_cfg["engine_lib_random_checkpoint"] = {"preset": label, "seed": seed, "drawn_on": torch.device(device).type,
                                              "note": "random weights: generated text is meaningless"}
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    shutil.copy(REAL_GENERATION_CONFIG, tmp / "generation_config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(VENDORED_TOKENIZER / name, tmp / name)
    save_file(random_state_dict(cfg, seed, dtype, device), str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    return _publish(tmp, out, replace)


def ensure_checkpoint(preset: str = "tiny", layers: int | None = None, seed: int = 0,
                      root: str | os.PathLike | None = None) -> Path:
    """The offline checkpoint for ``preset``, made once and then reused from the cache.

    ``qwen2-stdlib-small`` is not made but copied from the package, with the tokenizer files
    (``layers`` and ``seed`` do not apply to it)."""
    if preset == STDLIB_SMALL:
        if layers is not None:
            raise ValueError(f"{STDLIB_SMALL} is a trained checkpoint: its layers cannot be changed")
        return _copy_trained(Path(root or default_cache_dir() / "checkpoints") / STDLIB_SMALL)
    name = preset_name(preset, layers)
    out = Path(root or default_cache_dir() / "checkpoints") / f"{name}-seed{seed}"
    if not (out / "model.safetensors").is_file():
        write_checkpoint(out, preset_config(preset, layers), seed=seed, label=name, replace=False)
    return out


def _copy_trained(out: Path) -> Path:
    """The committed trained checkpoint plus the tokenizer files, in ``out`` (refreshed when the
    package's weights differ from the copy's)."""
    src = STDLIB_SMALL_DIR / "model.safetensors"
    have = out / "model.safetensors"
    if have.is_file() and have.stat().st_size == src.stat().st_size and \
            (out / "config.json").read_bytes() == (STDLIB_SMALL_DIR / "config.json").read_bytes():
        return out
    tmp = _scratch(out)
    shutil.copytree(STDLIB_SMALL_DIR, tmp, dirs_exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(VENDORED_TOKENIZER / name, tmp / name)
    return _publish(tmp, out)


def _config_json(model_dir: str | os.PathLike) -> dict:
    cfg = Path(model_dir) / "config.json"
    return json.loads(cfg.read_text()) if cfg.is_file() else {}


def is_random_checkpoint(model_dir: str | os.PathLike) -> bool:
    return "engine_lib_random_checkpoint" in _config_json(model_dir)


def is_trained_checkpoint(model_dir: str | os.PathLike) -> bool:
    """The small trained preset (or another checkpoint written by ``scripts/train_small_model.py``)."""
    return "engine_lib_trained_checkpoint" in _config_json(model_dir)


def checkpoint_label(model_dir: str | os.PathLike) -> str | None:
    """What an offline checkpoint is, in words (None for any other checkpoint, such as the real model)."""
    raw = _config_json(model_dir)
    if "engine_lib_random_checkpoint" in raw:
        return "RANDOM weights (offline checkpoint; text is meaningless)"
    trained = raw.get("engine_lib_trained_checkpoint")
    if trained:
        return (f"small model trained here on the Python standard library ({trained['parameters']:,} parameters, "
                f"held-out perplexity {trained['heldout_ppl']}); not the real Qwen2.5 model")
    return None


AUTO_MODELS = ("auto", "auto-bench")


def resolve_auto_model(model: str, fallback: str | None = "tiny") -> str:
    """``auto``: the real model when it can be fetched (its size said first), else the offline
    ``fallback`` preset, labelled (``None``: raise ``ModelNotFoundError`` instead).
    ``auto-bench``: the same, but the fallback is the random checkpoint of the full 1.5B shape.
    Anything else is returned as given. Used by the command line, the server and the benchmark;
    ``generate`` falls back to the trained preset, the rest to ``tiny``."""
    if model not in AUTO_MODELS:
        return model
    import sys

    from ..errors import ModelNotFoundError
    from .hub import fetch_model

    try:
        return str(fetch_model(REAL_MODEL_ID, say=lambda line: print(f"[engine_lib] {line}", file=sys.stderr)))
    except ModelNotFoundError as exc:
        if fallback is None:
            raise
        why = str(exc).split(":", 1)[1].split(". ")[0].strip()
        print(f"[engine_lib] {REAL_MODEL_ID} is not reachable ({why})", file=sys.stderr)
        preset = "qwen2.5-1.5b-random" if model == "auto-bench" else fallback
        path = ensure_checkpoint(preset)
        if preset == STDLIB_SMALL:
            print(f"[engine_lib] using {STDLIB_SMALL} ({path}), a small model trained here on Python source, "
                  "NOT Qwen2.5: it continues Python code", file=sys.stderr)
        else:
            print(f"[engine_lib] using the OFFLINE RANDOM-WEIGHT checkpoint {path}: the text will be meaningless",
                  file=sys.stderr)
        return str(path)
