"""A bounded load test of an OpenAI-compatible server, on loopback: TTFT, inter-token latency and
throughput at several concurrencies, against the same requests sent one by one.

Defined in chapter 12 (serving many users). ``python -m engine_lib.bench.loadtest --model M``
starts this package's server on 127.0.0.1 in a child process (``server_process``: a client in the
server's own interpreter would take its GIL; ``--in-process`` keeps it in one, for the prefix-cache
part); ``--base-url`` points the same client at any OpenAI-compatible server instead
(vLLM, SGLang), unchanged. Before each level, a few short requests at that level's concurrency warm
the server up (compiles, graph captures), outside the timing. Every concurrency level
sends the same greedy requests through the ``openai`` client (over an ``httpx`` connection
pool), streaming. Concurrency 1 runs first: its outputs are the solo outputs every other
level is compared with token for token (nothing lost, nothing mixed between requests). A
batch-invariant server must reproduce them; without batch invariance a row's sums depend on the
rows beside it, so a greedy reply may turn at a near tie, and the record counts such replies.
The run stops by itself: a request count, a per-request timeout and an overall time limit.
Then ``prefix_ttft`` times a request sharing a long system prompt cold and warm (prefix caching);
``--prefix-cache-only`` runs just that part and merges it into an existing record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..loop.config import SchedulerConfig
from ..serve.server import DEFAULT_KV_CACHE_GIB, DEFAULTS
from .client import run_async, scrape, served_model
from .gemm_scaling import gemm_lines, gemm_scaling
from .measure import git_commit, host_words
from .prefix_ttft import markdown as prefix_markdown
from .prefix_ttft import prefix_part

WORDS = ("the a server batch token cache block user request queue model answer question river mountain "
         "light engine fast slow memory page table stream reply write read learn teach story poem").split()


def make_prompts(n: int, seed: int = 0, shortest: int = 4, longest: int = 24) -> list[str]:
    """``n`` user messages of ragged length, the same for a given seed."""
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(shortest, longest))) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


async def _one(client, model: str, prompt: str, max_tokens: int, timeout: float, ignore_eos: bool = False) -> dict:
    start = time.perf_counter()
    stamps, pieces, usage, error, finish = [], [], None, None, None

    async def consume():
        nonlocal usage, finish
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None)  # every reply max_tokens long
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta.content
                if delta:
                    stamps.append(time.perf_counter())
                    pieces.append(delta)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        error = f"timed out after {timeout:.0f} s"
    except Exception as exc:  # recorded, never lost: a clear error per request
        error = f"{type(exc).__name__}: {exc}"[:300]
    return {"text": "".join(pieces), "error": error, "finish_reason": finish,
            "ttft_s": stamps[0] - start if stamps else None,
            "itl_s": [b - a for a, b in zip(stamps, stamps[1:])], "end_s": time.perf_counter() - start,
            "decode_s": stamps[-1] - stamps[0] if len(stamps) > 1 else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "prompt_tokens": usage.prompt_tokens if usage else None}


async def run_level(base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                    api_key: str = "none", timeout: float = 300.0, ignore_eos: bool = False) -> dict:
    """Send every prompt, at most ``concurrency`` in flight; -> per-request results and a summary."""
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as http:
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, http_client=http, max_retries=0)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(prompt):
            async with gate:
                return await _one(client, model, prompt, max_tokens, timeout, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "wall_s": wall, "results": results, **summarize(results, wall)}


def round_ratios(runs: list[tuple[int, dict]], concurrency: int) -> list[float]:
    """Per round that ran both: this level's throughput over concurrency 1's."""
    by_round: dict[int, dict[int, float]] = {}
    for r, level in runs:
        by_round.setdefault(r, {})[level["concurrency"]] = level["throughput_tok_s"]
    return [tok[concurrency] / tok[1] for tok in by_round.values() if concurrency in tok and 1 in tok]


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [g for r in ok for g in r["itl_s"]]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    # one request's decode rate: the tokens after its first, over the time from its first text to its last
    rates = [(r["completion_tokens"] - 1) / r["decode_s"] for r in ok
             if r.get("decode_s") and (r["completion_tokens"] or 0) > 1]
    return {"decode_tok_s_p50": percentile(rates, 50),
            "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "error_messages": sorted({r["error"] for r in results if r["error"]})[:5],
            "completion_tokens": tokens, "throughput_tok_s": tokens / wall if wall > 0 else math.nan,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def warm_up(base_url: str, model: str, prompts: list[str], concurrency: int, api_key: str = "none",
            timeout: float = 600.0) -> None:
    """Short requests at this concurrency, untimed: the batch sizes the level will use compile (and, on
    a GPU, capture) here, not inside its first requests. Their blocks are freed before the level."""
    run_async(run_level(base_url, model, prompts[:concurrency], 4, concurrency, api_key, timeout))


def run_load(base_url: str, prompts: list[str], max_tokens: int, levels: list[int], api_key: str = "none",
             time_limit: float = 600.0, timeout: float = 300.0, model: str | None = None, log=print,
             warm: bool = True, rounds: int = 1) -> dict:
    """Every level in turn (concurrency 1 first), each after a warm-up, ``rounds`` times over: -> {"levels":
    [...], "checks": {...}}. A level's figures are its first round's; with several rounds, its speed-up over one by
    one is the median of each round's own ratio (levels run minutes apart on a host whose memory speed drifts;
    a round's levels run side by side)."""
    model = model or served_model(base_url, api_key)
    levels = sorted(set(levels))
    deadline = time.monotonic() + time_limit
    out, solo, runs = {}, None, []
    for rnd in range(rounds):
        for c in levels:
            left = deadline - time.monotonic()
            if left <= 0:
                log(f"concurrency {c}: skipped, the time limit ({time_limit:.0f} s) is spent")
                out.setdefault(c, {"concurrency": c, "skipped": True})
                continue
            if warm:
                warm_up(base_url, model, prompts, c, api_key, min(timeout, left))
            level = run_async(run_level(base_url, model, prompts, max_tokens, c, api_key, min(timeout, left)))
            after = scrape(base_url, api_key)
            level["kv_blocks_free_after"] = after.get("engine_kv_blocks_free")
            level["kv_blocks_total"] = after.get("engine_kv_blocks_total")
            level["preemptions_total"] = after.get("engine_preemptions_total")
            texts = [r["text"] if r["error"] is None else None for r in level.pop("results")]
            if c == 1 and solo is None:
                solo = texts
            level["mismatches"] = (sum(1 for a, b in zip(solo, texts) if a is not None and b is not None and a != b)
                                   if solo is not None else None)
            level["compared"] = (sum(1 for a, b in zip(solo, texts) if a is not None and b is not None)
                                 if solo is not None else 0)
            runs.append((rnd, level))
            out.setdefault(c, level)
            log(f"{f'round {rnd + 1}, ' if rounds > 1 else ''}concurrency {c:>3}: {level['completed']}/"
                f"{level['requests']} completed, {level['throughput_tok_s']:.1f} tok/s, TTFT p50 "
                f"{level['ttft_p50_s'] * 1e3:.0f} ms p99 {level['ttft_p99_s'] * 1e3:.0f} ms, ITL p50 "
                f"{level['itl_p50_s'] * 1e3:.0f} ms p99 {level['itl_p99_s'] * 1e3:.0f} ms, mismatches vs solo: "
                f"{level['mismatches']}")
    out = list(out.values())
    for lv in out:
        if lv.get("skipped"):
            continue
        lv["round_tok_s"] = [run["throughput_tok_s"] for _, run in runs if run["concurrency"] == lv["concurrency"]]
        ratios = round_ratios(runs, lv["concurrency"])
        if ratios:
            lv["speedup_vs_sequential"] = statistics.median(ratios)
            lv["round_speedups"] = ratios
    done = [run for _, run in runs]
    checks = {"nothing_lost": all(lv["completed"] + lv["errors"] == lv["requests"] == len(prompts) for lv in done),
              "all_completed": all(lv["errors"] == 0 for lv in done),
              "nothing_mixed": all(lv["mismatches"] == 0 for lv in done if lv["mismatches"] is not None),
              "blocks_all_free_after_each_level": all(lv["kv_blocks_free_after"] == lv["kv_blocks_total"]
                                                      for lv in done if lv["kv_blocks_total"] is not None)}
    return {"model": model, "levels": out, "checks": checks}


# ---------------------------------------------------------------------------------- the record
def markdown(record: dict) -> str:
    m = record["meta"]
    lines = [f"# Serving load test: {m['model']} on {m['device_name']}", "",
             f"{m['requests']} greedy streaming chat requests ({m['prompt_tokens_min']}-{m['prompt_tokens_max']} "
             f"prompt tokens, max_tokens {m['max_tokens']}) at each concurrency, through the `openai` client on "
             f"loopback; stage `{m['stage']}` ({m['dtype']}), batch-invariant: {m['batch_invariant']}, "
             + (f"decode steps per host read: {m['decode_steps']}, " if "decode_steps" in m else "") +
             f"KV cache {m['kv_cache_gib']} GiB. Measured {m['timestamp']} at commit {m['git_commit']}, "
             f"torch {m['torch']}." + (f" CPU: {host_words(m)}." if host_words(m) else ""), "",
             "| concurrency | completed | errors | tok/s | vs one by one | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
             "| outputs differing from solo |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in record["levels"]:
        if lv.get("skipped"):
            lines.append(f"| {lv['concurrency']} | skipped (time limit) | | | | | | | | |")
            continue
        ms = lambda s: "n/a" if s is None or math.isnan(s) else f"{s * 1e3:.0f} ms"
        lines.append(f"| {lv['concurrency']} | {lv['completed']}/{lv['requests']} | {lv['errors']} | "
                     f"{lv['throughput_tok_s']:.1f} | {lv.get('speedup_vs_sequential', math.nan):.2f}x | "
                     f"{ms(lv['ttft_p50_s'])} | {ms(lv['ttft_p99_s'])} | {ms(lv['itl_p50_s'])} | "
                     f"{ms(lv['itl_p99_s'])} | {lv['mismatches']} of {lv['compared']} |")
    several = [lv for lv in record["levels"] if len(lv.get("round_speedups", [])) > 1]
    if several:
        lines += ["", f"Rounds: every level ran {len(several[0]['round_speedups'])} times, in turn (concurrency 1, then "
                      "the others, then again), and a level's speed-up above is the median of its rounds' own ratios: "
                      + "; ".join(f"concurrency {lv['concurrency']} " + ", ".join(f"{x:.2f}x" for x in lv["round_speedups"])
                                  + " (tok/s " + ", ".join(f"{x:.1f}" for x in lv["round_tok_s"]) + ")"
                                  for lv in several)
                      + "; one by one " + ", ".join(f"{x:.1f}" for x in record["levels"][0]["round_tok_s"])
                      + " tok/s. The other columns are the first round's."]
    lines += ["", "Checks: " + ", ".join(check_text(record, k, v) for k, v in record["checks"].items()) + "."]
    for t in record.get("targets") or ([record["target"]] if record.get("target") else []):  # older records: one
        lines += ["", f"Target: {t['name']}: measured {t['value']:.2f}x, goal {t['goal']}, "
                      f"{'met' if t['met'] else 'NOT met'}."]
    if record.get("engine_reference"):
        e = record["engine_reference"]
        lines += ["", f"For reference, `Engine.generate` alone (no server) on {e['prompts']} of these prompts: "
                      f"{e['tok_s']:.1f} tok/s end to end, decode {e.get('decode_tok_s_p50', math.nan):.1f} tok/s "
                      f"(median); the server one by one: {record['levels'][0]['throughput_tok_s']:.1f} tok/s end "
                      f"to end, decode {record['levels'][0].get('decode_tok_s_p50', math.nan):.1f} tok/s (median "
                      "per request)."]
    if record.get("batch_reference"):
        b = record["batch_reference"]
        lines += ["", f"What batching alone gives the engine here: the first {b['rows']} of these prompts through one "
                      f"`Engine.generate_batch` (no server, all at once) vs `Engine.generate` one by one: "
                      f"{b['speedup_p50']:.2f}x (median of {b['rounds']} interleaved rounds, "
                      f"{b['speedup_min']:.2f}-{b['speedup_max']:.2f}x)."]
    if record.get("ops"):
        o = record["ops"]
        lines += ["", f"Operators the host dispatches per decode step (top-level aten ops on the CPU, the proxy for "
                      f"GPU kernel launches), stage `{o['stage']}`, {o['layers']} layers: `Engine.generate` "
                      f"{o['generate_per_token']:.1f} per token ({o['generate_per_layer']:.1f} per layer); the "
                      f"server's runner {o['served_per_step']} per step of {o['rows']} rows "
                      f"({o['served_per_layer']:.1f} per layer)."]
    if record.get("gemm_scaling"):
        lines += [""] + gemm_lines(record["gemm_scaling"])
    lines += ["", m["note"], ""]
    if record.get("prefix_cache"):
        lines += prefix_markdown(record["prefix_cache"])[1:] + [""]
    return "\n".join(lines)


def check_text(record: dict, key: str, value: bool) -> str:
    """One check as the record says it. Replies that differ from their solo run are named as what they are:
    expected of a server without batch invariance (its rows' sums depend on the batch), a fault of one with it."""
    if key != "nothing_mixed":
        return f"{key.replace('_', ' ')}: {'yes' if value else 'NO'}"
    if value:
        return "every reply equal to its solo run: yes"
    differ = ", ".join(f"{lv['mismatches']} of {lv['compared']} at concurrency {lv['concurrency']}"
                       for lv in record["levels"] if lv.get("mismatches"))
    if record["meta"].get("batch_invariant") is False:
        return (f"every reply equal to its solo run: no ({differ}; this server is not batch-invariant, so a "
                "row's sums depend on the rows beside it and a greedy reply may turn at a near tie; a "
                "batch-invariant server must match)")
    return f"every reply equal to its solo run: NO ({differ})"


def write_record(record: dict, out: str | Path, name: str) -> tuple[Path, Path]:
    """``<out>/<name>.serve.json`` and ``.serve.md`` (the ``.serve`` suffix keeps them out of the
    benchmark records chapter 08 reads)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = name if name.endswith(".serve") else f"{name}.serve"
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(record, indent=1, default=float) + "\n")
    md.write_text(markdown(record))
    return js, md


def engine_reference(engine, prompts: list[str], max_tokens: int) -> dict:
    """``Engine.generate`` one prompt at a time, no server: the sequential baseline without HTTP."""
    engine.generate(prompts[0], max_new_tokens=4, do_sample=False, stop_token_ids=[])  # compile, warm up
    start, tokens, rates = time.perf_counter(), 0, []
    for p in prompts:
        out = engine.generate(p, max_new_tokens=max_tokens, do_sample=False, stop_token_ids=[])
        tokens += len(out.token_ids)
        rates.append(out.decode_tokens_per_s)
    return {"prompts": len(prompts), "tok_s": tokens / (time.perf_counter() - start),
            "decode_tok_s_p50": percentile(rates, 50)}


def batch_reference(engine, prompts: list[str], max_tokens: int, rounds: int = 2) -> dict:
    """The same prompts through ``Engine.generate`` one by one and through one ``Engine.generate_batch``, no
    server, ``rounds`` times interleaved: what batching alone gives this engine for these requests when they
    all arrive at once (no HTTP, no client, no staggered arrivals), the ceiling the concurrency level of the
    same size is read against."""
    opts = dict(max_new_tokens=max_tokens, do_sample=False, stop_token_ids=[])
    engine.generate_batch(prompts, **opts)  # compile the batched step, warm up
    one_by_one, batched = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for p in prompts:
            engine.generate(p, **opts)
        one_by_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.generate_batch(prompts, **opts)
        batched.append(time.perf_counter() - start)
    return {"rows": len(prompts), "rounds": rounds, "one_by_one_s": one_by_one, "batch_s": batched,
            **batch_speedups(one_by_one, batched)}


def batch_speedups(one_by_one: list[float], batched: list[float]) -> dict:
    """Each round's one-by-one time over its batch time: their median (the mean of the middle two for an even
    count) and range."""
    ratios = [a / b for a, b in zip(one_by_one, batched)]
    return {"speedup_p50": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios)}


def targets(record: dict) -> list[dict]:
    """The serving targets (issue 25): concurrency 16 against one by one, and the server's decode rate
    at concurrency 1 against ``Engine.generate``'s on the same rung and model."""
    levels = {lv["concurrency"]: lv for lv in record["levels"] if not lv.get("skipped")}
    out = []
    if 16 in levels and "speedup_vs_sequential" in levels[16]:
        value = levels[16]["speedup_vs_sequential"]
        out.append({"name": "total throughput at concurrency 16 vs the same requests one by one",
                    "value": value, "goal": ">= 7x", "met": value >= 7})
    ref = record.get("engine_reference")
    if 1 in levels and ref:
        value = levels[1]["decode_tok_s_p50"] / ref["decode_tok_s_p50"]
        out.append({"name": "the server's decode tok/s at concurrency 1 vs Engine.generate's (medians)",
                    "value": value, "goal": ">= 0.9x", "met": value >= 0.9})
    return out


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine_lib.bench.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint to serve in-process (omit with --base-url)")
    p.add_argument("--base-url", default=None, help="an already running OpenAI-compatible server, e.g. "
                   "http://127.0.0.1:8000 (vLLM, SGLang or python -m engine_lib serve)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--rounds", type=int, default=1, help="run every level this many times, in turn; a level's "
                   "speed-up is the median of its rounds' ratios to concurrency 1")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run; later levels "
                   "are skipped once it is spent")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--stage", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=DEFAULTS.prefill_chunk)
    p.add_argument("--batch-invariant", action="store_true", help="serve in batch-invariant mode")
    p.add_argument("--decode-steps", type=int, default=None, help="the server's --decode-steps (default: its own, "
                   "8 on a GPU and 1 on a CPU)")
    p.add_argument("--in-process", action="store_true", help="run the server in this process (a thread), not in a "
                   "child process: the client then shares its GIL (needed for --prefix-system-tokens)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="the cold/warm part without prefix caching (in-process only; the concurrency levels "
                   "always run without it)")
    p.add_argument("--prefix-system-tokens", type=int, default=1000, help="system prompt length for the "
                   "cold/warm TTFT part (0: skip it)")
    p.add_argument("--prefix-repeats", type=int, default=3, help="cold/warm pairs; medians are reported")
    p.add_argument("--prefix-cache-only", action="store_true", help="skip the concurrency levels: measure the "
                   "cold/warm TTFT only and merge it into the record at --out/--name, if there is one")
    p.add_argument("--prefix-note", default="", help="a sentence about the conditions of the prefix-cache part")
    p.add_argument("--engine-reference", type=int, default=0, help="also time Engine.generate alone on this many "
                   "of the prompts (in-process only)")
    p.add_argument("--batch-reference", type=int, default=0, help="also time this many of the prompts through one "
                   "Engine.generate_batch against one by one, no server (what batching alone gives)")
    p.add_argument("--ops", action="store_true", help="also count the operators the host dispatches per decode "
                   "step, for Engine.generate and the server's runner (in-process only)")
    p.add_argument("--out", default=None, help="folder for <name>.serve.json and .md (e.g. book/results)")
    p.add_argument("--name", default=None, help="record name (default: device and model)")
    p.add_argument("--note", default="", help="a sentence about the conditions, appended to the record's note")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if (args.model is None) == (args.base_url is None):
        p.error("give exactly one of --model (serve it here) and --base-url (an external server)")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.prefix_cache_only and args.prefix_system_tokens <= 0:
        p.error("--prefix-cache-only needs --prefix-system-tokens > 0")

    prompts = make_prompts(args.requests, args.seed)
    started = time.perf_counter()
    if args.model and not args.in_process and not args.prefix_cache_only:
        return main_child_process(args, prompts, started)
    server, engine, base_url, meta = open_server(args, prompts)
    name = args.name or f"{meta['device_name']}-{meta['model']}".lower().replace(" ", "-")
    if args.prefix_cache_only:
        part = prefix_part(args, engine, meta, None if args.model else base_url, log)
        print("\n".join(prefix_markdown(part)))
        return merge_prefix_part(part, args.out, name) if args.out else 0
    try:
        record = run_load(base_url, prompts, args.max_tokens, args.concurrency, args.api_key, args.time_limit,
                          args.timeout, log=log, rounds=args.rounds)
        if engine is not None and args.engine_reference:
            record["engine_reference"] = engine_reference(engine, prompts[:args.engine_reference], args.max_tokens)
        if engine is not None and args.batch_reference:
            record["batch_reference"] = batch_reference(engine, prompts[:args.batch_reference], args.max_tokens)
    finally:
        if server is not None:
            server.stop()
    record["targets"] = targets(record)
    if engine is not None and args.ops:
        from .loop_ops import loop_ops

        record["ops"] = loop_ops(engine)
    if args.prefix_system_tokens > 0:
        record["prefix_cache"] = prefix_part(args, engine, meta, None if args.model else base_url, log)
    if server is not None:
        meta["server"] = "in process"
    return finish_record(args, meta, record, started)


def open_server(args, prompts: list[str]) -> tuple:
    """The server this process measures: one it starts in a thread (``--model``; with ``--prefix-cache-only``
    only the engine), or an external one (``--base-url``). -> (server or None, engine or None, its URL, meta)."""
    if not args.model:
        base_url = args.base_url.rstrip("/").removesuffix("/v1")
        meta = {"model": served_model(base_url, args.api_key), "device_name": "external server", "stage": "external",
                "dtype": "external", "device": "external", "torch": "external", "kv_cache_gib": "external",
                "batch_invariant": "external", "prompt_tokens_min": "?", "prompt_tokens_max": "?"}
        return None, None, base_url, meta
    from ..engine import Engine
    from ..serve.server import BackgroundServer, ServerOptions, build_state

    opts = ServerOptions(model=args.model, stage=args.stage, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                         max_batch=max(args.concurrency), max_queue=max(DEFAULTS.max_queue, args.requests),
                         prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                         # every level sends the same prompts again: cached prefixes would speed up later
                         # levels (a false batching gain) and change their numbers against the solo run
                         batch_invariant=args.batch_invariant, prefix_caching=False,
                         decode_steps=args.decode_steps, served_model_name=Path(args.model).name)
    server = base_url = None
    if args.prefix_cache_only:
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, stage=args.stage)
    else:
        state, engine = build_state(opts)
        server = BackgroundServer(state)
        base_url = server.url
    meta = engine_meta(engine, args, prompts)
    print(f"serving {engine.label}" + (f" at {base_url}" if server else ""), file=sys.stderr)
    return server, engine, base_url, meta


def serve_args(args) -> list[str]:
    """The ``python -m engine_lib serve`` options of this load test's server."""
    out = ["--model", args.model, "--kv-cache-gib", str(args.kv_cache_gib), "--max-batch", str(max(args.concurrency)),
           "--max-queue", str(max(DEFAULTS.max_queue, args.requests)), "--prefill-chunk", str(args.prefill_chunk),
           "--max-model-len", str(args.max_model_len), "--no-prefix-caching",
           "--served-model-name", Path(args.model).name]
    out += ["--stage", args.stage] if args.stage else []
    out += ["--dtype", args.dtype] if args.dtype else []
    out += ["--decode-steps", str(args.decode_steps)] if args.decode_steps else []
    return out + (["--batch-invariant"] if args.batch_invariant else [])


def main_child_process(args, prompts: list[str], started: float) -> int:
    """The load against ``python -m engine_lib serve`` in a child process; then, with the server gone,
    the engine in this process for the record's labels and the ``Engine.generate`` reference."""
    from ..engine import Engine
    from .server_process import ServerProcess

    if args.prefix_system_tokens > 0:
        log("note: the prefix-cache part (--prefix-system-tokens) needs --in-process; skipped here")
    with ServerProcess(serve_args(args)) as base_url:
        log(f"server (child process) at {base_url}")
        record = run_load(base_url, prompts, args.max_tokens, args.concurrency, args.api_key, args.time_limit,
                          args.timeout, log=log, rounds=args.rounds)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, stage=args.stage)
    if args.engine_reference:
        record["engine_reference"] = engine_reference(engine, prompts[:args.engine_reference], args.max_tokens)
    if args.batch_reference:
        record["batch_reference"] = batch_reference(engine, prompts[:args.batch_reference], args.max_tokens)
    record["targets"] = targets(record)
    if args.ops:
        from .loop_ops import loop_ops

        record["ops"] = loop_ops(engine)
    if engine.device.type == "cpu":  # why a CPU batch scales (or not) with its dtype
        record["gemm_scaling"] = gemm_scaling(engine.config)
    meta = {**engine_meta(engine, args, prompts), "server": "child process"}
    return finish_record(args, meta, record, started)


def engine_meta(engine, args, prompts: list[str]) -> dict:
    """The record's labels for a server of this package: model, rung, dtype, device, cache and prompts."""
    import torch

    from .measure import device_name, host_meta

    ids = [len(engine.encode(q)) for q in prompts]
    return {"model": engine.model_dir.name, "real_weights": not engine.is_random, "stage": engine.stage.name,
            "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
            "device_name": device_name(engine.device), "torch": torch.__version__,
            "kv_cache_gib": args.kv_cache_gib, "batch_invariant": args.batch_invariant, "prefix_caching": False,
            "max_model_len": args.max_model_len, "prefill_chunk": args.prefill_chunk,
            "decode_steps": SchedulerConfig(decode_steps=args.decode_steps).steps_for(engine.device),
            "max_batch": max(args.concurrency), "prompt_tokens_min": min(ids), "prompt_tokens_max": max(ids),
            "prompt_tokens_mean": sum(ids) / len(ids), **host_meta(engine.device)}


def finish_record(args, meta: dict, record: dict, started: float) -> int:
    """Label the record, print it, write it with ``--out``; exit status 1 if a reply was lost, or differs from its
    solo run where it must not (``check_text``)."""
    name = args.name or f"{meta['device_name']}-{meta['model']}".lower().replace(" ", "-")
    meta.update({"requests": args.requests, "max_tokens": args.max_tokens, "seed": args.seed, "rounds": args.rounds,
                 "concurrency": sorted(set(args.concurrency)), "time_limit_s": args.time_limit,
                 "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "git_commit": git_commit(),
                 "python": platform.python_version(), "run_s": time.perf_counter() - started,
                 "note": (f"Bounded run: {args.requests} requests per level, max_tokens {args.max_tokens}, "
                          f"{args.time_limit:.0f} s overall limit, {args.timeout:.0f} s per request, chosen so the "
                          f"whole run stays within about ten minutes on this machine. Greedy (temperature 0); "
                          f"concurrency 1 gives the solo outputs every other level is compared with; each level "
                          f"after an untimed warm-up at its concurrency. Loopback only."
                          + (f" {args.note}" if args.note else ""))})
    record = {"meta": meta, **record}
    print(markdown(record))
    if args.out:
        js, md = write_record(record, args.out, name)
        print(f"wrote {js} and {md}", file=sys.stderr)
    # replies that differ from solo fail a batch-invariant server (or an external one), not one without invariance
    ok = record["checks"]["nothing_lost"] and (record["checks"]["nothing_mixed"] or meta.get("batch_invariant") is False)
    return 0 if ok else 1


def merge_prefix_part(part: dict, out: str | Path, name: str) -> int:
    """Put a prefix-cache part into the existing record ``<out>/<name>.serve.json`` (its other keys kept)."""
    stem = name if name.endswith(".serve") else f"{name}.serve"
    path = Path(out) / f"{stem}.json"
    if not path.is_file():
        print(f"no record at {path} to merge the prefix-cache part into; nothing written", file=sys.stderr)
        return 1
    record = json.loads(path.read_text())
    record["prefix_cache"] = part
    js, md = write_record(record, out, name)
    print(f"wrote the prefix-cache part into {js} and {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
