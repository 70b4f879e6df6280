"""How far weight-only quantization moves the model: the accuracy half of chapter 10.

Three measurements on the ten seed prompts, each against the ``half`` rung (same checkpoint,
same compute dtype, so the integer weights are the only difference):

- ``kernels``: the quantized engine against an fp32 copy of the model whose linear weights are
  the dequantized integers. It isolates the kernels, the packing and the loader from the
  quantization error itself: they must agree by the margin rule, up to bf16 rounding;
- ``vs_half``: the first-token logits against the half rung's: max |dlogit| and top-1 agreement
  wherever the half rung's top-1/top-2 gap is wider than the measured error (the margin rule);
- ``follow``: how many of ``n_tokens`` greedy tokens equal the half rung's before the first
  difference, per prompt (the prompts run as one left-padded batch);
- ``top1``: top-1 agreement with the half rung at every position of every prompt (the next-token
  prediction after each prefix), and the half rung's top-1/top-2 margin at the positions that flip.

The modes are ``int8``, ``int4`` (round-to-nearest) and ``int4_gptq`` (GPTQ, ``gptq.py``: needs
``calibration``). The prompts are the ten seed prompts by default; chapter 10 passes held-out
Python snippets to the trained preset (``heldout_snippets``).

``half_vs_fp32`` gives the scale: how far half precision itself moves the logits from fp32.
The quantized rungs run their step eagerly here (the compiled step computes the same numbers,
``tests/test_quant_linear.py`` checks it) so that no compile time is spent.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from .reference import MarginCheck, first_divergence, margin_check


def dequantized_copy(model_dir: str | Path, mode: str, dtype: torch.dtype, device: torch.device,
                     levels: dict | None = None, options=None, embed_from_head: bool = False):
    """An fp32 model whose linear weights (the LM head included, untied) are the quantized
    integers times their scales: what a quantized engine must compute, without its kernels.
    ``embed_from_head``: the embedding is the dequantized head too, as a CPU engine's is (``QuantEmbedding``).

    ``levels``: for weights chosen otherwise than by rounding (GPTQ), each layer's (q, scales,
    zeros) by name (``quantize_engine_gptq(..., keep_levels=...)``), in the layout of ``options`` (the
    engine's ``ModelOptions``: packed projections on the quantized rungs)."""
    import dataclasses

    from ..model.loader import load_model
    from ..model.qwen2 import ModelOptions
    from ..quant.formats import dequantize_int4, dequantize_int8, group_size_for, quantize_int4, quantize_int8

    options = dataclasses.replace(options, quant=None, kernels=False) if options is not None else ModelOptions(sdpa=True)
    model = load_model(Path(model_dir), torch.float32, torch.device(device), options)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight.data.to(torch.bfloat16)  # the checkpoint's own (bf16) values
            if levels is not None:
                m.weight.data.copy_(dequantize_int4(*(t.to(m.weight.device) for t in levels[name])))
            elif mode == "int8":
                m.weight.data.copy_(dequantize_int8(*quantize_int8(w, dtype)))
            else:
                m.weight.data.copy_(dequantize_int4(*quantize_int4(w, dtype, group_size_for(w.shape[1]))))
    if embed_from_head:  # the head's dequantized rows in the compute dtype, as the engine's lookup gives them
        model.model.embed_tokens.weight = torch.nn.Parameter(model.lm_head.weight.to(dtype).float(), requires_grad=False)
    return model


def summary(check: MarginCheck) -> dict:
    return {"max_dlogit": check.error, "decided": check.decided, "disagree": check.disagree, "ok": check.ok}


QUANT_ACCURACY_MODES = {"int8": ("int8", "rtn"), "int4": ("int4", "rtn"), "int4_gptq": ("int4", "gptq")}


def _top1_and_margin(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq, vocab) -> each position's top-1 id and top-1/top-2 gap, on the CPU."""
    top2 = logits.float().topk(2, dim=-1)
    return top2.indices[:, 0].cpu(), (top2.values[:, 0] - top2.values[:, 1]).cpu()


MARGIN_BINS = (0.25, 0.5, 1.0, 2.0)  # edges of the reference's top-1/top-2 margin, for top-1 agreement by margin


def top1_agreement(ours: list[torch.Tensor], ref_top1: list[torch.Tensor],
                   ref_margin: list[torch.Tensor] | None = None) -> dict:
    """Top-1 agreement at every position of every prompt (``ours``: each prompt's top-1 ids) with
    the reference's. Given the reference's top-1/top-2 margins: their median over all positions,
    their median where the top-1 differs, and the agreement by margin (``by_margin``: one entry
    per interval between ``MARGIN_BINS``, with its positions and how many agree)."""
    same = torch.cat([a == b for a, b in zip(ours, ref_top1)])
    out = {"positions": same.numel(), "agree": int(same.sum()), "share": same.float().mean().item()}
    if ref_margin is not None:
        margins = torch.cat(ref_margin).float()
        flipped = margins[~same]
        edges = (0.0, *MARGIN_BINS, float("inf"))
        out.update(margin_median=margins.median().item(),
                   flip_margin_median=flipped.median().item() if flipped.numel() else 0.0,
                   by_margin=[{"lo": lo, "hi": hi, "positions": int(inside.sum()), "agree": int(same[inside].sum())}
                              for lo, hi in zip(edges, edges[1:]) for inside in [(margins >= lo) & (margins < hi)]])
    return out


def quant_accuracy(model_dir: str | Path, device: str | torch.device, modes=("int8", "int4"),
                   prompts: list[list[int]] | None = None, n_tokens: int = 100,
                   calibration: list[list[int]] | None = None) -> dict:
    """The measurements for each of ``modes`` (see the module docstring), as plain numbers: a
    bench record's entry. ``int4_gptq`` is calibrated on ``calibration`` (token-id sequences that
    must not overlap ``prompts``); its cost is in the entry's ``gptq``."""
    from ..engine import Engine
    from ..model.tokenizer import seed_prompts

    device = torch.device(device)
    prompts = prompts or [p["input_ids"] for p in seed_prompts()]
    greedy = dict(max_new_tokens=n_tokens, do_sample=False, stop_token_ids=())
    unknown = [m for m in modes if m not in QUANT_ACCURACY_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(QUANT_ACCURACY_MODES)}")
    if "int4_gptq" in modes and not calibration:
        raise ValueError("int4_gptq needs calibration token sequences")
    fp32 = Engine.from_pretrained(model_dir, device=device, stage="kv_cache")
    fp32_last, fp32_top1, _ = _last_and_top1(fp32, prompts)
    del fp32
    _free(device)
    half = Engine.from_pretrained(model_dir, device=device, stage="half")
    ref = dict(zip(("last", "top1", "margin"), _last_and_top1(half, prompts)))
    ref["ids"] = [r.token_ids for r in half.generate_batch(prompts, **greedy)]
    dtype = half.dtype
    del half
    _free(device)
    out = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "n_tokens": n_tokens,
           "dtype": str(dtype).removeprefix("torch."),
           "half_vs_fp32": {**summary(margin_check(ref["last"], fp32_last)),
                            "dlogit_per_prompt": [(a - b).abs().max().item() for a, b in zip(ref["last"], fp32_last)],
                            "top1": top1_agreement(ref["top1"], fp32_top1)},
           "half_margins": [m[-1].item() for m in ref["margin"]]}  # each prompt's last position
    for mode in modes:
        out[mode] = _one_mode(mode, model_dir, device, dtype, prompts, greedy, calibration, ref)
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _last_and_top1(engine, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt's last-position logits, and every position's top-1 id and top-1/top-2 margin."""
    last, top1, margin = [], [], []
    for ids in prompts:
        full = engine.logits(ids)
        last.append(full[-1])
        t, m = _top1_and_margin(full)
        top1.append(t)
        margin.append(m)
        del full
    return last, top1, margin


def _one_mode(mode: str, model_dir, device: torch.device, dtype: torch.dtype, prompts: list[list[int]], greedy: dict,
              calibration, ref: dict) -> dict:
    """One quantized rung against its own dequantized copy (the kernels) and against the half rung ``ref``
    (the quantization): last-position logits, top-1 at every position, how long greedy follows."""
    from ..engine import Engine
    from ..quant.embedding import QuantEmbedding
    from ..quant.gptq import quantize_engine_gptq

    stage, method = QUANT_ACCURACY_MODES[mode]
    engine = Engine.from_pretrained(model_dir, device=device, stage=stage)
    levels, cost = None, None
    if method == "gptq":
        levels = {}
        cost = quantize_engine_gptq(engine, calibration, keep_levels=levels).as_dict()
        errors = cost.pop("layer_error")
        cost["summed_layer_error"] = {k: sum(e[k] for e in errors.values()) for k in ("gptq", "rtn")}
    engine.loop.compile_step = False  # eager steps: the same numbers, no compile
    options = engine.model.options
    shared = isinstance(engine.model.model.embed_tokens, QuantEmbedding)
    last, top1, _ = _last_and_top1(engine, prompts)
    ids = [r.token_ids for r in engine.generate_batch(prompts, **greedy)]
    del engine
    _free(device)
    exact = dequantized_copy(model_dir, stage, dtype, device, levels, options if levels is not None else None,
                             shared)
    del levels
    with torch.inference_mode():
        exact_logits = [exact(torch.tensor([p], device=device))[0, -1].float() for p in prompts]
    del exact
    _free(device)
    n_tokens = greedy["max_new_tokens"]
    follow = [n_tokens if d is None else d for d in (first_divergence(a, b) for a, b in zip(ids, ref["ids"]))]
    entry = {"kernels": summary(margin_check(last, exact_logits)), "vs_half": summary(margin_check(last, ref["last"])),
             "dlogit_per_prompt": [(a - b).abs().max().item() for a, b in zip(last, ref["last"])],
             "top1": top1_agreement(top1, ref["top1"], ref["margin"]),
             "follow": follow, "full_matches": sum(n == n_tokens for n in follow)}
    if cost is not None:
        entry["gptq"] = cost
    return entry


def heldout_snippets(tokenizer, n: int = 16, length: int = 96, text: str | None = None) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the held-out text (``checkpoints.HELDOUT_TEXT``:
    Python files the stdlib preset never trained on), their starts evenly spaced through it."""
    from ..model.checkpoints import HELDOUT_TEXT

    ids = tokenizer(text if text is not None else HELDOUT_TEXT.read_text(encoding="utf-8"),
                    add_special_tokens=False)["input_ids"]
    if len(ids) < n * length:
        raise ValueError(f"the text has {len(ids)} tokens: too few for {n} snippets of {length}")
    step = (len(ids) - length) // max(1, n - 1) if n > 1 else 0
    return [ids[i * step:i * step + length] for i in range(n)]


# ---------------------------------------------------------------- perplexity (chapter 10)
HELDOUT_TOKENS = 16384  # the held-out text's first tokens scored by default (all: about 47,000, ~25 s per rung on 2 CPU cores)
TEST_DIRS = {"test", "tests", "idle_test", "idlelib", "tkinter", "lib2to3", "turtledemo", "ensurepip", "encodings",
             "site-packages", "lib-dynload", "__pycache__", "__phello__"}


def stdlib_calibration(tokenizer, heldout_paths: set[str], n_tokens: int = 8192, seq_len: int = 128,
                       seed: int = 0) -> tuple[list[list[int]], dict]:
    """GPTQ calibration from the training split of the stdlib preset: this interpreter's standard
    library ``.py`` files, never one of ``heldout_paths`` (the held-out manifest) nor a test folder,
    in a seeded shuffled order, joined by ``<|endoftext|>``; the first ``n_tokens`` tokens, cut into
    sequences of ``seq_len``. Returns (sequences, a description of them)."""
    import random
    import sysconfig

    from ..quant.gptq import calibration_ids

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if not set(p.relative_to(root).parts[:-1]) & TEST_DIRS and not p.name.startswith(("test_", "_sysconfig"))
             and p.relative_to(root).as_posix() not in heldout_paths]
    random.Random(seed).shuffle(files)
    texts, used, approx = [], [], 0
    for p in files:
        if approx > 6 * n_tokens:  # about 3-4 characters a token: enough text for n_tokens
            break
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
        used.append(p.relative_to(root).as_posix())
        approx += len(texts[-1])
    seqs = calibration_ids(tokenizer, "<|endoftext|>".join(texts), n_tokens, seq_len)
    return seqs, {"source": "Python stdlib .py files of the training split (held-out manifest excluded)",
                  "files": len(used), "first_files": used[:5], "tokens": sum(map(len, seqs)),
                  "sequences": len(seqs), "seq_len": seq_len, "seed": seed}


def quant_perplexity(model_dir: str | Path, device: str | torch.device, text_ids: list[int],
                     calibration: list[list[int]], context: int = 128, stride: int = 64,
                     gptq_options: dict | None = None, progress: bool = False) -> dict:
    """Perplexity of ``text_ids`` at the half rung (bf16 on CPU), int8, int4 round-to-nearest and
    int4 GPTQ (calibrated on ``calibration``, which must not overlap the text), and the share of
    round-to-nearest's gap to half that GPTQ closes: a bench record's entry."""
    from ..engine import Engine
    from ..quant.gptq import quantize_engine_gptq
    from .perplexity import perplexity

    rows, gptq_cost = {}, None
    for name, stage in (("half", "half"), ("int8", "int8"), ("int4", "int4"), ("int4_gptq", "int4")):
        engine = Engine.from_pretrained(model_dir, device=device, stage=stage)
        if name == "int4_gptq":
            gptq_cost = quantize_engine_gptq(engine, calibration, **(gptq_options or {}))
        r = perplexity(engine, text_ids, context, stride, progress=progress)
        rows[name] = {"ppl": r.ppl, "mean_nll": r.mean_nll, "tokens": r.tokens, "seconds": r.seconds}
        settings = r.settings
        del engine
        gc.collect()
    half, rtn, gptq = rows["half"]["ppl"], rows["int4"]["ppl"], rows["int4_gptq"]["ppl"]
    closed = (rtn - gptq) / (rtn - half) if rtn != half else float("nan")
    cost = gptq_cost.as_dict()
    errors = cost.pop("layer_error")
    cost["summed_layer_error"] = {"gptq": sum(e["gptq"] for e in errors.values()),
                                  "rtn": sum(e["rtn"] for e in errors.values())}
    return {"model": Path(model_dir).name, "context": context, "stride": stride, "tokens": rows["half"]["tokens"],
            "dtype": settings["dtype"], "device": settings["device"], "rungs": rows, "gptq": cost,
            "gap_closed": closed, "target_met": bool(closed >= 0.5)}


def heldout_of(model_dir: str | Path) -> tuple[Path, Path] | None:
    """(held-out text, its manifest) when ``model_dir`` is the trained stdlib preset, else None."""
    import json

    from ..model.checkpoints import HELDOUT_MANIFEST, HELDOUT_TEXT

    cfg = Path(model_dir) / "config.json"
    trained = cfg.is_file() and "engine_lib_trained_checkpoint" in json.loads(cfg.read_text())
    return (HELDOUT_TEXT, HELDOUT_MANIFEST) if trained and HELDOUT_TEXT.is_file() else None


def heldout_perplexity(model_dir: str | Path, device: str | torch.device = "cpu", context: int = 128,
                       stride: int = 64, max_tokens: int | None = HELDOUT_TOKENS, calibration_tokens: int = 8192,
                       gptq_options: dict | None = None, progress: bool = False) -> dict | None:
    """``quant_perplexity`` on the trained preset's held-out text, with GPTQ calibrated on its
    training split (``stdlib_calibration``); None for a checkpoint without held-out text."""
    import json

    from ..model.tokenizer import load_tokenizer
    from .perplexity import text_ids

    found = heldout_of(model_dir)
    if found is None:
        return None
    text, manifest = found
    tok = load_tokenizer(model_dir)
    ids = text_ids(tok, text.read_text(encoding="utf-8"), max_tokens)
    held = {f["path"] for f in json.loads(manifest.read_text())["files"]}
    calibration, described = stdlib_calibration(tok, held, calibration_tokens, context)
    out = quant_perplexity(model_dir, device, ids, calibration, context, stride, gptq_options, progress)
    out["text"] = {"file": text.name, "tokens": len(ids)}
    out["calibration"] = described
    return out


def quant_perplexity_lines(qp: dict) -> list[str]:
    """Markdown for ``quant_perplexity``'s record entry."""
    r, g = qp["rungs"], qp["gptq"]
    lines = ["", f"## Weight-only quantization: perplexity ({qp['model']}, {qp['tokens']} scored tokens"
             f"{' of ' + qp['text']['file'] if 'text' in qp else ''}, context {qp['context']}, stride {qp['stride']}, "
             f"{qp['dtype']}, {qp['device']})", "",
             "| rung | perplexity | mean NLL (nats) | gap to half |", "|---|---:|---:|---:|"]
    names = {"half": "half", "int8": "int8", "int4": "int4 round-to-nearest", "int4_gptq": "int4 GPTQ"}
    for key, label in names.items():
        if key in r:
            lines.append(f"| {label} | {r[key]['ppl']:.4f} | {r[key]['mean_nll']:.4f} | "
                         f"{r[key]['ppl'] - r['half']['ppl']:+.4f} |")
    cal = qp.get("calibration", {})
    lines += ["", f"GPTQ closes {100 * qp['gap_closed']:.0f}% of round-to-nearest's gap to half (target: at least "
              f"50%: {'met' if qp['target_met'] else 'NOT met'}). Calibration: {g['calibration_tokens']} tokens in "
              f"{g['calibration_sequences']} sequences{' of ' + cal['source'] if cal else ''}, "
              f"{g['seconds']:.1f} s (act_order={g['act_order']}, damp={g['damp']}, LM head: {g['head']})."]
    return lines


def committed_quant_record(preset: str = "qwen2-stdlib-small") -> dict | None:
    """The committed perplexity record of ``preset`` (``scripts/quant_record.py`` wrote it to
    ``book/results/<preset>.quant.json``): read from this source tree when there is one, else
    from the installed package (``engine_lib.results``); None if neither has it."""
    import json
    from importlib.resources import files

    name = f"{preset}.quant.json"
    local = Path(__file__).resolve().parents[2] / "book" / "results" / name
    if local.is_file():
        return json.loads(local.read_text())
    try:
        entry = files("engine_lib.results") / name
        return json.loads(entry.read_text()) if entry.is_file() else None
    except ModuleNotFoundError:
        return None
