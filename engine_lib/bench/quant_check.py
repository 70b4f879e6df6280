"""How far weight-only quantization moves the model: the accuracy half of chapter 10.

Three measurements on the ten seed prompts, each against the ``half`` rung (same checkpoint,
same compute dtype, so the integer weights are the only difference):

- ``kernels``: the quantized engine against an fp32 copy of the model whose linear weights are
  the dequantized integers. It isolates the kernels, the packing and the loader from the
  quantization error itself: they must agree by the margin rule, up to bf16 rounding;
- ``vs_half``: the first-token logits against the half rung's: max |dlogit| and top-1 agreement
  wherever the half rung's top-1/top-2 gap is wider than the measured error (the margin rule);
- ``follow``: how many of ``n_tokens`` greedy tokens equal the half rung's before the first
  difference, per prompt (the prompts run as one left-padded batch).

``half_vs_fp32`` gives the scale: how far half precision itself moves the logits from fp32.
The quantized rungs run their step eagerly here (the compiled step computes the same numbers,
``tests/test_quant.py`` checks it) so that no compile time is spent.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from .reference import MarginCheck, first_divergence, margin_check


def dequantized_copy(model_dir: str | Path, mode: str, dtype: torch.dtype, device: torch.device):
    """An fp32 model whose linear weights (the LM head included, untied) are the quantized
    integers times their scales: what a quantized engine must compute, without its kernels."""
    from ..loader import load_model
    from ..model import ModelOptions
    from ..quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    model = load_model(Path(model_dir), torch.float32, torch.device(device), ModelOptions(sdpa=True))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight.data.to(torch.bfloat16)  # the checkpoint's own (bf16) values
            if mode == "int8":
                m.weight.data.copy_(dequantize_int8(*quantize_int8(w, dtype)))
            else:
                m.weight.data.copy_(dequantize_int4(*quantize_int4(w, dtype)))
    return model


def summary(check: MarginCheck) -> dict:
    return {"max_dlogit": check.error, "decided": check.decided, "disagree": check.disagree, "ok": check.ok}


def quant_accuracy(model_dir: str | Path, device: str | torch.device, modes=("int8", "int4"),
                   prompts: list[list[int]] | None = None, n_tokens: int = 100) -> dict:
    """The three measurements for each of ``modes`` (see the module docstring), as plain numbers:
    a bench record's entry."""
    from ..engine import Engine
    from ..runner import CachedRunner
    from ..tokenizer import seed_prompts

    device = torch.device(device)
    prompts = prompts or [p["input_ids"] for p in seed_prompts()]
    greedy = dict(max_new_tokens=n_tokens, do_sample=False, stop_token_ids=())

    def free():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    fp32 = Engine.from_pretrained(model_dir, device=device, stage="kv_cache")
    logits = {"fp32": [fp32.logits(ids)[-1] for ids in prompts]}
    del fp32
    free()
    half = Engine.from_pretrained(model_dir, device=device, stage="half")
    logits["half"] = [half.logits(ids)[-1] for ids in prompts]
    half_ids = [r.token_ids for r in half.generate_batch(prompts, **greedy)]
    dtype = half.dtype
    del half
    free()
    out = {"prompts": len(prompts), "n_tokens": n_tokens, "dtype": str(dtype).removeprefix("torch."),
           "half_vs_fp32": {**summary(margin_check(logits["half"], logits["fp32"])),
                            "dlogit_per_prompt": [(a - b).abs().max().item() for a, b in zip(logits["half"],
                                                                                             logits["fp32"])]},
           "half_margins": [(r.topk(2).values[0] - r.topk(2).values[1]).item() for r in logits["half"]]}
    for mode in modes:
        engine = Engine.from_pretrained(model_dir, device=device, stage=mode)
        engine.runner = CachedRunner(engine.model)  # eager steps: the same numbers, no compile
        logits[mode] = [engine.logits(ids)[-1] for ids in prompts]
        ids = [r.token_ids for r in engine.generate_batch(prompts, **greedy)]
        del engine
        free()
        exact = dequantized_copy(model_dir, mode, dtype, device)
        with torch.inference_mode():
            exact_logits = [exact(torch.tensor([p], device=device))[0, -1].float() for p in prompts]
        del exact
        free()
        follow = [n_tokens if d is None else d for d in (first_divergence(a, b) for a, b in zip(ids, half_ids))]
        out[mode] = {"kernels": summary(margin_check(logits[mode], exact_logits)),
                     "vs_half": summary(margin_check(logits[mode], logits["half"])),
                     "dlogit_per_prompt": [(a - b).abs().max().item() for a, b in zip(logits[mode], logits["half"])],
                     "follow": follow, "full_matches": sum(n == n_tokens for n in follow)}
    return out
