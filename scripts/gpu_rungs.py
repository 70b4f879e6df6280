"""Pass or fail for every rung on the tiny checkpoint, with each SDPA kernel forced in turn.

The first phase of ``scripts/gpu_check.sh`` (issue 14): on a GPU every cached rung runs
eagerly (kv_cache, half), compiled (fused, int8) and with our Triton kernels (triton) in fp32,
bf16 and fp16, once with the
engine's own kernel choice and once with each of flash, memory-efficient, cuDNN and math
forced (``engine_lib.layers.sdpa.forced``). A kernel that refuses a call on this GPU
("No available kernel", e.g. flash with a mask or on sm_75) is recorded as ``refused``, not
as a failure. Every result is written to ``--out`` as soon as it is known.

``--dry-run`` (CPU): the engine's own choice only, eager rungs and fp32, in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_lib import Engine, compiled_step  # noqa: E402
from engine_lib.checkpoints import ensure_checkpoint  # noqa: E402
from engine_lib.layers.sdpa import forced  # noqa: E402

KERNELS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
PROMPTS = [list(range(1000, 1013)), list(range(2000, 2005))]  # ragged: the masked paths too


def matrix(dry: bool, device: torch.device) -> list[tuple[str, torch.dtype, str]]:
    """(rung, dtype, kernel) cases. Eager rungs take every kernel; the compiled step (always masked,
    so flash refuses it) takes the engine's choice, memory-efficient and cuDNN: each compiled case
    is one compile (batch 2 only), the bulk of this phase's time."""
    if dry:
        return [("kv_cache", torch.float32, "default"), ("half", torch.bfloat16, "default")]
    bf16 = torch.cuda.get_device_capability(device) >= (8, 0)
    halves = [torch.float16] + ([torch.bfloat16] if bf16 else [])
    out = [("kv_cache", torch.float32, k) for k in KERNELS]
    out += [("half", d, k) for d in halves for k in KERNELS]
    out += [("fused", torch.float32, "default")]
    out += [("fused", d, k) for d in halves for k in ("default", "efficient", "cudnn")]
    out += [("int8", d, "default") for d in halves]
    out += [("triton", d, "default") for d in halves]  # our kernels, eager and captured (chapter 13)
    return out


def one(ckpt: Path, device: torch.device, rung: str, dtype: torch.dtype, kernel: str) -> dict:
    compiled_step._COMPILED.clear()  # each compiled case compiles afresh under its own kernel choice
    compiled_step._VARIANTS.clear()
    torch._dynamo.reset()
    engine = Engine.from_pretrained(ckpt, device=device, dtype=dtype, stage=rung)
    backend = KERNELS[kernel]
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, (forced(backend) if backend else _nothing()):
        warnings.simplefilter("always")
        batch = [r.token_ids for r in engine.generate_batch(PROMPTS, max_new_tokens=6, do_sample=False)]
        single = None
        if engine.runner.fast is None:  # eager: the unmasked batch-1 paths too (compiled: one variant only)
            single = engine.generate(PROMPTS[0], max_new_tokens=6, do_sample=False).token_ids
    fallbacks = engine.runner.fast.fallbacks if engine.runner.fast else []
    if engine.stage.name != rung:  # the triton rung where its kernels cannot run
        fallbacks = fallbacks + [f"ran as {engine.stage.name!r}"]
    return {"ok": not fallbacks, "seconds": round(time.perf_counter() - t0, 2), "step_form": engine.runner.step_form,
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
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every case")
    parser.add_argument("--checkpoint-root", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    ckpt = ensure_checkpoint("tiny", root=args.checkpoint_root)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
               "torch": torch.__version__, "cases": []}
    failed = 0
    for rung, dtype, kernel in matrix(args.dry_run, device):
        case = {"rung": rung, "dtype": str(dtype).removeprefix("torch."), "kernel": kernel}
        try:
            case.update(one(ckpt, device, rung, dtype, kernel))
        except Exception as exc:  # noqa: BLE001 - every failure is a result here
            text = f"{type(exc).__name__}: {exc}"
            refused = "No available kernel" in text and kernel != "default"
            case.update(ok=refused, refused=refused, error=text[:400],
                        where=traceback.format_exc(limit=-3)[-600:])
        failed += not case["ok"]
        results["cases"].append(case)
        Path(args.out).write_text(json.dumps(results, indent=2))
        status = "refused" if case.get("refused") else "ok" if case["ok"] else "FAILED"
        print(f"{rung:8s} {case['dtype']:8s} {kernel:9s} {status} {case.get('step_form', '')}"
              f" {case.get('error', '')[:120]}", flush=True)
    results["failed"] = failed
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
