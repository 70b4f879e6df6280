"""The GPU check's serving phase: the contest's load (issue 25, item 4), scaled to fit the check.

Serves the checkpoint in this process (``engine_lib.serve.server.start_background``), then sends
``--prompts`` greedy streaming chat requests of ``--prompt-tokens`` tokens (chat template
included) and ``--max-tokens`` output tokens at each ``--concurrency``, through the load test's
client (``engine_lib.bench.loadtest.run_level``). Reports per level: output tokens/s, P99 TPOT
(each request's decode seconds per token after its first), P99 TTFT, and the memory held (the
weights and the paged KV cache after the server starts, and the peak). One file:
``<out>/<name>.serve.json``.

Every request sends ``ignore_eos`` (vLLM's extension, as the contest's client does), so each
reply is ``--max-tokens`` long. The server runs its default ``decode_steps`` (8 on a GPU): a decode
batch with nothing waiting runs 8 steps before the host reads its tokens, so a stream's tokens
arrive in runs; TPOT (decode seconds over decoded tokens) counts them all the same.

Skips with one line (exit 0) when the server's packages are missing: the H200 image has httpx
but not fastapi, uvicorn or openai (``scripts/gpu_check.py --fetch-wheels`` gets them to carry).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

NEEDS = ("fastapi", "uvicorn", "httpx", "openai")  # the server and the load test's client


def missing() -> list[str]:
    """The packages in NEEDS that do not import here (absent, or built for other versions)."""
    out = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to import means the phase cannot run
            out.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
    return out


def prompts_of(engine, n: int, tokens: int) -> list[str]:
    """``n`` user messages whose chat-templated prompt is about ``tokens`` tokens (the load test's words)."""
    from engine_lib.bench.loadtest import make_prompts

    words = tokens
    for _ in range(4):  # most of the words are one token each: converges in a step or two
        prompts = make_prompts(n, shortest=words, longest=words)
        words -= len(engine.encode(prompts[0])) - tokens
    return prompts


def tpot_s(result: dict) -> float | None:
    """Time per output token after the first: the request's decode seconds over its decoded tokens."""
    n = result["completion_tokens"] or 0
    return (result["end_s"] - result["ttft_s"]) / (n - 1) if result["error"] is None and n > 1 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="folder for <name>.serve.json")
    p.add_argument("--name", required=True)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 50])
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for all levels; a level that would "
                   "start after it is skipped")
    args = p.parse_args()
    if gone := missing():
        print(f"serve: skipped: {'; '.join(gone)} not importable (carry them: scripts/gpu_check.py --fetch-wheels)")
        return 0

    import torch

    from engine_lib import Engine
    from engine_lib.bench.client import run_async, scrape, served_model
    from engine_lib.bench.loadtest import percentile, run_level, warm_up
    from engine_lib.bench.measure import device_name, peak_memory_bytes, reset_peak_memory
    from engine_lib.serve.server import ServerOptions, start_background

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model)  # the server's own defaults: fused on a GPU
    cuda = engine.device.type == "cuda"
    opts = ServerOptions(model=args.model, kv_cache_gib=args.kv_cache_gib, max_batch=max(args.concurrency),
                         max_queue=max(256, args.prompts), max_model_len=args.prompt_tokens + args.max_tokens + 64,
                         prefix_caching=False,  # every level sends the same prompts: no cached prefixes
                         served_model_name=Path(args.model).name)
    server = start_background(opts, engine)
    held = torch.cuda.memory_allocated(engine.device) if cuda else None  # weights + the paged KV cache
    prompts = prompts_of(engine, args.prompts, args.prompt_tokens)
    lengths = [len(engine.encode(q)) for q in prompts]
    record = {"meta": {"model": engine.model_dir.name, "stage": engine.stage.name,
                       "dtype": str(engine.dtype).removeprefix("torch."), "device_name": device_name(engine.device),
                       "torch": torch.__version__,
                       "prompts": args.prompts, "prompt_tokens": [min(lengths), max(lengths)],
                       "max_tokens": args.max_tokens, "kv_cache_gib": args.kv_cache_gib, "greedy": True,
                       "ignore_eos": True, "decode_steps": server.state.loop.scheduler.decode_steps,
                       "startup_s": round(time.perf_counter() - t0, 1),
                       "memory_held_bytes": held,
                       "memory_note": "torch.cuda.memory_allocated after the server started (weights and the paged "
                                      "KV cache); peak: max_memory_allocated per level" if cuda else
                                      "CPU: peak RSS of the process (VmHWM)"},
              "levels": []}
    out = Path(args.out) / f"{args.name}.serve.json"
    deadline = time.monotonic() + args.time_limit
    try:
        model = served_model(server.url)
        for c in args.concurrency:
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"concurrency {c}: skipped, the time limit ({args.time_limit:.0f} s) is spent", flush=True)
                record["levels"].append({"concurrency": c, "skipped": True})
                continue
            # the batch buckets this level reaches are captured here, untimed (loadtest.warm_up)
            warm_up(server.url, model, prompts, c, timeout=left)
            reset_peak_memory(engine.device)
            level = run_async(run_level(server.url, model, prompts, args.max_tokens, c, timeout=left, ignore_eos=True))
            tpots = [t for t in map(tpot_s, level.pop("results")) if t is not None]
            level.update(tpot_p50_s=percentile(tpots, 50), tpot_p99_s=percentile(tpots, 99),
                         peak_memory_bytes=peak_memory_bytes(engine.device),
                         kv_blocks_free_after=scrape(server.url).get("engine_kv_blocks_free"))
            record["levels"].append(level)
            out.write_text(json.dumps(record, indent=1, default=float))  # after every level
            print(f"concurrency {c:>3}: {level['completed']}/{level['requests']} completed, "
                  f"{level['throughput_tok_s']:.1f} output tok/s, P99 TPOT {level['tpot_p99_s'] * 1e3:.1f} ms, "
                  f"P99 TTFT {level['ttft_p99_s'] * 1e3:.0f} ms, peak memory "
                  f"{(level['peak_memory_bytes'] or 0) / 2**30:.2f} GiB", flush=True)
    finally:
        server.stop()
    record["meta"]["run_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(record, indent=1, default=float))
    done = [lv for lv in record["levels"] if not lv.get("skipped")]
    return 0 if done and all(lv["errors"] == 0 for lv in done) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
