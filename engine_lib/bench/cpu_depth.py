"""The CPU record at the real model's depth: every system in a process of its own, taken in turn.

Defined for chapter 08 (results) and the CPU appendix. ``python -m engine_lib bench`` times the rungs inside
one process, which suits a GPU and short checkpoints; on a CPU at 28 layers what a reader compares is whole
programs: how long one takes to start, to answer, to decode, and how much of the machine's memory it holds.
So here each system (a rung of the engine, ``transformers``, llama.cpp at one GGUF width) is started as a
fresh process, timed from the moment it is launched, and its peak resident memory is the operating
system's count (VmHWM), not an allocator's. The systems are taken in turn, one process each per round, the
order reversed every other round, so a drift of the machine falls on all of them alike.

Round 0 is every system's first start: the quantized rungs quantize the checkpoint and save the result
(``model.quantized_file``), llama.cpp's GGUF files already exist. Rounds 1.. are later starts, and the record
gives the best of them with the spread (lowest to highest). Each start: load, one reply (its first token,
counted from the launch, is the start-up a user waits for), then ``--repeats`` greedy replies to the book's
first seed prompts, their median the round's reading.

    python -m engine_lib.bench.cpu_depth --model CKPT [--peer llama.cpp] [--rounds 3] [--out book/results]

On a CPU with AVX-512, ``bash scripts/cpu_as_avx2.sh python -m engine_lib.bench.cpu_depth ...`` holds the engine
and llama.cpp to AVX2 (the record says "AVX2 of an AVX512 CPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .measure import peak_memory_bytes

ENGINE_RUNGS = ("kv_cache", "half", "fused", "int8", "int4")
HF_DTYPES = ("float32", "bfloat16")
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
# rung -> the llama.cpp files of its width, and the goals (issue 52)
PAIRS = {"half": ("F16", "BF16"), "fused": ("F16", "BF16"), "int8": ("Q8_0",), "int4": ("Q4_0", "Q4_K_M")}
GOALS = {"decode_x": 1.1, "ttft_x": 1.0, "rss_x": 1.25, "start_x": 1.5}


def seed_ids(n: int) -> list[list[int]]:
    from ..model.tokenizer import seed_prompts

    return [p["input_ids"] for p in seed_prompts()[:n]]


# ------------------------------------------------------------------------------------ one system, one process
def child(spec: str, model_dir: str, t0: float, prompts: int, new_tokens: int, repeats: int) -> dict:
    """Run in the launched process: load ``spec`` ("engine:int8", "hf:bfloat16"), answer once (the start-up),
    then ``repeats`` replies to each of the first ``prompts`` seed prompts. -> the readings."""
    kind, what = spec.split(":")
    import torch

    ids = seed_ids(prompts)
    if kind == "engine":
        from ..cpu.huge_pages import huge_page_bytes
        from ..engine import Engine

        engine = Engine.from_pretrained(model_dir, device="cpu", stage=what)
        ran_on = engine.runs_on
        probe = huge_page_bytes

        def reply(p: list[int], n: int) -> tuple[float, float]:
            r = engine.generate(p, max_new_tokens=n, do_sample=False, stop_token_ids=[])
            return r.ttft_s, r.decode_tokens_per_s
    else:
        from .reference import load_hf_model
        from .run import hf_timer

        run = hf_timer(load_hf_model(model_dir, getattr(torch, what)), torch.device("cpu"))
        ran_on = f"transformers generate, {what}"
        probe = None

        def reply(p: list[int], n: int) -> tuple[float, float]:
            ttft, rate, _ = run([p], n, False)
            return ttft, rate
    return readings(reply, ids, t0, time.time() - t0, new_tokens, repeats, probe) | {
        "threads": torch.get_num_threads(), "runs_on": ran_on}


def readings(reply, ids: list[list[int]], t0: float, load_s: float, new_tokens: int, repeats: int,
             huge_pages=None) -> dict:
    """The start-up reply, then the timed ones: -> load, first token from launch, TTFT and decode medians, RSS;
    with ``huge_pages`` (the engine's ``huge_page_bytes``) the process's memory on 2 MiB pages as the timed replies
    began and as they ended (the weights are collapsed onto them in the background, which a busy loop slows)."""
    asked = time.time()
    ttft, _ = reply(ids[0], 8)  # the first reply: compiles what the rung compiles
    first_token_s = asked - t0 + ttft
    pages = [huge_pages()] if huge_pages else []
    ttfts, rates = [], []
    for _ in range(repeats):
        for p in ids:
            t, r = reply(p, new_tokens)
            ttfts.append(t)
            rates.append(r)
    out = {"load_s": load_s, "first_token_s": first_token_s, "ttft_ms": 1e3 * statistics.median(ttfts),
           "decode_tok_s": statistics.median(rates), "peak_rss_bytes": peak_memory_bytes("cpu")}
    if pages and pages[0] is not None:
        out["huge_page_bytes"] = pages + [huge_pages()]  # [as the timed replies began, as they ended]
    return out


def run_engine_or_hf(spec: str, model_dir: Path, prompts: int, new_tokens: int, repeats: int, timeout: float) -> dict:
    """Launch ``spec`` in a fresh Python process and collect its readings (its last line of output)."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "engine_lib.bench.cpu_depth", "--child", spec, "--model", str(model_dir),
           "--t0", repr(t0), "--prompts", str(prompts), "--new-tokens", str(new_tokens), "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip()[-600:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llamacpp(gguf_type: str, model_dir: Path, prompts: int, new_tokens: int, repeats: int, threads: int) -> dict:
    """llama.cpp at one GGUF width, launched fresh (its Node.js worker): the same readings as ``child``."""
    from .gguf_export import ensure_gguf
    from .llamacpp import LlamaCppProcess

    path = ensure_gguf(model_dir, gguf_type)["path"]  # made before the clock starts, as the engine's checkpoint was
    ids = seed_ids(prompts)
    t0 = time.time()
    with LlamaCppProcess(path, threads, 1024) as proc:
        load_s = time.time() - t0

        def reply(p: list[int], n: int) -> tuple[float, float]:
            r = proc.generate(p, n)
            return r["ttft_s"], r["decode_tok_s"]

        out = readings(reply, ids, t0, load_s, new_tokens, repeats)
        out["peak_rss_bytes"] = proc.memory()["peak_rss_bytes"]  # the worker's, not this process's
        out.update(threads=threads, runs_on=f"llama.cpp {gguf_type} (node-llama-cpp {proc.hello['node_llama_cpp']}, "
                                            f"{proc.hello['build']} build)", system_info=proc.hello["system_info"])
    return out


# ------------------------------------------------------------------------------------------ the rounds
def systems(rungs: list[str], hf: list[str], ggufs: list[str]) -> list[str]:
    """The systems in the order they are taken: each width's engine rungs beside its other systems."""
    order = [f"hf:{d}" for d in hf if d == "float32"] + [f"engine:{r}" for r in rungs if r == "kv_cache"]
    order += [f"hf:{d}" for d in hf if d != "float32"]
    for group in (("half", "fused"), ("int8",), ("int4",)):
        order += [f"engine:{r}" for r in rungs if r in group]
        order += [f"llama.cpp:{t}" for t in ggufs if any(t in PAIRS[r] for r in group)]
    return order + [f"llama.cpp:{t}" for t in ggufs if f"llama.cpp:{t}" not in order]


def forget_saved(model_dir: Path, spec: str) -> None:
    """Before a quantized rung's first start: remove its saved model, so round 0 quantizes and saves it."""
    from ..model.paths import derived_dir

    rung = spec.split(":")[1]
    for f in derived_dir(model_dir, "engine_lib").glob(f"*-{rung}-*.safetensors"):
        f.unlink()


def take(spec: str, model_dir: Path, args) -> dict:
    if spec.startswith("llama.cpp:"):
        import torch

        return run_llamacpp(spec.split(":")[1], model_dir, args.prompts, args.new_tokens, args.repeats,
                            torch.get_num_threads())
    return run_engine_or_hf(spec, model_dir, args.prompts, args.new_tokens, args.repeats, args.timeout)


def run_rounds(order: list[str], model_dir: Path, args, on_update=None) -> dict:
    """Round 0 (first starts), then ``args.rounds`` rounds of later starts, each system once per round."""
    record = {name: {"first_start": None, "rounds": []} for name in order}
    for rnd in range(args.rounds + 1):
        for spec in order if rnd % 2 == 0 else order[::-1]:
            if rnd == 0 and spec in ("engine:int8", "engine:int4"):
                forget_saved(model_dir, spec)
            print(f"[cpu_depth] round {rnd} of {args.rounds}: {spec}", file=sys.stderr, flush=True)
            got = take(spec, model_dir, args) | {"load_average": list(os.getloadavg())}
            if "error" in got:
                print(f"[cpu_depth]   {spec} failed: {got['error']}", file=sys.stderr, flush=True)
            if rnd == 0:
                record[spec]["first_start"] = got
            else:
                record[spec]["rounds"].append(got)
            if on_update:
                on_update(record)
    return record


# ------------------------------------------------------------------------------------------ the record
def best(system: dict, key: str) -> tuple[float, float, float] | None:
    """(best, lowest, highest) of a key over the later starts (best: the highest rate, the lowest time or memory)."""
    vals = [r[key] for r in system["rounds"] if "error" not in r]
    if not vals:
        return None
    top = max(vals) if key == "decode_tok_s" else min(vals)
    return top, min(vals), max(vals)


def pair_ratios(record: dict) -> list[dict]:
    """Each rung against each llama.cpp file of its width: decode x (> 1: the rung is faster), TTFT x (llama.cpp's
    over the rung's), peak RSS x (the rung's over llama.cpp's) and start-up x (the rung's first token from launch
    over llama.cpp's), each from the best readings, with the spread from the worst to the best pairing."""
    out = []
    for rung, types in PAIRS.items():
        r = record.get(f"engine:{rung}")
        for t in types:
            p = record.get(f"llama.cpp:{t}")
            if not r or not p or not best(r, "decode_tok_s") or not best(p, "decode_tok_s"):
                continue
            row = {"rung": rung, "peer": t}
            for key, name, rung_over_peer in (("decode_tok_s", "decode_x", True), ("ttft_ms", "ttft_x", False),
                                              ("peak_rss_bytes", "rss_x", True), ("first_token_s", "start_x", True)):
                (rb, rlo, rhi), (pb, plo, phi) = best(r, key), best(p, key)
                if rung_over_peer:
                    row[name], row[f"{name}_range"] = rb / pb, [rlo / phi, rhi / plo]
                else:
                    row[name], row[f"{name}_range"] = pb / rb, [plo / rhi, phi / rlo]
            out.append(row)
    return out


def targets(ratios: list[dict]) -> list[dict]:
    """Issue 52's goals, decided from this run's best readings: decode >= 1.1x, TTFT no worse, peak RSS at most
    1.25x, and a later start's first token within 1.5x llama.cpp's."""
    words = {"decode_x": ">=", "ttft_x": ">=", "rss_x": "<=", "start_x": "<="}
    out = []
    for v in ratios:
        for key, goal in GOALS.items():
            met = v[key] >= goal if words[key] == ">=" else v[key] <= goal
            out.append({"rung": v["rung"], "peer": v["peer"], "what": key, "value": v[key], "goal": goal,
                        "rule": words[key], "met": met})
    return out


def meta(model_dir: Path, args, order: list[str]) -> dict:
    """Where and how the record was measured."""
    import torch

    from ..model.checkpoints import checkpoint_label
    from ..model.config import Qwen2Config
    from .measure import cpu_model, device_name, git_commit, huge_pages_note

    cfg = Qwen2Config.from_json(model_dir)
    held = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ENGINE_LIB_CPU_ISA", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), "model": model_dir.name,
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "checkpoint": checkpoint_label(model_dir),
            "device_name": device_name("cpu"), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "held_to": held, "huge_pages": huge_pages_note(),
            "torch": torch.__version__, "systems": order, "rounds": args.rounds, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "load_average": {"start": list(os.getloadavg())}}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def system_rows(record: dict) -> list[str]:
    rows = ["| system | first start: load s / peak RSS GiB | load s | first token from launch s | TTFT ms | "
            "decode tok/s | peak RSS GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in record["systems"].items():
        first = s["first_start"] or {}
        cells = [f"{first['load_s']:.1f} / {gib(first['peak_rss_bytes'])}" if "load_s" in first else "failed"]
        for key, fmt in (("load_s", ".1f"), ("first_token_s", ".1f"), ("ttft_ms", ".0f"), ("decode_tok_s", ".1f")):
            b = best(s, key)
            cells.append(f"{b[0]:{fmt}} ({b[1]:{fmt}}-{b[2]:{fmt}})" if b else "n/a")
        b = best(s, "peak_rss_bytes")
        cells.append(f"{gib(b[0])} ({gib(b[1])}-{gib(b[2])})" if b else "n/a")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def huge_page_lines(record: dict) -> list[str]:
    """How much of each engine process sat on 2 MiB pages while its replies were timed, every later start's."""
    out = []
    for name, s in record["systems"].items():
        spans = [r["huge_page_bytes"] for r in s["rounds"] if r.get("huge_page_bytes")]  # later starts
        if spans:
            out.append(f"- {name}: " + ", ".join(f"{gib(a)} -> {gib(b)}" for a, b in spans))
    if not out:
        return []
    return ["", "On 2 MiB pages while the replies were timed (GiB, as they began -> as they ended, each later start):",
            *out]


def markdown(record: dict) -> str:
    m = record["meta"]
    held = ", ".join(f"{k}={v}" for k, v in m["held_to"].items()) or "none"
    lines = [f"# CPU at full depth: {m['model']} ({m['layers']} layers), every system in its own process", "",
             f"- machine: {m['cpu_model']}, {m['device_name']}; {m['threads']} threads; held by: {held}; {m['huge_pages']}",
             f"- weights: {m['checkpoint'] or 'real weights'}", f"- commit {m['commit']}, torch {m['torch']}, "
             f"{m['timestamp']}",
             f"- each start: load, one 8-token reply (its first token from the launch is the start-up), then "
             f"{m['repeats']} greedy repl{'y' if m['repeats'] == 1 else 'ies'} of {m['new_tokens']} new tokens to each "
             f"of the first {m['prompts']} seed "
             "prompts; a round's reading is their median",
             f"- round 0: first starts (the quantized rungs quantize and save); rounds 1-{m['rounds']}: later starts. "
             "Best of those rounds, (lowest-highest) beside it",
             f"- load average (1/5/15 min, {m['cpu_count']} cores): "
             f"{' / '.join(f'{x:.2f}' for x in m['load_average']['start'])} at the start, "
             f"{' / '.join(f'{x:.2f}' for x in m['load_average'].get('end', []))} at the end", ""]
    lines += system_rows(record)
    lines += huge_page_lines(record)
    if record.get("ratios"):
        lines += ["", "## Each rung beside llama.cpp at its width", "",
                  "decode x and TTFT x > 1: the rung is faster; peak RSS x and start-up x: the rung's over "
                  "llama.cpp's. Best against best, (worst-best pairing).", "",
                  "| rung | llama.cpp | decode x | TTFT x | peak RSS x | start-up x |", "|---|---|---:|---:|---:|---:|"]
        for v in record["ratios"]:
            cells = [f"{v[k]:.2f} ({v[k + '_range'][0]:.2f}-{v[k + '_range'][1]:.2f})" for k in GOALS]
            lines.append(f"| {v['rung']} | {v['peer']} | " + " | ".join(cells) + " |")
        met = [t for t in record["targets"] if t["met"]]
        lines += ["", f"Targets met: {len(met)} of {len(record['targets'])} (decode >= {GOALS['decode_x']}x, "
                      f"TTFT x >= {GOALS['ttft_x']}, peak RSS x <= {GOALS['rss_x']}, start-up x <= {GOALS['start_x']})."]
        lines += [f"- not met: {t['rung']} vs {t['peer']}, {t['what']} {t['value']:.2f} (goal {t['rule']} {t['goal']})"
                  for t in record["targets"] if not t["met"]]
    peer = next((s["rounds"][0] for n, s in record["systems"].items() if n.startswith("llama.cpp") and s["rounds"]
                 and "runs_on" in s["rounds"][0]), None)
    if peer:
        lines += ["", f"llama.cpp: {peer['runs_on']}; {peer.get('system_info', '').strip()}"]
    return "\n".join(lines) + "\n"


def finish(record: dict) -> dict:
    record["meta"]["load_average"]["end"] = list(os.getloadavg())
    record["ratios"] = pair_ratios(record["systems"])
    record["targets"] = targets(record["ratios"])
    return record


def stem_for(m: dict) -> str:
    from .run import slug

    return slug(f"{m['device_name']} {m['cpu_model'] or ''} {m['model']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_lib.bench.cpu_depth", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder (make one: python -m engine_lib make-checkpoint "
                   "--preset qwen2.5-1.5b-random)")
    p.add_argument("--rungs", nargs="*", default=list(ENGINE_RUNGS), choices=ENGINE_RUNGS)
    p.add_argument("--hf", nargs="*", default=list(HF_DTYPES), choices=HF_DTYPES, help="transformers dtypes")
    p.add_argument("--peer", choices=["llama.cpp"], default=None, help="also llama.cpp at --gguf widths")
    p.add_argument("--gguf", nargs="*", default=list(GGUF_TYPES), choices=GGUF_TYPES)
    p.add_argument("--rounds", type=int, default=3, help="later starts per system (after the first)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200, help="seconds one system's process may take")
    p.add_argument("--out", default="book/results", help="folder for <stem>.depth.json and .depth.md")
    p.add_argument("--name", default=None, help="file stem (default: from the machine and the model)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.t0, args.prompts, args.new_tokens, args.repeats)))
        return 0
    model_dir = Path(args.model).resolve()
    if args.peer:
        from .llamacpp import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"[cpu_depth] llama.cpp is skipped: {reason}", file=sys.stderr)
            args.peer = None
    order = systems(args.rungs, args.hf, args.gguf if args.peer else [])
    record = {"meta": meta(model_dir, args, order)}
    stem = args.name or stem_for(record["meta"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(systems_so_far: dict) -> None:  # after every process: a run cut short still leaves its record
        record["systems"] = systems_so_far
        (out / f"{stem}.depth.json").write_text(json.dumps(record, indent=2))

    run_rounds(order, model_dir, args, save)
    finish(record)
    (out / f"{stem}.depth.json").write_text(json.dumps(record, indent=2))
    (out / f"{stem}.depth.md").write_text(markdown(record))
    print(markdown(record))
    print(f"[cpu_depth] wrote {out / stem}.depth.json and .depth.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
