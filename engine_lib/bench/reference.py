"""Ground truth from ``transformers``, and how far the engine is from it.

Defined in chapter 00. For each of the book's ten prompts, ``transformers``' ``generate``
records 100 greedy token ids and the first-token logits. The real model's record can ship with
the package (``reference_outputs``: ``python -m engine_lib reference``), so that a chapter on
Colab need not load ``transformers`` in fp32 to get it. The greedy reference uses
``repetition_penalty=1.0``: the real checkpoint's generation_config.json sets 1.1, which
``transformers`` keeps even with ``do_sample=False``, so without it the "greedy" reference
would be penalised greedy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model.tokenizer import seed_prompts
from . import reference_outputs as shipped_outputs
from .reference_outputs import IDS_FILE, LOGITS_FILE, find_shipped, fingerprint, record_name


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The reference: ``transformers.Qwen2ForCausalLM`` on the same weights (SDPA attention)."""
    from transformers import Qwen2ForCausalLM

    from ..tracking import note

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").to(device).eval()
    note(model, "transformers weights")
    return model


@torch.inference_mode()
def record_ground_truth(model_dir: str | Path, out: str | Path, max_new_tokens: int = 100,
                        prompts: list[list[int]] | None = None, hf_model=None) -> Path:
    """Write greedy ids (``ground_truth.json``) and first-token logits (safetensors) to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = hf_model or load_hf_model(model_dir)
    device = next(model.parameters()).device
    prompts = prompts or [p["input_ids"] for p in seed_prompts()]
    records, logits = [], {}
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=device)
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
        records.append({"input_ids": ids, "generated_ids": gen[0, len(ids):].tolist()})
        logits[f"prompt_{i}"] = model(x).logits[0, -1].float().cpu().contiguous()
    meta = {"model_dir": str(model_dir), "max_new_tokens": max_new_tokens, "repetition_penalty": 1.0,
            "do_sample": False, "dtype": str(next(model.parameters()).dtype), "prompts": records}
    # each file under its final name only once whole: notebooks run side by side may record the same model
    _replace_with(out / IDS_FILE, lambda tmp: tmp.write_text(json.dumps(meta)))
    _replace_with(out / LOGITS_FILE, lambda tmp: save_file(logits, str(tmp)))  # the file ensure_ground_truth checks
    return out


def _replace_with(path: Path, write) -> None:
    """``write(tmp)`` a file of this process's own, then give it ``path``'s name in one rename."""
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def load_ground_truth(folder: str | Path) -> tuple[dict, list[torch.Tensor]]:
    folder = Path(folder)
    meta = json.loads((folder / IDS_FILE).read_text())
    tensors = load_file(str(folder / LOGITS_FILE))
    return meta, [tensors[f"prompt_{i}"] for i in range(len(meta["prompts"]))]


@dataclass
class Comparison:
    max_abs_logit_diff: float
    first_divergence: int | None  # index of the first differing generated token, None if identical
    top1_agrees: bool

    def __str__(self) -> str:
        where = "identical ids" if self.first_divergence is None else f"diverges at token {self.first_divergence}"
        return f"max |logit diff| {self.max_abs_logit_diff:.2e}, top-1 {'agrees' if self.top1_agrees else 'DIFFERS'}, {where}"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(engine_logits: torch.Tensor, ref_logits: torch.Tensor, engine_ids: list[int], ref_ids: list[int]) -> Comparison:
    diff = (engine_logits.float().cpu() - ref_logits.float().cpu()).abs().max().item()
    top1 = int(engine_logits.argmax()) == int(ref_logits.argmax())
    return Comparison(diff, first_divergence(engine_ids, ref_ids), top1)


@dataclass
class MarginCheck:
    """Top-1 agreement where it is decidable: a rounding error of at most ``error`` on every logit (the
    largest |logit diff| over all prompts) moves a top-1/top-2 gap by at most 2 x ``error``. The check asks
    more: every prompt whose reference gap exceeds ``error`` itself must agree, so it can fail on a
    legitimate flip, never pass a wrong one."""

    error: float
    decided: list[int]  # prompts whose gap exceeds the error
    disagree: list[int]  # decided prompts whose top-1 differs: must be empty

    @property
    def ok(self) -> bool:
        """No decided prompt disagrees (true, and empty, when nothing was decided)."""
        return not self.disagree

    @property
    def passed(self) -> bool:
        """At least one prompt was decided and every decided prompt agrees: a check that
        checked nothing is not a pass."""
        return bool(self.decided) and not self.disagree

    def __str__(self) -> str:
        if not self.decided:
            return (f"max |logit diff| {self.error:.3g}; top-1 UNDECIDED: no prompt's top-1/top-2 margin "
                    "exceeds the error, so this checked nothing")
        return (f"max |logit diff| {self.error:.3g}; top-1 decidable on {len(self.decided)} prompt(s), "
                f"{'all agree' if self.ok else f'DISAGREES on {self.disagree}'}")


def margin_check(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> MarginCheck:
    """ours, refs: one (vocab,) logit vector per prompt (the reference in fp32)."""
    ours = [o.float().cpu() for o in ours]
    refs = [r.float().cpu() for r in refs]
    error = max((o - r).abs().max().item() for o, r in zip(ours, refs))
    decided, disagree = [], []
    for i, (o, r) in enumerate(zip(ours, refs)):
        top2 = r.topk(2).values
        if (top2[0] - top2[1]).item() > error:
            decided.append(i)
            if o.argmax() != r.argmax():
                disagree.append(i)
    return MarginCheck(error, decided, disagree)


def _say(text: str) -> None:
    """Print wrapped under the book's output width (76 columns; a path is never broken)."""
    import textwrap

    print(textwrap.fill(text, 76, break_long_words=False, break_on_hyphens=False), flush=True)


def ensure_ground_truth(model_dir: str | Path, out: str | Path | None = None, max_new_tokens: int = 100,
                        device: str | None = None) -> Path:
    """The recorded ground truth for ``model_dir``: the record shipped with the package when one was made
    from the same weights (``reference_outputs``: nothing is loaded), else one made once and cached
    (slow: it runs transformers, fp32, on the GPU when there is one)."""
    from ..model.paths import default_cache_dir

    model_dir = Path(model_dir)
    if out is None:
        shipped = find_shipped(model_dir, max_new_tokens)
        if shipped is not None:
            meta = json.loads((shipped / IDS_FILE).read_text())
            how = meta.get("recorded", {})
            _say(f"reference outputs: the record shipped with engine_lib ({shipped.name}: transformers "
                 f"{how.get('transformers', '?')}, {meta['dtype'].removeprefix('torch.')}, {how.get('device', '?')}); "
                 "transformers is not loaded")
            return shipped
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out) if out else default_cache_dir() / "ground_truth" / f"{model_dir.name}-{max_new_tokens}"
    if not (out / LOGITS_FILE).is_file():
        import time

        _say(f"reference outputs: none ships for {model_dir.name}; recording them once with transformers "
             f"(float32, {device}, {max_new_tokens} greedy tokens per prompt) into {out} ...")
        t0 = time.perf_counter()
        record_ground_truth(model_dir, out, max_new_tokens=max_new_tokens,
                            hf_model=load_hf_model(model_dir, torch.float32, device))
        print(f"... recorded in {time.perf_counter() - t0:.1f} s.", flush=True)
    return out


def record_reference(model_dir: str | Path, out: str | Path | None = None, max_new_tokens: int = 100,
                     device: str = "cpu", root: Path | None = None) -> Path:
    """Record ``transformers``' fp32 reference for ``model_dir`` (``record_ground_truth``) with the
    weights' identity, into ``out`` (default: ``<root>/<record_name>``, the package's folder)."""
    import time

    import transformers

    weights = fingerprint(model_dir)
    if not weights:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    out = Path(out) if out else Path(root or shipped_outputs.SHIPPED) / record_name(model_dir, weights)
    t0 = time.perf_counter()
    record_ground_truth(model_dir, out, max_new_tokens=max_new_tokens,
                        hf_model=load_hf_model(model_dir, torch.float32, device))
    meta = json.loads((out / IDS_FILE).read_text())
    meta["model_dir"] = record_name(model_dir, weights).rsplit("-", 1)[0]  # no local path in a shipped file
    meta["weights"] = weights
    meta["recorded"] = {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
                        "seconds": round(time.perf_counter() - t0, 1)}
    (out / IDS_FILE).write_text(json.dumps(meta))
    return out
