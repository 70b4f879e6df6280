"""The GPU check, in phases that each have their own time limit and leave a record behind.

Run through ``scripts/gpu_check.sh`` on a bare GPU machine (torch, transformers and pytest
installed, no network, no model hub). Every phase runs as a subprocess under a timeout,
and ``<out>/<device>.check.json`` is rewritten after each one, so a run cut short still
says what finished. ``--dry-run`` runs the same phases on the CPU with the tiny checkpoint,
so CI keeps the script from rotting; it writes to a temp folder. Its install phase, like the
real one, installs this checkout (editable) into the running Python's environment: rehearse in
a throwaway virtual environment.

Phases and their estimated time on an H200 (issues 14 and 16; the whole default check: about 6
minutes, with no margin: run ``--budget`` higher if the device allows). Estimated from CPU
measurements (a 2-core CPU shared with other jobs): the tiny step compiles there in 40-125 s,
inductor's C++ build being most of it; on an H200 host (16 fast cores, Triton kernels,
inductor's caches cold) a compile of the 4-layer tiny step is taken as 8 s and of the 28-layer
step as 35 s; a 3 GB checkpoint load as 4 s.

- install          ~10 s   pip install -e, no dependencies
- rungs            ~120 s  tiny model: every rung, eager (kv_cache, half) with each SDPA kernel
                           forced, compiled (fused, int8) with the engine's choice, memory-efficient
                           and cuDNN; fp32, fp16, bf16: 25 eager cases (~1 s each) + 9 compiles
                           (~8 s each) + 34 loads -> <out>/<device>.rungs.json, after every case
- checkpoint       ~20 s   the 1.5B random checkpoint, drawn on the GPU
- kernels          ~30 s   each of our Triton kernels (chapter 13) beside the op it replaces, at
                           the real shapes: time, GB/s against the copy roofline; Triton's JIT
                           compiles each kernel once (~1-2 s each) -> <out>/<device>.kernels.json
- bench            ~195 s  full shape, preset ``check``: naive, kv_cache, half, fused, int8, triton
                           and transformers' generate; one compile each for fused and int8 (~70 s),
                           about 12 loads (~50 s), timed runs and step latencies (~75 s); the
                           triton rung's step latency at 64, 2,048 and 4,096 tokens of context
                           sits beside fused's
The dry run, measured on the project's shared 2-core CPU: install 11 s, rungs 68 s (two eager
cases), checkpoint 30 s, bench 333 s (kv_cache, fused, int8: the two compiles are most of it).
--full adds (about 8 more minutes; run it when the device budget allows):
- gpu_tests        ~200 s  tests/test_gpu.py (each kernel eager and compiled, batch 3, a second GPU)
- bench_full       ~280 s  preset ``focused`` with int4: transformers' static cache + compile,
                           sampling diagnostics, speculative decoding

Only the standard library is imported here: the engine is installed by a phase.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 360  # the default check: six minutes
FULL_BUDGET_S = 900
DRY_RUN_BUDGET_S = 1800


def phases(dry: bool, full: bool, ckpt: Path, out: Path, stem: str, work: Path) -> list[tuple[str, int, list[str]]]:
    py = sys.executable
    rungs = [py, str(ROOT / "scripts" / "gpu_rungs.py"), "--out", str(out / f"{stem}.rungs.json"),
             "--checkpoint-root", str(work / "tiny")] + (["--dry-run"] if dry else [])
    bench = [py, "-m", "engine_lib", "bench", "--preset", "check", "--model", str(ckpt), "--out", str(out),
             "--name", stem]
    kernels = [py, "-m", "engine_lib.bench.kernels", "--model", str(ckpt), "--out", str(out / f"{stem}.kernels.json")]
    if dry:
        kernels += ["--quick", "--device", "cpu"]  # under Triton's interpreter: correctness only
        make = [py, "-m", "engine_lib", "make-checkpoint", "--preset", "tiny", "--out", str(ckpt)]
        bench += ["--prompts", "1", "--max-new-tokens", "4", "--long-tokens", "64", "--repeats", "1",
                  "--contexts", "64", "128", "--stages", "kv_cache", "fused", "int8"]
    else:
        make = [py, "-m", "engine_lib", "make-checkpoint", "--preset", "qwen2.5-1.5b-random", "--out", str(ckpt),
                "--device", "cuda"]
        bench += ["--stages", "naive", "kv_cache", "half", "fused", "int8", "triton"]
    out_phases = [
        # no build isolation and no dependencies: the machine has no package registry
        ("install", 60, [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]),
        ("rungs", 150, rungs),
        ("checkpoint", 60, make),
        ("kernels", 60, kernels),
        ("bench", 220, bench),
    ]
    if full:
        out_phases += [
            ("gpu_tests", 300, [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                str(ROOT / "tests" / "test_gpu.py")]),
            ("bench_full", 400, [py, "-m", "engine_lib", "bench", "--preset", "focused", "--model", str(ckpt),
                                 "--out", str(out), "--name", f"{stem}-full", "--stages", "kv_cache", "half",
                                 "fused", "int8", "int4"]),
        ]
    return out_phases


def device_info() -> dict:
    probe = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'cuda': c, "
             "'name': torch.cuda.get_device_name() if c else 'cpu', 'torch': torch.__version__, "
             "'capability': list(torch.cuda.get_device_capability()) if c else None}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny checkpoint, seconds: keeps the script honest")
    parser.add_argument("--out", default=None, help="results folder (default book/results; a temp folder with --dry-run)")
    parser.add_argument("--full", action="store_true", help="also the GPU tests and the focused bench (int4, "
                        "static-cache baseline, sampling diagnostics): about 8 more minutes")
    parser.add_argument("--budget", type=int, default=None, help="seconds for all phases together "
                        f"(default {BUDGET_S}, {FULL_BUDGET_S} with --full)")
    args = parser.parse_args()
    # the six minutes are the H200's; a CPU rehearsal compiles on whatever CI has, so it gets more
    args.budget = args.budget or (DRY_RUN_BUDGET_S if args.dry_run else FULL_BUDGET_S if args.full else BUDGET_S)
    # PYTHONPATH: the engine also runs from the checkout if the install phase fails
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                         os.environ.get("PYTHONPATH")]))}
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # our kernels on the CPU: Triton's interpreter
    info = device_info()
    if not info["cuda"] and not args.dry_run:
        print("scripts/gpu_check.sh needs a CUDA GPU (use --dry-run to rehearse on the CPU)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out = Path(args.out) if args.out else (work / "results" if args.dry_run else ROOT / "book" / "results")
    out.mkdir(parents=True, exist_ok=True)
    stem = "dry-run-cpu" if args.dry_run else re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    log = {"device": info, "dry_run": args.dry_run, "budget_s": args.budget, "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": []}
    record = out / f"{stem}.check.json"
    start = time.monotonic()
    print(f"GPU check on {info['name']} (torch {info['torch']}), budget {args.budget} s -> {out}", flush=True)
    # the folder's name is the model's name in the record
    ckpt = work / ("tiny-seed0" if args.dry_run else "qwen2.5-1.5b-random-seed0-drawn-on-gpu")
    for name, limit, cmd in phases(args.dry_run, args.full, ckpt, out, stem, work):
        left = args.budget - (time.monotonic() - start)
        timeout = max(5, min(limit * (2 if args.dry_run else 1), int(left)))  # a CPU compiles slower
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text = 124, f"timed out after {timeout} s\n" + ((exc.stdout or b"").decode(errors="replace")
                                                               if isinstance(exc.stdout, bytes) else (exc.stdout or ""))
        seconds = time.monotonic() - t0
        # pytest exits 5 when every test was skipped (a CPU dry run): not a failure
        ok = rc == 0 or (name == "gpu_tests" and rc == 5 and args.dry_run)
        log["phases"].append({"phase": name, "rc": rc, "ok": ok, "seconds": round(seconds, 1),
                              "timeout_s": timeout, "tail": text[-2000:]})
        record.write_text(json.dumps(log, indent=2))  # after every phase: a partial run still leaves a record
        print(f"[{name}] {'ok' if ok else f'FAILED (rc {rc})'} in {seconds:.0f} s", flush=True)
        if not ok:
            print(text[-1500:], flush=True)
        if name == "checkpoint" and not ok:
            break  # nothing after it can run
    log["total_s"] = round(time.monotonic() - start, 1)
    record.write_text(json.dumps(log, indent=2))
    print(f"done in {log['total_s']} s; phase log {record}; results {out}/{stem}.{{json,md,png}}")
    expected = len(phases(args.dry_run, args.full, ckpt, out, stem, work))
    return 0 if all(p["ok"] for p in log["phases"]) and len(log["phases"]) == expected else 1


if __name__ == "__main__":
    sys.exit(main())
