"""How many sequences a server holds at once in the same KV-cache memory: the model-dtype cache beside int8.

Defined in chapter 12 (serving many users), for chapter 05's int8 cache. A bounded load test on
127.0.0.1: one server per cache dtype on the same engine, the same ``--kv-cache-gib``, prefix caching off (every
prompt is different anyway), and ``requests`` streamed requests sent at once, each a prompt of about
``prompt_words`` words and ``max_tokens`` new tokens (``ignore_eos``: every reply is that long). The scheduler
admits a request when its prompt's blocks fit, so the number running at once is what the cache holds; a thread
reads ``/metrics`` every few milliseconds and keeps the largest ``requests_running`` seen. Every request has a
timeout, and the test stops when the last reply is in.
"""

from __future__ import annotations

import random
import threading
import time

WORDS = ("river", "stone", "lamp", "cloud", "paper", "engine", "garden", "window", "signal", "harbor", "pencil",
         "orbit", "candle", "ladder", "meadow", "copper", "violin", "glacier", "thunder", "compass")


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` different prompts of ``words`` random words each (no shared prefix beyond the chat template)."""
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choices(WORDS, k=words)) for i in range(n)]


def peak_running(engine, kv_cache_dtype: str, gib: float, texts: list[str], max_tokens: int,
                 timeout: float = 300.0) -> dict:
    """One server on ``engine`` with a ``gib`` GiB cache of ``kv_cache_dtype``; every prompt sent at once ->
    the most requests running at once, the cache's capacity, and how the requests went."""
    from ..cache.quantized import bytes_per_token
    from ..serve.server import BackgroundServer, ServerOptions, build_state
    from .client import metric, run_async, scrape
    from .loadtest import run_level

    opts = ServerOptions(model="unused", served_model_name="capacity", kv_cache_gib=gib,
                         kv_cache_dtype=kv_cache_dtype, prefix_caching=False, max_batch=len(texts),
                         max_queue=len(texts))
    state, _ = build_state(opts, engine=engine)
    cache = state.loop.cache
    peak, done = [0.0], threading.Event()

    def watch() -> None:  # the most requests the scheduler holds at once, as /metrics reports it
        while not done.is_set():
            running = metric(scrape(srv.url), "engine_requests_running")
            peak[0] = max(peak[0], running or 0.0)
            time.sleep(0.005)

    with BackgroundServer(state) as srv:
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            level = run_async(run_level(srv.url, "capacity", texts, max_tokens, concurrency=len(texts),
                                        timeout=timeout, ignore_eos=True))
        finally:
            done.set()
            watcher.join(timeout=5)
    results = level["results"]
    prompt_tokens = [r["prompt_tokens"] for r in results if r["prompt_tokens"]]
    return {"kv_cache_dtype": kv_cache_dtype, "kv_cache_gib": gib, "cache_bytes": cache.nbytes,
            "capacity_tokens": cache.capacity_tokens, "blocks": cache.allocator.usable,
            "bytes_per_token": bytes_per_token(engine.config, engine.dtype, cache.kv_cache_dtype),
            "peak_running": int(peak[0]), "requests": len(texts),
            "errors": sum(r["error"] is not None for r in results),
            "prompt_tokens": max(prompt_tokens) if prompt_tokens else None, "max_tokens": max_tokens,
            "wall_s": level["wall_s"]}


def capacity(engine, gib: float, requests: int = 64, prompt_words: int = 60, max_tokens: int = 8,
             timeout: float = 300.0) -> dict:
    """Both caches, one after the other, the same requests -> each one's ``peak_running`` and the ratio."""
    texts = prompts(requests, prompt_words)
    runs = {d: peak_running(engine, d, gib, texts, max_tokens, timeout) for d in ("auto", "int8")}
    ratio = runs["int8"]["peak_running"] / max(runs["auto"]["peak_running"], 1)
    return {"runs": runs, "ratio": ratio, "target": 1.9, "met": ratio >= 1.9}
