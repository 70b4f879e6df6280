"""The int8 KV cache's record: bytes per token, accuracy, decode speed at two contexts, and server capacity.

Defined in chapter 05 (the KV cache); chapter 12 reads its capacity. One command measures all four, each
beside the model-dtype cache in the same run:

    python -m engine_lib.bench.kv_int8 --speed-model DIR --capacity-model DIR --out book/results

- bytes: one token's cache at the real model's shape (and the checkpoints measured), scales included;
- accuracy (``kv_quality``): the trained preset on its held-out text, mean KL divergence, perplexity change and
  greedy agreement, at the half rung (bf16) and the kv_cache rung (fp32);
- speed: one decode step of ``--speed-model`` at 512 and 4,096 tokens of context, ``rows`` rows each, the cache
  filled with random values (the step reads every slot up to its position whatever they hold, so no prefill is
  needed), both caches in alternating rounds, median step time of each;
- capacity (``kv_capacity``): the most requests a server on 127.0.0.1 runs at once in the same ``--kv-cache-gib``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .report import markdown_table

CONTEXTS = (512, 4096)
TARGETS = {"bytes_x": 0.53, "mean_kl_nats": 0.01, "ppl_change": 0.01, "capacity_x": 1.9}


def filled_cache(model, rows: int, context: int, kv_cache_dtype: str | None, seed: int = 0):
    """A contiguous cache of ``rows`` rows holding ``context`` random tokens each (values of a realistic size), and
    its decode state with every row's next token at position ``context``."""
    from ..cache.contiguous import KVCache
    from ..cache.quantized import quantize
    from ..step.decode import DecodeState

    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim, context + 2, model.dtype,
                    model.device, kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    for i in range(cfg.num_hidden_layers):
        for buf, scales in ((cache.k[i], cache.k_scale[i] if cache.k_scale else None),
                            (cache.v[i], cache.v_scale[i] if cache.v_scale else None)):
            x = torch.randn(buf.shape, generator=g)  # (rows, kv_heads, slots, head_dim)
            if scales is None:
                buf.copy_(x)
            else:
                q, s = quantize(x)
                buf.copy_(q)
                scales.copy_(s)
    st = DecodeState(cache, cfg.vocab_size, model.device)
    st.load([1000 + r for r in range(rows)], [context] * rows, [[r] for r in range(rows)])
    return st


@torch.inference_mode()
def step_times(model, rows: int, context: int, rounds: int = 7, steps: int = 5) -> dict:
    """Median seconds of one eager decode step at ``context`` (``kv_len`` = context + 1), both caches in turn."""
    from ..step.decode import GREEDY, decode_step

    states = {d: filled_cache(model, rows, context, d) for d in ("auto", "int8")}
    states = {d: (st, [t.clone() for t in st._advanced()]) for d, st in states.items()}
    for st, saved in states.values():  # warm-up: first calls allocate, and build nothing we want to time
        decode_step(model, st, GREEDY, context + 1)
        st.restore(saved)
    times = {d: [] for d in states}
    for r in range(rounds):
        for d in (("auto", "int8") if r % 2 == 0 else ("int8", "auto")):  # alternate who goes first
            st, saved = states[d]
            for _ in range(steps):
                st.restore(saved)  # the same position every time: the same work
                t0 = time.perf_counter()
                decode_step(model, st, GREEDY, context + 1)
                times[d].append(time.perf_counter() - t0)
    med = {d: statistics.median(v) for d, v in times.items()}
    return {"rows": rows, "context": context, "step_ms": {d: 1e3 * v for d, v in med.items()},
            "speedup": med["auto"] / med["int8"], "steps_each": rounds * steps}


def run(args) -> dict:
    from .. import Engine
    from ..cache.quantized import bytes_per_token
    from ..model.checkpoints import HELDOUT_TEXT, ensure_checkpoint, preset_config
    from .kv_capacity import capacity
    from .kv_quality import compare_caches
    from .measure import cpu_model, device_name, git_commit
    from .perplexity import text_ids

    real = preset_config("qwen2.5-1.5b-random")
    record = {"meta": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
                       "device_name": device_name(torch.device("cpu")), "cpu_model": cpu_model(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__},
              "bytes_per_token": {"real_shape": {"fp16": bytes_per_token(real, torch.float16, None),
                                                 "int8": bytes_per_token(real, torch.float16, "int8")}}}
    b = record["bytes_per_token"]["real_shape"]
    record["bytes_per_token"]["bytes_x"] = b["int8"] / b["fp16"]

    trained = ensure_checkpoint("qwen2-stdlib-small")
    quality = {}
    for stage in ("half", "kv_cache"):
        engine = Engine.from_pretrained(trained, device="cpu", stage=stage)
        ids = text_ids(engine.tokenizer, HELDOUT_TEXT.read_text(encoding="utf-8"), args.tokens)
        quality[stage] = {"dtype": str(engine.dtype).removeprefix("torch."),
                          **compare_caches(engine.model, ids, context=128, chunk=32, progress=True)}
        del engine
    record["quality"] = {"model": trained.name, "text": HELDOUT_TEXT.name, "rungs": quality}

    engine = Engine.from_pretrained(args.speed_model, device="cpu", stage="half")
    record["speed"] = {"model": Path(args.speed_model).name, "layers": engine.config.num_hidden_layers,
                       "stage": "half", "dtype": str(engine.dtype).removeprefix("torch."), "runs": [
                           step_times(engine.model, rows, ctx) for rows in args.rows for ctx in CONTEXTS]}
    del engine

    engine = Engine.from_pretrained(args.capacity_model, device="cpu", stage="half")
    record["capacity"] = {"model": Path(args.capacity_model).name, **capacity(engine, args.kv_cache_gib)}
    record["targets"] = targets(record)
    return record


def targets(record: dict) -> list[dict]:
    half = record["quality"]["rungs"]["half"]
    out = [("bytes per token, int8 / fp16 (real shape)", record["bytes_per_token"]["bytes_x"], "<=", TARGETS["bytes_x"]),
           ("mean KL divergence, nats (bf16)", half["mean_kl_nats"], "<=", TARGETS["mean_kl_nats"]),
           ("perplexity change (bf16)", abs(half["ppl_change"]), "<=", TARGETS["ppl_change"]),
           ("requests held at once, int8 / model dtype", record["capacity"]["ratio"], ">=", TARGETS["capacity_x"])]
    for r in record["speed"]["runs"]:  # no slower at 512 tokens of context; faster at 4,096
        rule = ">=" if r["context"] <= 512 else ">"
        out.append((f"decode step speed-up, {r['rows']} row(s) at {r['context']} tokens", r["speedup"], rule, 1.0))
    return [{"what": w, "value": v, "rule": rule, "goal": g, "met": v <= g if rule == "<=" else v >= g if rule == ">="
             else v > g} for w, v, rule, g in out]


QUALITY_HEADER = ["rung (dtype)", "scored tokens", "mean KL (nats)", "largest KL", "perplexity", "with int8",
                  "change", "greedy agreement"]
SPEED_HEADER = ["rows", "context", "model-dtype cache, ms", "int8 cache, ms", "speed-up"]
CAPACITY_HEADER = ["cache", "bytes/token", "blocks", "tokens", "requests running at once (most)", "errors"]


def quality_rows(record: dict) -> list[list[str]]:
    return [[f"{stage} ({r['dtype']})", f"{r['tokens']:,}", f"{r['mean_kl_nats']:.5f}", f"{r['max_kl_nats']:.4f}",
             f"{r['ppl_ref']:.3f}", f"{r['ppl_int8']:.3f}", f"{100 * r['ppl_change']:+.3f}%",
             f"{100 * r['greedy_agreement']:.2f}%"] for stage, r in record["quality"]["rungs"].items()]


def speed_rows(record: dict) -> list[list[str]]:
    return [[str(r["rows"]), f"{r['context']:,}", f"{r['step_ms']['auto']:.1f}", f"{r['step_ms']['int8']:.1f}",
             f"{r['speedup']:.2f}x"] for r in record["speed"]["runs"]]


def capacity_rows(record: dict) -> list[list[str]]:
    return [["model dtype" if d == "auto" else d, str(r["bytes_per_token"]), str(r["blocks"]),
             f"{r['capacity_tokens']:,}", str(r["peak_running"]), str(r["errors"])]
            for d, r in record["capacity"]["runs"].items()]


def markdown(record: dict) -> str:
    m, q, s, c = record["meta"], record["quality"], record["speed"], record["capacity"]
    b = record["bytes_per_token"]
    first = next(iter(q["rungs"].values()))
    run = c["runs"]["auto"]
    lines = [f"# The int8 KV cache beside the model-dtype cache ({m['cpu_model']}, {m['device_name']})", "",
             f"- commit {m['commit']}, torch {m['torch']}, {m['threads']} threads, {m['timestamp']}",
             "- bytes per token at the real model's shape (28 layers, 2 KV heads of 128): "
             f"fp16/bf16 {b['real_shape']['fp16']:,}, int8 {b['real_shape']['int8']:,} (scales included): "
             f"{b['bytes_x']:.3f}x", "",
             f"## Accuracy: {q['model']} (trained), held-out text {q['text']}, windows of {first['context']} tokens "
             f"in chunks of {first['chunk']}", "", *markdown_table(QUALITY_HEADER, quality_rows(record)), "",
             f"## Decode step: {s['model']} ({s['layers']} layers), {s['stage']} rung ({s['dtype']}), CPU, the cache "
             "filled with random values", "", *markdown_table(SPEED_HEADER, speed_rows(record)), "",
             f"## Capacity: a server on 127.0.0.1, {c['model']}, --kv-cache-gib {run['kv_cache_gib']}, "
             f"{run['requests']} requests sent at once ({run['prompt_tokens']} prompt tokens, {run['max_tokens']} "
             "new tokens each)", "", *markdown_table(CAPACITY_HEADER, capacity_rows(record))]
    met = sum(t["met"] for t in record["targets"])
    lines += ["", f"Targets met: {met} of {len(record['targets'])}."]
    lines += [f"- {'met' if t['met'] else 'NOT met'}: {t['what']} = {t['value']:.4g} (goal {t['rule']} {t['goal']})"
              for t in record["targets"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed-model", required=True, help="checkpoint for the decode-step timing")
    p.add_argument("--capacity-model", required=True, help="checkpoint for the server capacity test (the real "
                   "model's head_dim, so its bytes per token are the real ones)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=8192, help="held-out tokens for the accuracy")
    p.add_argument("--kv-cache-gib", type=float, default=0.002)
    p.add_argument("--out", default="book/results")
    args = p.parse_args(argv)
    record = run(args)
    from .run import slug

    out = Path(args.out) / f"{slug(record['meta']['device_name'] + ' ' + (record['meta']['cpu_model'] or ''))}.kvcache.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_name(out.name.removesuffix(".json") + ".md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
