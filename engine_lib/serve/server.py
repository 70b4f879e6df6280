"""Start the server: load the engine, size the paged cache, run the serving loop and uvicorn.

Defined in chapter 12 (serving many users). ``python -m engine_lib serve`` calls
``main``; tests, the load test and the chapter use ``start_background`` to run the same
server in a thread on 127.0.0.1 with a free port, and stop it when they are done.

Stopping: the first SIGTERM or SIGINT stops taking requests and lets the running ones finish
for ``--shutdown-timeout`` seconds, then cancels them; a second signal exits at once. The API
key is best given in the ``ENGINE_LIB_API_KEY`` environment variable: a command line shows in ``ps``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..loop.config import SPECULATIVE_METHODS, SchedulerConfig

DEFAULTS = SchedulerConfig()  # the serving defaults are stated once, there

DEFAULT_KV_CACHE_GIB = 1.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
API_KEY_ENV = "ENGINE_LIB_API_KEY"


@dataclass
class ServerOptions:
    model: str
    stage: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB
    kv_cache_dtype: str | None = None  # None / "auto": the model's dtype; "int8" (cache/quantized.py)
    max_batch: int = DEFAULTS.max_batch
    max_queue: int = DEFAULTS.max_queue
    prefill_chunk: int = DEFAULTS.prefill_chunk
    max_model_len: int | None = None
    batch_invariant: bool = False
    prefix_caching: bool = DEFAULTS.prefix_caching
    decode_steps: int | None = DEFAULTS.decode_steps
    speculative: str | None = DEFAULTS.speculative
    speculative_tokens: int = DEFAULTS.speculative_tokens
    api_key: str | None = None
    served_model_name: str | None = None
    metrics_no_auth: bool = False


def build_state(opts: ServerOptions, engine=None, start: bool = True):
    """-> (ServerState, Engine): the model loaded, the paged cache sized, the serving loop started in a
    background thread (``start=False``: not started; the caller runs ``loop.run()``)."""
    from ..cache.paged import PagedKVCache
    from ..cache.quantized import check_kv_cache_dtype
    from ..engine import Engine
    from ..loop.serving import ServingLoop
    from .app import ServerState

    # the serving options are checked before the model loads: a bad one costs no wait
    kv_cache_dtype = check_kv_cache_dtype(opts.kv_cache_dtype)
    config = SchedulerConfig(max_batch=opts.max_batch, max_queue=opts.max_queue, prefill_chunk=opts.prefill_chunk,
                             batch_invariant=opts.batch_invariant, prefix_caching=opts.prefix_caching,
                             decode_steps=opts.decode_steps, speculative=opts.speculative,
                             speculative_tokens=opts.speculative_tokens)
    if engine is None:
        engine = Engine.from_pretrained(opts.model, device=opts.device, dtype=opts.dtype, stage=opts.stage)
    cache = PagedKVCache.from_budget(engine.config, opts.kv_cache_gib, engine.dtype, engine.device,
                                     kv_cache_dtype=kv_cache_dtype)
    loop = ServingLoop(engine.model, engine.tokenizer, cache, config, max_model_len=opts.max_model_len,
                          compile_step=engine.compile_step, cuda_graph=engine.cuda_graph)
    if start:
        loop.start()
    name = opts.served_model_name or opts.model
    return ServerState(loop, engine.tokenizer, engine.defaults, name, opts.api_key,
                       metrics_no_auth=opts.metrics_no_auth), engine


class BackgroundServer:
    """uvicorn in a daemon thread; ``url`` is ``http://127.0.0.1:PORT``; ``stop()`` ends both threads."""

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        from .app import create_app

        self.state = state
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="engine-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.state.loop.stop()
        self.state.loop.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_background(opts: ServerOptions, engine=None, port: int = 0) -> BackgroundServer:
    state, _ = build_state(opts, engine)
    return BackgroundServer(state, port=port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..stages import STAGES

    p.add_argument("--model", default="auto", help="checkpoint folder or hub repo id; 'auto' = the real "
                   "Qwen2.5-1.5B-Instruct if reachable, else the offline random tiny checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health; "
                   f"better: set the {API_KEY_ENV} environment variable (a command line shows in ps)")
    p.add_argument("--metrics-no-auth", action="store_true", help="leave /metrics open without the API key "
                   "(for Prometheus scrapers)")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, help="on SIGTERM/SIGINT, "
                   "seconds to let running requests finish before they are cancelled; a second signal exits at once")
    p.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB,
                   help="memory for the paged KV cache, in GiB (blocks of 16 tokens)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto", help="how keys and values are "
                   "stored: 'auto' in the model's dtype; 'int8' with one fp32 scale per token and KV head, about "
                   "twice the tokens in the same --kv-cache-gib, at a small cost in accuracy (chapter 05)")
    p.add_argument("--stage", choices=list(STAGES), default=None, help="rung of the ladder "
                   "(default: fused on GPU, kv_cache on CPU); decode batches run the engine's step, compiled and "
                   "captured as CUDA graphs per batch bucket where the rung does")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, help="sequences decoded together at most")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue, help="waiting requests before new ones get 429")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULTS.prefill_chunk, help="prompt tokens per loop step")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps a batch runs before the host "
                   "reads its tokens, when nothing waits and no row needs the host between tokens (default: 8 on a "
                   "GPU, 1 on a CPU)")
    p.add_argument("--speculative", choices=[m for m in SPECULATIVE_METHODS if m], default=None, help="speculative "
                   "decoding: 'prompt_lookup' drafts tokens for greedy requests from their own context (the n-gram "
                   "lookup of chapter 11), 'suffix' also from the replies of the requests this server finished "
                   "(suffix speculation, chapter 11), and one forward verifies them; in fp32 the replies are "
                   "unchanged, in half precision a near-tie may go the other way (default: off)")
    p.add_argument("--speculative-tokens", type=int, default=DEFAULTS.speculative_tokens, help="tokens drafted per "
                   "request and step at most, with --speculative")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + max_tokens)")
    p.add_argument("--batch-invariant", action="store_true", help="make each request's tokens independent of "
                   "the others in its batch: every decode row reads --max-model-len slots (set it small) and a "
                   "lone row is padded to two")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", help="do not share "
                   "cached KV blocks between requests with a common prefix (on by default)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' "
                   "(default: the --model argument)")


def _default_name(asked: str, resolved: str) -> str:
    """The model name clients send: what was asked for; for 'auto', the hub id or the folder's name."""
    from pathlib import Path

    from ..model.checkpoints import REAL_MODEL_ID, is_random_checkpoint

    if asked != "auto":
        return asked
    return Path(resolved).name if is_random_checkpoint(resolved) else REAL_MODEL_ID


def _serve_http(config, loop) -> int:
    """uvicorn in a thread, the serving loop in this (the main) thread, so that the model's work
    runs in the process's one OpenMP thread team (see ``loop.serving``'s note; measured on a 2-core
    host, a batch-1 decode step took 44 ms with the loop in a second thread, 38 ms alone). The first
    SIGTERM or SIGINT gives running requests ``timeout_graceful_shutdown`` seconds to finish; a second
    exits at once. -> the exit status: 1 when the HTTP server never started (a port in use: uvicorn
    logs why and ends its thread)."""
    import signal

    import uvicorn

    server = uvicorn.Server(config)  # in a thread it installs no signal handlers: these are ours

    def handle_exit(sig, frame):
        if server.should_exit:
            print("second signal: exiting now", file=sys.stderr, flush=True)
            os._exit(1)
        print(f"shutting down: running requests get {config.timeout_graceful_shutdown} s to finish "
              "(signal again to exit now)", file=sys.stderr, flush=True)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle_exit)

    def http() -> None:
        try:
            server.run()
        finally:  # the HTTP server is done (shut down, or failed to start): so is the loop
            loop.stop()

    threading.Thread(target=http, name="engine-http", daemon=True).start()
    loop.run()
    return 0 if server.started else 1


def main(args) -> int:
    import uvicorn

    from ..model.checkpoints import resolve_auto_model
    from .app import create_app

    model = resolve_auto_model(args.model)
    opts = ServerOptions(model=model, stage=args.stage, device=args.device, dtype=args.dtype,
                         kv_cache_gib=args.kv_cache_gib, kv_cache_dtype=args.kv_cache_dtype,
                         max_batch=args.max_batch, max_queue=args.max_queue,
                         prefix_caching=args.prefix_caching, decode_steps=args.decode_steps,
                         speculative=args.speculative, speculative_tokens=args.speculative_tokens,
                         prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                         batch_invariant=args.batch_invariant, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                         served_model_name=args.served_model_name or _default_name(args.model, model),
                         metrics_no_auth=args.metrics_no_auth)
    state, engine = build_state(opts, start=False)
    cache = state.loop.cache
    print(f"model: {engine.label}", file=sys.stderr)
    print(f"serving {state.model_name!r} on http://{args.host}:{args.port}/v1 | KV cache "
          f"{cache.nbytes / 2**30:.2f} GiB ({cache.kv_cache_dtype or str(cache.dtype).removeprefix('torch.')}) = "
          f"{cache.allocator.usable} blocks of {cache.block_size} tokens = {cache.capacity_tokens} tokens | "
          f"context {state.max_model_len} | max batch {args.max_batch} | decode steps "
          f"{state.loop.scheduler.decode_steps}" + (f" | speculative {opts.speculative} (up to {opts.speculative_tokens} "
                                               "tokens)" if opts.speculative else "")
          + (" | API key required" if opts.api_key else ""),
          file=sys.stderr)
    config = uvicorn.Config(create_app(state), host=args.host, port=args.port, log_level="info", lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    return _serve_http(config, state.loop)
