"""Pass or fail for every rung on the tiny checkpoint, with SDPA kernels forced in turn.

The first phase of ``scripts/gpu_check.sh`` (issue 14): on a GPU every cached rung runs
eagerly (kv_cache, half), compiled (fused, int8) and with our Triton kernels (triton: eager,
captured as a CUDA graph), once with the engine's own kernel choice and, on the eager rungs,
with each of flash, memory-efficient, cuDNN and math forced (``engine_lib.model.layers.sdpa.forced``). A kernel that
refuses a call on this GPU ("No available kernel", e.g. flash with a mask or on sm_75) is
recorded as ``refused``, not as a failure. Every result is written to ``--out`` as soon as it
is known.

The default matrix keeps one compile per compiled rung (bf16): each compile is most of this
phase's time. ``--full`` adds fp16 and fp32 beside them and cuDNN forced into the compiled
step (memory-efficient is not forced there: it is the engine's own choice for the masked
step, so it would compile the same graph twice). ``--dry-run`` (CPU): the engine's own
choice only, eager rungs, in seconds.

``matrix`` needs no torch: ``scripts/gpu_check.py`` counts its compiles for the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

KERNELS = ("default", "flash", "efficient", "cudnn", "math")
COMPILED = ("fused", "int8")  # inductor compiles their step
CAPTURED = COMPILED + ("triton",)  # triton: our kernels in the eager step, captured as a CUDA graph, no inductor
PROMPTS = [list(range(1000, 1013)), list(range(2000, 2005))]  # ragged: the masked paths too


def matrix(dry: bool, full: bool = False, bf16: bool = True) -> list[tuple[str, str, str]]:
    """(rung, dtype, kernel) cases. Eager rungs take every kernel; each compiled or captured case runs
    batch 2 only (one compile each for fused and int8) under the engine's choice (and cuDNN forced,
    with ``full``)."""
    if dry:
        return [("kv_cache", "float32", "default"), ("half", "bfloat16", "default")]
    half = "bfloat16" if bf16 else "float16"  # the dtype the engine picks (half_dtype)
    out = [("kv_cache", "float32", k) for k in KERNELS]
    out += [("half", half, k) for k in KERNELS] + [("half", "float16", "default")] * bf16
    out += [(rung, half, "default") for rung in CAPTURED]
    if full:
        other = ["float16"] if bf16 else []
        out += [("half", "float16", k) for k in KERNELS[1:]] * bf16
        out += [("fused", "float32", "default"), ("fused", half, "cudnn")]
        out += [(rung, d, "default") for d in other for rung in CAPTURED] + [("fused", d, "cudnn") for d in other]
    return out


def one(ckpt: Path, device, rung: str, dtype, kernel: str) -> dict:
    import torch

    from engine_lib import Engine
    from engine_lib.model.layers.sdpa import forced
    from engine_lib.step import compiled as compiled_step

    compiled_step._COMPILED.clear()  # each compiled case compiles afresh under its own kernel choice
    compiled_step._VARIANTS.clear()
    torch._dynamo.reset()
    engine = Engine.from_pretrained(ckpt, device=device, dtype=dtype, stage=rung)
    backend = None if kernel == "default" else getattr(torch.nn.attention.SDPBackend, {
        "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
        "math": "MATH"}[kernel])
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, (forced(backend) if backend else _nothing()):
        warnings.simplefilter("always")
        batch = [r.token_ids for r in engine.generate_batch(PROMPTS, max_new_tokens=6, do_sample=False)]
        single = None
        if engine.step_form == "eager":  # the unmasked batch-1 paths too (compiled: one variant only)
            single = engine.generate(PROMPTS[0], max_new_tokens=6, do_sample=False).token_ids
    fallbacks = engine.fallbacks
    if engine.stage.name != rung:  # the triton rung where its kernels cannot run
        fallbacks = fallbacks + [f"ran as {engine.stage.name!r}"]
    return {"ok": not fallbacks, "seconds": round(time.perf_counter() - t0, 2), "step_form": engine.step_form,
            "batch_row0_equals_single": None if single is None else batch[0] == single, "fallbacks": fallbacks,
            "warnings": sorted({str(w.message)[:200] for w in caught})[:3]}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--full", action="store_true", help="fp16 and fp32 beside bf16, cuDNN forced when compiled")
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every case")
    parser.add_argument("--checkpoint-root", default=None)
    args = parser.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine_lib.model.checkpoints import ensure_checkpoint
    from engine_lib.stages import half_dtype

    device = torch.device("cpu" if args.dry_run else "cuda")
    ckpt = ensure_checkpoint("tiny", root=args.checkpoint_root)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
               "torch": torch.__version__, "cases": []}
    failed = 0
    for rung, dtype, kernel in matrix(args.dry_run, args.full, half_dtype(device) == torch.bfloat16):
        case = {"rung": rung, "dtype": dtype, "kernel": kernel}
        try:
            case.update(one(ckpt, device, rung, getattr(torch, dtype), kernel))
        except Exception as exc:  # noqa: BLE001 - every failure is a result here
            text = f"{type(exc).__name__}: {exc}"
            refused = "No available kernel" in text and kernel != "default"
            case.update(ok=refused, refused=refused, error=text[:400],
                        where=traceback.format_exc(limit=-3)[-600:])
        failed += not case["ok"]
        results["cases"].append(case)
        Path(args.out).write_text(json.dumps(results, indent=2))
        status = "refused" if case.get("refused") else "ok" if case["ok"] else "FAILED"
        print(f"{rung:8s} {dtype:8s} {kernel:9s} {status} {case.get('step_form', '')}"
              f" {case.get('error', '')[:120]}", flush=True)
    results["failed"] = failed
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
