"""Time to first token with a shared system prompt: cold (never seen) against warm (cached).

Defined in chapter 13 (an API for agents and evaluators), for the serving record written by
``engine_lib.bench.loadtest``. Each repeat makes a new system prompt of ``system_tokens``
tokens (new words, so no block of it is cached), sends one chat request with it (cold: the
whole prompt is prefilled), then a second request with the same system prompt and another
question (warm: with prefix caching, only the blocks after the system prompt are computed).
Both stream through the ``openai`` client; TTFT is the time to the first chunk that carries
text or a finish reason. The medians of the repeats are reported, one request at a time.
``python -m engine_lib.bench.loadtest --prefix-cache-only ...`` runs only this part.
"""

from __future__ import annotations

import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from .client import metric, run_async, scrape, served_model

WORDS = ("policy answer briefly cite sources never reveal secrets format markdown tables user account billing "
         "refund shipping order support escalate polite concise language english french summary context").split()


def system_prompt(tokenizer, tokens: int, seed: int) -> str:
    """A system prompt of about ``tokens`` tokens (random words, different for each seed)."""
    rng = random.Random(seed)
    text = f"You are support assistant number {seed}. Rules: "
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += " ".join(rng.choices(WORDS, k=64)) + ". "
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


async def _ttft(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, int | None]:
    """-> (seconds to the first chunk with text or a finish reason, prompt tokens from usage)."""
    start, first, prompt_tokens = time.perf_counter(), None, None
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            first = time.perf_counter() - start
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, prompt_tokens


async def _measure(base_url: str, model: str, tokenizer, system_tokens: int, repeats: int, max_tokens: int,
                   api_key: str, log) -> dict:
    import httpx
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, http_client=http, max_retries=0)

        def chat(system: str, question: str) -> list[dict]:
            return [{"role": "system", "content": system}, {"role": "user", "content": question}]

        # warm-up: first-call costs (allocations, lazy init) must not land on the first cold request
        await _ttft(client, model, chat(system_prompt(tokenizer, system_tokens, seed=-1), "Hello?"), max_tokens)
        cold, warm, prompts = [], [], []
        for r in range(repeats):
            system = system_prompt(tokenizer, system_tokens, seed=1000 + r)
            c, pc = await _ttft(client, model, chat(system, f"Where is my order {r}?"), max_tokens)
            w, pw = await _ttft(client, model, chat(system, f"How do I get a refund for item {r}?"), max_tokens)
            cold.append(c)
            warm.append(w)
            prompts.append((pc, pw))
            log(f"prefix cache repeat {r + 1}/{repeats}: cold TTFT {c * 1e3:.0f} ms ({pc} prompt tokens), "
                f"warm {w * 1e3:.0f} ms ({pw} prompt tokens)")
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "prompt_tokens": prompts}


def measure_prefix_ttft(base_url: str, tokenizer, system_tokens: int = 1000, repeats: int = 3, max_tokens: int = 8,
                        model: str | None = None, api_key: str = "none", log=print) -> dict:
    """Cold and warm TTFT medians for requests sharing a ``system_tokens``-token system prompt, plus the
    server's prefix-cache counters over the run (``None`` where it exports none)."""
    model = model or served_model(base_url, api_key)
    before = scrape(base_url, api_key)
    raw = run_async(_measure(base_url, model, tokenizer, system_tokens, repeats, max_tokens, api_key, log))
    after = scrape(base_url, api_key)
    delta = {k: metric(after, k) - (metric(before, k) or 0) for k in ("engine_prefix_cache_hits_total",
                                                                        "engine_prefix_cache_queries_total")
             if metric(after, k) is not None}
    cold, warm = statistics.median(raw["cold_ttft_s"]), statistics.median(raw["warm_ttft_s"])
    return {"system_prompt_tokens": system_tokens, "repeats": repeats, "max_tokens": max_tokens,
            "prompt_tokens_cold_warm": raw["prompt_tokens"], "cold_ttft_p50_s": cold, "warm_ttft_p50_s": warm,
            "speedup": cold / warm, "cold_ttft_s": raw["cold_ttft_s"], "warm_ttft_s": raw["warm_ttft_s"],
            "hit_tokens": delta.get("engine_prefix_cache_hits_total"),
            "query_tokens": delta.get("engine_prefix_cache_queries_total"),
            "target": {"name": "TTFT with the system prompt cached vs not", "value": cold / warm, "goal": ">= 3x",
                       "met": cold / warm >= 3}}


def prefix_part(args, engine, meta: dict, base_url: str | None, log) -> dict:
    """The prefix-cache TTFT measurement: on ``base_url``, or on a second in-process server with the
    same engine and a context long enough for the system prompt (the load levels keep theirs)."""
    from ..model.tokenizer import load_tokenizer
    from ..serve.server import BackgroundServer, ServerOptions, build_state
    from .measure import git_commit

    server, context = None, meta.get("max_model_len", "external")
    if base_url is None:
        context = max(args.max_model_len, args.prefix_system_tokens + 256)
        opts = ServerOptions(model=args.model, stage=args.stage, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                             prefill_chunk=args.prefill_chunk, max_model_len=context,
                             batch_invariant=args.batch_invariant, prefix_caching=args.prefix_caching,
                             served_model_name=Path(args.model).name)
        server = BackgroundServer(build_state(opts, engine)[0])
        base_url = server.url
    try:
        tokenizer = engine.tokenizer if engine is not None else load_tokenizer()
        out = measure_prefix_ttft(base_url, tokenizer, args.prefix_system_tokens, args.prefix_repeats,
                                  api_key=args.api_key, log=log)
    finally:
        if server is not None:
            server.stop()
    caching = args.prefix_caching if engine is not None else "external"
    return {**out, **{k: meta.get(k) for k in ("model", "device_name", "stage", "dtype", "torch")},
            "prefix_caching": caching, "max_model_len": context, "git_commit": git_commit(),
            "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "note": args.prefix_note}


def markdown(p: dict) -> list[str]:
    """The record's prefix-cache lines (``loadtest.markdown`` appends them)."""
    hits = "" if p.get("hit_tokens") is None else (
        f" The server found {p['hit_tokens']:.0f} of {p['query_tokens']:.0f} looked-up prompt tokens in its "
        f"prefix cache during this part (warm-up included).")
    caching = {True: "on", False: "off"}.get(p["prefix_caching"], p["prefix_caching"])
    return ["", f"## Prefix caching: a shared {p['system_prompt_tokens']}-token system prompt", "",
            f"Time to first token of a chat request whose system prompt was never seen (cold) and of a second "
            f"request with the same system prompt and another question (warm), one request at a time, medians of "
            f"{p['repeats']} repeats (a new system prompt each), on {p['device_name']}, {p['model']}, stage "
            f"`{p['stage']}` ({p['dtype']}), prefix caching {caching}, context "
            f"{p['max_model_len']}. Measured {p['timestamp']} at commit {p['git_commit']}.", "",
            "| prompt tokens (cold / warm) | cold TTFT p50 | warm TTFT p50 | cold / warm |", "|---|---:|---:|---:|",
            f"| {p['prompt_tokens_cold_warm'][0][0]} / {p['prompt_tokens_cold_warm'][0][1]} | "
            f"{p['cold_ttft_p50_s'] * 1e3:.0f} ms | {p['warm_ttft_p50_s'] * 1e3:.0f} ms | {p['speedup']:.1f}x |", "",
            f"Target: warm TTFT at least 3x faster than cold: measured {p['speedup']:.1f}x, "
            f"{'met' if p['target']['met'] else 'NOT met'}.{hits}" + (f" {p['note']}" if p.get("note") else "")]

