"""The GPU check: a budgeted plan, printed first, then phases that each save their record.

Run through ``scripts/gpu_check.sh`` on a bare GPU machine (no network, no model hub) with the
machine's own Python, torch, Triton and transformers: the install phase installs this checkout
alone (``--no-deps``). The default run fits an H200 in ``BUDGET_S``: its plan (``phases``,
``plan_text``) counts every process start, load, compile and timed part of each phase from the unit
costs in ``UNITS``, each with where it comes from, and is printed before anything runs. A phase may run past its
estimate into the plan's margin but never into the estimates of the phases after it, so the run
ends within the budget. ``<out>/<stem>.check.json`` is rewritten after every phase (the plan, each
phase's time, exit code and output tail): a run cut short still says what finished. The default
run writes at most ``MAX_FILES`` files (the device returns no more).

Phases (default): install, rungs (every rung on the tiny model, scripts/gpu_rungs.py), checkpoint
(the 1.5B random one, drawn on the GPU), kernels (our Triton kernels at the real shapes), bench
(fused and triton beside transformers' bf16 generate at the full shape), serve (the contest's
load, scripts/gpu_serve.py). ``--full`` widens them: the rung matrix in fp16 and fp32 and with
cuDNN forced, the focused bench (every rung, int8 and int4, transformers' static cache + compile,
paired decode, quantization accuracy, speculative decoding) and the GPU tests. Its plan is longer
than one device command may run (10 minutes): run it on a machine held longer.

``--dry-run`` prints the same H200 plan, then runs the phases on the CPU with the tiny checkpoint
and small sizes (CI keeps the script from rotting); it writes to a temp folder. Its install phase,
like the real one, installs this checkout (editable) into the running Python's environment:
rehearse in a throwaway virtual environment (scripts/rehearse_device_versions.sh).

Only the standard library is imported here: the engine is installed by a phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_rungs import CAPTURED, COMPILED, matrix

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 360  # the default check: six minutes of the session's fifteen
FULL_BUDGET_S = 1200  # --full: about 17 minutes planned
DRY_RUN_BUDGET_S = 1800  # a CPU compiles with inductor's C++ backend: minutes per compile
MAX_FILES = 8  # files the device returns from $OUT

# The serve phase's packages that the H200 image lacks (KINDS.md's package list has httpx, anyio, h11,
# idna and click, not these), with what they need in turn: carried as wheels at the lock's versions
# (--fetch-wheels). typing_extensions is there, but pydantic_core needs >= 4.16: carried too.
SERVE_WHEELS = ("fastapi", "starlette", "pydantic", "pydantic_core", "annotated-types", "typing-inspection",
                "typing_extensions", "opentelemetry-api", "uvicorn", "openai", "httpx2", "httpcore2", "truststore",
                "jiter", "sniffio")

# The contest's load (issue 25, item 4): prompts at each concurrency, tokens in and out, greedy.
SERVE_LOAD = dict(prompts=64, prompt_tokens=512, max_tokens=128, concurrency=(16, 50))
PREFILL_CHUNK = 256  # the server's default prompt tokens per step (engine_lib.loop.scheduler)


@dataclass(frozen=True)
class Unit:
    seconds: float
    basis: str  # "stated" (an estimate and its reason) or "CPU-scaled" (a CPU measurement, scaled as said)
    reason: str


# Unit costs on the lent H200 (16 host cores, every cache cold). None is a GPU measurement: no GPU
# has run this code yet. After the first run, compare them with <stem>.check.json's phase times.
UNITS = {
    "python": Unit(6, "CPU-scaled", "python3 importing torch 2.11, transformers 5.17 and the engine measured 8.5 s "
                   "on this project's busy 2-core CPU; x0.6 for the H200 host's faster, idle cores, + 1 s of CUDA "
                   "context"),
    "install": Unit(10, "CPU-scaled", "pip install --no-deps -e . measured 9 and 11 s in two dry runs on the busy "
                    "2-core CPU; x1: pip is one process"),
    "tiny_case": Unit(1, "stated", "one tiny-model case (load, 2 x 6 greedy tokens) is launch-bound on a GPU; the CPU "
                      "dry run's 6-8 s per case is mostly CPU arithmetic a GPU does not have"),
    "compile_tiny": Unit(10, "stated", "dynamo + inductor for the 4-layer step, Triton kernels built on 16 host "
                         "cores; on the busy 2-core CPU (C++ kernels) it measured 40-150 s"),
    "compile_28": Unit(45, "stated", "the 28-layer step traces 7x the tiny step's layers but builds the same few "
                       "dozen kernels (identical layers share them); one 28-layer int8 compile measured 199 s on "
                       "the 2-core CPU (C++ kernels)"),
    "compile_static_hf": Unit(90, "stated", "transformers' whole model under torch.compile(mode='reduce-overhead') "
                              "with a static cache: two graphs (prefill, decode)"),
    "compile_op": Unit(4, "stated", "torch.compile of one int8 matmul (2 shapes x rows 1 and 8); the first also "
                       "starts inductor's compile workers"),
    "triton_jit": Unit(1.5, "stated", "Triton 3.6 compiles one kernel specialisation in 1-2 s on a fast host "
                       "(issue 26: 1-16 s on a 2-core host)"),
    "draw_save_3gb": Unit(8, "stated", "1.5B random weights drawn on the GPU (<1 s), copied to the host and "
                          "written as 3.1 GB of safetensors at 0.5-1 GB/s"),
    "load_3gb": Unit(4, "stated", "3.1 GB of bf16 from the page cache to the GPU, plus the model's setup"),
    "capture": Unit(0.5, "stated", "one CUDA graph capture of the 28-layer step (a warm-up step, then the capture)"),
    "eager_token": Unit(0.025, "CPU-scaled", "the dry run's bench counted 275 host ops per token on the 4-layer "
                        "tiny model, ~65 a layer: ~1,850 at 28 layers, at ~12 us of dispatch and launch each (stated): "
                        "an eager step is launch-bound"),
    "hf_token": Unit(0.025, "stated", "one token of transformers' generate: eager, launch-bound like ours"),
    "diagnostics": Unit(4, "stated", "the bench's per-rung diagnostics: torch.profiler over one prefill + step, "
                        "eager ops counted over two short generations"),
    "kernel_row": Unit(0.6, "stated", "one row of the kernel bench: both sides checked, warmed up and timed for "
                       "0.1 s each"),
    "serve_step": Unit(0.03, "stated", "one eager server step (a decode of up to 50 rows, or a 256-token prefill "
                       "chunk): ~1,850 host ops at 28 layers (275 counted per token at 4 layers in the dry run) at ~12 us each, "
                       "plus the scheduler's work"),
    "graph_step": Unit(0.005, "stated", "one server decode step replayed as a CUDA graph: ~3 GB of weights at "
                       "4.3 TB/s (0.7 ms) plus the scheduler's work and the host's copies"),
    "probe": Unit(1, "stated", "nvidia-smi for the GPU's name and the torch package's metadata (no torch import)"),
    "wheels": Unit(3, "stated", "pip unpacking 15 small wheels (6 MB) into a folder, no index, no dependencies"),
    "gpu_tests": Unit(200, "stated", "tests/test_gpu.py (each kernel eager and compiled, batch 3): the old check's "
                      "estimate"),
}


@dataclass
class Phase:
    name: str
    cmd: list[str]
    items: list[tuple[float, str, str]] = field(default_factory=list)  # (count, unit, what)
    files: tuple[str, ...] = ()  # what it writes into out, by suffix after the stem

    @property
    def estimate_s(self) -> float:
        return sum(n * UNITS[u].seconds for n, u, _ in self.items)


def serve_items(prompts: int, prompt_tokens: int, max_tokens: int, concurrency) -> list:
    """The load's server steps, per level: each wave of ``c`` requests decodes ``max_tokens`` steps, and
    every prompt passes in ``PREFILL_CHUNK``-token chunks (counted apart: an upper bound). Before each
    level, ``c`` warm-up requests of 4 tokens (``loadtest.warm_up``) add 4 decode steps and their
    prompts' chunks. Counted for both forms of the server's decode, eager or compiled and captured
    per batch bucket (engine_lib/step/paged.py); the dearer is planned."""
    decode = sum(math.ceil(prompts / c) * max_tokens + 4 for c in concurrency)
    prefill = sum(math.ceil((prompts + c) * prompt_tokens / PREFILL_CHUNK) for c in concurrency)
    load = f"{prompts} prompts x {prompt_tokens} tokens in, {max_tokens} out, at concurrency " + \
        " and ".join(map(str, concurrency))
    start = [(1, "python", "process start"), (1, "load_3gb", "the fused rung, served")]
    eager = start + [(decode + prefill, "serve_step", f"{decode} decode + {prefill} prefill steps, eager: {load}")]
    captured = start + [(2, "compile_28", "the server's decode step: batch 1 and batch 2+ are two variants"),
                        (10, "capture", "one graph per batch bucket visited (1 to 64)"),
                        (decode, "graph_step", f"decode steps: {load}"), (prefill, "serve_step", "prefill chunks")]
    cost = lambda items: sum(n * UNITS[u].seconds for n, u, _ in items)
    return max(eager, captured, key=cost)


def bench_items(stages: list[str], prompts: int, new: int, long_new: int, full: bool) -> list:
    compiled = [s for s in stages if s in COMPILED + ("int4",)]
    captured = [s for s in stages if s in CAPTURED + ("int4",)]
    eager = [s for s in stages if s not in captured]
    tokens = 2 * (prompts * new + long_new)  # a warm-up and a timed run of each prompt
    hf = 2 if full else 1  # transformers in fp32 and bf16 (full) or bf16 alone
    items = [(1, "python", "process start"),
             (len(stages) + hf, "load_3gb", f"{len(stages)} rungs + {hf} transformers"),
             (len(compiled), "compile_28", "one per compiled rung: " + ", ".join(compiled)),
             (5 * len(captured), "capture", "a graph per cache bucket (seed, long, 3 step contexts), "
                                            + ", ".join(captured)),
             (tokens * len(eager), "eager_token", f"{tokens} tokens each: {', '.join(eager)}"),
             (tokens * hf, "hf_token", f"{tokens} tokens x {hf} dtypes of transformers' generate"),
             (3 * 3 * 6 * len(eager), "eager_token", "step latency: 3 contexts x 3 rounds x 6 steps, eager rungs"),
             (len(stages), "diagnostics", "per rung")]
    if "triton" in stages:
        items.append((12, "triton_jit", "the triton rung's 4 kernels at its query lengths and chunk counts"))
    if full:
        items += [(1, "compile_static_hf", "transformers' static cache + compile baseline"),
                  (len(compiled), "compile_28", "sampling diagnostics: one more variant per compiled rung"),
                  (5, "load_3gb", "paired decode (2 pairs) and speculative decoding"),
                  (2 * 7 * new * 2, "eager_token", "paired decode: 7 rounds, half beside fused and int8")]
    return [i for i in items if i[0]]  # no eager rung, no eager tokens


def phases(dry: bool, full: bool, ckpt: Path, out: Path, stem: str, work: Path,
           wheels: Path | None = None) -> list[Phase]:
    py = sys.executable
    cases = matrix(False, full)
    n_compiled = sum(r in COMPILED for r, _, _ in cases)
    rungs = Phase("rungs", [py, str(ROOT / "scripts" / "gpu_rungs.py"), "--out", str(out / f"{stem}.rungs.json"),
                            "--checkpoint-root", str(work / "tiny")] + (["--dry-run"] if dry else [])
                  + (["--full"] if full else []),
                  [(1, "python", "process start"), (len(cases), "tiny_case", f"{len(cases)} cases (load, run)"),
                   (n_compiled, "compile_tiny", f"{n_compiled} compiled cases, one compile each"),
                   (6, "triton_jit", "the triton rung's 4 kernels, some at two specialisations")], (".rungs.json",))
    make = Phase("checkpoint", [py, "-m", "engine_lib", "make-checkpoint", "--out", str(ckpt)]
                 + (["--preset", "tiny"] if dry else ["--preset", "qwen2.5-1.5b-random", "--device", "cuda"]),
                 [(1, "python", "process start"), (1, "draw_save_3gb", "the 1.5B random checkpoint")])
    kernels = Phase("kernels", [py, "-m", "engine_lib.bench.kernels", "--model", str(ckpt), "--out",
                                str(out / f"{stem}.kernels.json")]
                    + (["--quick", "--device", "cpu"] if dry else []),  # dry: Triton's interpreter, correctness only
                    [(1, "python", "process start"), (4, "compile_op", "the int8 baseline, 2 shapes x 2 row counts"),
                     (12, "triton_jit", "4 kernels at their sizes' specialisations"),
                     (13, "kernel_row", "2 norm, 1 RoPE, 6 attention, 4 int8 rows")], (".kernels.json",))
    # default: the rungs only a GPU can rank; the eager ones run on the tiny model in the rungs phase
    stages = ["kv_cache", "half", "fused", "int8", "int4", "triton"] if full else ["fused", "triton"]
    bench_cmd = [py, "-m", "engine_lib", "bench", "--model", str(ckpt), "--out", str(out), "--name", stem]
    if dry:  # tiny, CPU: no triton (the interpreter has no speed to measure), one compile
        bench_cmd += ["--preset", "check", "--stages", "half", "fused", "--prompts", "1", "--max-new-tokens", "4",
                      "--long-tokens", "64", "--repeats", "1", "--contexts", "64", "128"]
    elif full:
        bench_cmd += ["--preset", "focused", "--stages", *stages]
    else:  # one run per prompt: the paired decode and the quantization accuracy need repeats > 1
        bench_cmd += ["--preset", "check", "--stages", *stages, "--repeats", "1"]
    bench = Phase("bench", bench_cmd, bench_items(stages, 3, 32, 8, full), (".json", ".md", ".png"))
    load = dict(SERVE_LOAD)
    if dry:
        load = dict(prompts=8, prompt_tokens=64, max_tokens=8, concurrency=(2, 4))
    serve = Phase("serve", [py, str(ROOT / "scripts" / "gpu_serve.py"), "--model", str(ckpt), "--out", str(out),
                            "--name", stem, "--prompts", str(load["prompts"]), "--prompt-tokens",
                            str(load["prompt_tokens"]), "--max-tokens", str(load["max_tokens"]), "--concurrency",
                            *map(str, load["concurrency"])] + (["--kv-cache-gib", "0.25"] if dry else []),
                  serve_items(**load), (".serve.json",))
    # no build isolation and no dependencies: the machine has no package registry
    install = Phase("install", [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(ROOT)],
                    [(1, "install", "pip install --no-deps -e .")])
    if wheels:  # the serve phase's packages, beside the machine's own (PYTHONPATH), never replacing its torch
        install.cmd = ["bash", "-c", shlex.join(install.cmd) + f" && {shlex.quote(py)} -m pip install -q --no-index "
                       f"--no-deps --no-compile --upgrade --target {shlex.quote(str(work / 'site'))} "
                       f"{shlex.quote(str(wheels))}/*.whl"]
        install.items.append((1, "wheels", f"the carried wheels in {wheels.name}/"))
    out_phases = [install, rungs, make, kernels, bench, serve]
    if full:
        out_phases.append(Phase("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                              str(ROOT / "tests" / "test_gpu.py")], [(1, "gpu_tests", "")]))
    return out_phases


def plan_text(plan: list[Phase], budget: float, full: bool) -> str:
    total = sum(p.estimate_s for p in plan)
    files = 1 + sum(len(p.files) for p in plan)  # + <stem>.check.json
    lines = [f"Plan for an H200 ({'--full' if full else 'the default run'}); every cost is an estimate, "
             "not a GPU measurement", f"{'phase':11s}{'est. s':>7s}  = count x unit cost (what)"]
    for p in plan:
        for i, (n, u, what) in enumerate(p.items):
            head = f"{p.name:11s}{p.estimate_s:7.0f}  = " if i == 0 else f"{'':18s}  + "
            lines.append(f"{head}{n:g} x {u} {UNITS[u].seconds:g} s" + (f" ({what})" if what else ""))
    over = "" if total <= budget else " -- OVER BUDGET"
    lines.append(f"{'total':11s}{total:7.0f}  of a {budget:.0f} s budget, margin {budget - total:.0f} s{over}; "
                 f"{files} files (the device returns {MAX_FILES})")
    lines.append("where each unit cost comes from:")
    used = {u for p in plan for _, u, _ in p.items}
    lines += [f"  {u} {UNITS[u].seconds:g} s, {UNITS[u].basis}: {UNITS[u].reason}" for u in UNITS if u in used]
    return "\n".join(lines)


def device_info() -> dict:
    """Which GPU and which torch, in a second: nvidia-smi and the package's metadata, not torch's import."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        name, cap = out.stdout.splitlines()[0].rsplit(", ", 1)
        return {"cuda": True, "name": name, "torch": torch, "capability": [int(x) for x in cap.split(".")]}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):  # no NVIDIA driver: the CPU
        return {"cuda": False, "name": "cpu", "torch": torch, "capability": None}


def fetch_wheels(folder: Path) -> int:
    """Download SERVE_WHEELS at the lock's versions for the device (Python 3.12, x86-64), to carry."""
    lock = dict(line.split("==") for line in (ROOT / "requirements-lock.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    norm = {re.sub(r"[-_.]+", "-", k).lower(): f"{k}=={v}" for k, v in lock.items()}
    pins = [norm[re.sub(r"[-_.]+", "-", w).lower()] for w in SERVE_WHEELS]
    platforms = [a for n in (17, 27, 28) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *platforms, "--platform", "manylinux2014_x86_64", "-d", str(folder), *pins]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    exclude = ROOT / ".git" / "info" / "exclude"  # untracked, never committed, but carried to the device
    if rc == 0 and folder.resolve().parent == ROOT and (ROOT / ".git").is_dir():
        exclude.parent.mkdir(exist_ok=True)
        line = f"/{folder.resolve().name}/"
        if line not in (exclude.read_text().split() if exclude.exists() else []):
            with exclude.open("a") as f:
                f.write(line + "\n")
    print(f"carry {folder} (run's carry: [{folder.name!r}]); scripts/gpu_check.sh installs it with --no-deps")
    return rc


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the H200 plan, then the phases on the CPU, tiny "
                        "checkpoint: keeps the script honest")
    parser.add_argument("--out", default=None, help="results folder ($OUT on the device; default book/results, "
                        "a temp folder with --dry-run)")
    parser.add_argument("--full", action="store_true", help="the wide rung matrix, the focused bench and the GPU "
                        "tests (see the plan it prints)")
    parser.add_argument("--plan", action="store_true", help="print the plan and exit")
    parser.add_argument("--budget", type=int, default=None, help="seconds for all phases together "
                        f"(default {BUDGET_S}, {FULL_BUDGET_S} with --full, {DRY_RUN_BUDGET_S} with --dry-run)")
    parser.add_argument("--wheels", metavar="DIR", default=None, help="install the carried wheels in DIR in the "
                        "install phase (default: .whl where it holds wheels, except with --dry-run)")
    parser.add_argument("--fetch-wheels", metavar="DIR", default=None, help="download the serve phase's wheels "
                        "that the device image lacks into DIR (here, with a registry), and exit")
    return parser.parse_args()


def main() -> int:
    args = arguments()
    if args.fetch_wheels:
        return fetch_wheels(Path(args.fetch_wheels))
    gpu_budget = args.budget or (FULL_BUDGET_S if args.full else BUDGET_S)
    budget = DRY_RUN_BUDGET_S if args.dry_run and not args.budget else gpu_budget
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ckpt = work / ("tiny-seed0" if args.dry_run else "qwen2.5-1.5b-random-seed0-drawn-on-gpu")  # the name is the record's
    stem = "dry-run-cpu"
    wheels = Path(args.wheels) if args.wheels else ROOT / ".whl"
    wheels = wheels.resolve() if (args.wheels or not args.dry_run) and any(wheels.glob("*.whl")) else None
    probe = Phase("probe", [], [(1, "probe", "which GPU, before the phases")])  # inside the budget, as planned
    gpu_plan = [probe] + phases(False, args.full, ckpt, work, stem, work, wheels or ROOT / ".whl")
    text = plan_text(gpu_plan, gpu_budget, args.full)
    print(text, flush=True)
    if args.plan:
        return 0 if sum(p.estimate_s for p in gpu_plan) <= gpu_budget else 1
    # PYTHONPATH: the engine also runs from the checkout if the install phase fails
    path = [str(ROOT), str(work / "site") if wheels else None, os.environ.get("PYTHONPATH")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # our kernels on the CPU: Triton's interpreter
    info = device_info()
    if not info["cuda"] and not args.dry_run:
        print("scripts/gpu_check.sh needs a CUDA GPU (use --dry-run to rehearse on the CPU)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (work / "results" if args.dry_run else ROOT / "book" / "results")
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run:
        stem = re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    run = phases(args.dry_run, args.full, ckpt, out, stem, work, wheels)
    log = {"device": info, "dry_run": args.dry_run, "full": args.full, "budget_s": budget, "plan": text,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": []}
    print(f"GPU check on {info['name']} (torch {info['torch']}), budget {budget} s -> {out}", flush=True)
    return run_phases(run, args.dry_run, budget, env, log, out, stem)


def run_phases(run: list, dry_run: bool, budget: float, env: dict, log: dict, out: Path, stem: str) -> int:
    """Every phase in turn, each inside what the budget leaves it, the record written after each one."""
    record = out / f"{stem}.check.json"
    start = time.monotonic()
    for i, phase in enumerate(run):
        # past its estimate a phase may use the margin, never what the later phases are planned to take
        later = 0 if dry_run else sum(p.estimate_s for p in run[i + 1:])
        timeout = max(5, int(budget - (time.monotonic() - start) - later))
        entry = run_phase(phase, timeout, env, dry_run)
        log["phases"].append(entry)
        record.write_text(json.dumps(log, indent=2))  # after every phase: a partial run still leaves a record
        status = entry["skipped"] or ("ok" if entry["ok"] else f"FAILED (rc {entry['rc']})")
        planned = "" if dry_run else f"estimate {phase.estimate_s:.0f} s, "  # the plan is the H200's
        print(f"[{phase.name}] {status} in {entry['seconds']:.0f} s ({planned}limit {timeout} s)", flush=True)
        if not entry["ok"]:
            print(entry["tail"][-1500:], flush=True)
        if phase.name == "checkpoint" and not entry["ok"]:
            break  # nothing after it can run
    log["total_s"] = round(time.monotonic() - start, 1)
    written = sorted(p.name for p in out.iterdir() if p.is_file() and p.name.startswith(stem))
    log["files"] = written + ([] if record.name in written else [record.name])
    record.write_text(json.dumps(log, indent=2))
    print(f"done in {log['total_s']} s; {len(log['files'])} files in {out}: {', '.join(log['files'])}")
    return 0 if all(p["ok"] for p in log["phases"]) and len(log["phases"]) == len(run) else 1


def run_phase(phase, timeout: int, env: dict, dry_run: bool) -> dict:
    """One phase's command, stopped at ``timeout`` -> its log entry."""
    t0 = time.monotonic()
    try:
        # the load stops itself inside the phase's limit (its start and load: about 20 s on an H200)
        cmd = phase.cmd + (["--time-limit", str(max(10, timeout - 20))] if phase.name == "serve" else [])
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, text = 124, f"timed out after {timeout} s\n{partial}"
    # pytest exits 5 when every test was skipped (a CPU dry run): not a failure
    ok = rc == 0 or (phase.name == "gpu_tests" and rc == 5 and dry_run)
    skipped = next((line for line in text.splitlines() if line.startswith(f"{phase.name}: skipped")), None)
    return {"phase": phase.name, "rc": rc, "ok": ok, "seconds": round(time.monotonic() - t0, 1),
            "estimate_s": round(phase.estimate_s), "timeout_s": timeout, "skipped": skipped, "tail": text[-2000:]}


if __name__ == "__main__":
    sys.exit(main())
