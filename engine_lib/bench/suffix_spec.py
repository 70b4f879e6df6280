"""Suffix speculation beside plain decoding and prompt lookup: one request, then the same request again and again.

Defined in chapter 11 (more tokens per read). An agent sends the same kind of request many times; here, the
same "edit this code" chat request ``repeats`` times in a row to each of three engines over one model: plain
greedy decoding, prompt lookup (drafts from the request's own context) and suffix speculation (from it and from
the replies of the requests before, ``speculative/suffix.py``). Every reply is ``new_tokens`` long (stop tokens
off) and greedy, so all three give the same tokens. For each request: tokens per target forward and the
wall-clock decode rate. Targets: requests 2 to ``repeats`` reach at least 3 tokens per forward and twice plain
decoding's rate (against plain's median). ``drafting_ms`` times the drafter alone, ``rows`` rows at once. Where
node-llama-cpp is installed (``bench/llamacpp.py``), llama.cpp runs the same request ids from a BF16 GGUF of the
same checkpoint, plain and with the binding's own lookup drafts (``InputLookupTokenPredictor``: prompt lookup,
nothing kept between requests).

    python -m engine_lib.bench.suffix_spec --model DIR [--stage fused] [--no-llama-cpp] [--out book/results]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from .report import markdown_table

CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        total = total + price
    tax = total * tax_rate
    return total + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
REQUEST = ("Rename the variable `total` to `subtotal` in this code and add type hints. Reply with the whole "
           "code only.\n\n```python\n" + CODE + "```")
METHODS = ("plain", "prompt_lookup", "suffix")


def drafting_ms(rows: int = 64, steps: int = 50, prompt: int = 512, seed: int = 0) -> dict:
    """The suffix drafter's own time per step for ``rows`` rows: contexts of ``prompt`` tokens drawn from a small
    vocabulary (so the tries hold many matches), a global trie of earlier replies, and each step appending one to
    three accepted tokens to every row, as verify steps do. -> median and worst ms per step."""
    from ..speculative.suffix import SuffixDrafter

    rng = random.Random(seed)

    class Row:
        def __init__(self, tokens):
            self.prompt_ids, self.output_ids = tokens, []

        @property
        def tokens(self):
            return self.prompt_ids + self.output_ids

    drafter = SuffixDrafter()
    for _ in range(32):  # earlier replies in the global trie
        reply = Row([])
        reply.output_ids = [rng.randrange(200) for _ in range(256)]
        drafter.finished(reply)
    batch = [Row([rng.randrange(200) for _ in range(prompt)]) for _ in range(rows)]
    drafter.propose([(r, 8) for r in batch])  # the first call indexes every prompt: a prefill's work, not a step's
    times = []
    for _ in range(steps):
        for r in batch:
            r.output_ids += [rng.randrange(200) for _ in range(rng.randint(1, 3))]
        t0 = time.perf_counter()
        drafter.propose([(r, 8) for r in batch])
        times.append(time.perf_counter() - t0)
    return {"rows": rows, "steps": steps, "prompt_tokens": prompt, "median_ms": 1e3 * statistics.median(times),
            "max_ms": 1e3 * max(times)}


def run_dtype(model: str, stage: str, dtype: str, repeats: int, new_tokens: int) -> dict:
    """Every request of the workload in one dtype, the three engines over one model, in turn."""
    import gc

    from .. import Engine

    base = Engine.from_pretrained(model, device="cpu", stage=stage, dtype=dtype)
    engines = {m: base if m == "plain" else Engine(base.model, base.tokenizer, base.model_dir, base.stage,
                                                    base.device, speculative=m) for m in METHODS}
    ids = base.encode(REQUEST)
    for e in engines.values():  # compile the decode step and the verify shapes once, outside the timings
        e.generate(base.encode("Warm up."), max_new_tokens=16, do_sample=False, stop_token_ids=[])
    engines["suffix"].drafter.forget()  # the warm-up's reply is not part of the workload
    out = {"label": base.label, "prompt_tokens": len(ids), "requests": {m: [] for m in METHODS}}
    plain = None
    for method, engine in engines.items():
        for i in range(repeats):
            r = engine.generate(ids, max_new_tokens=new_tokens, do_sample=False, stop_token_ids=[])
            plain = plain or r.token_ids
            out["requests"][method].append({
                "request": i + 1, "decode_tok_s": r.decode_tokens_per_s, "ttft_ms": 1e3 * r.ttft_s,
                "tokens_per_forward": r.extra.get("tokens_per_target_forward", 1.0),
                "acceptance": r.extra.get("acceptance_rate"), "same_as_plain": r.token_ids == plain})
    del engines, base
    gc.collect()
    out["summary"] = summary(out["requests"])
    return out


def run_llama_cpp(model: str, ids: list[int], repeats: int, new_tokens: int, gguf_type: str = "BF16") -> dict:
    """The same request ids through llama.cpp, plain and with its binding's lookup drafts, each in a process of its
    own, after the engine's runs. -> per request: decode tok/s, TTFT, the drafts validated and refuted, and whether
    the reply equals llama.cpp's plain one; or {"skipped": why} where the peer cannot run here."""
    import torch

    from .gguf_export import ensure_gguf
    from .llamacpp import LlamaCppProcess, context_size, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    info = ensure_gguf(model, gguf_type)
    n_ctx = context_size(len(ids) + new_tokens)
    out = {"gguf": gguf_type, "threads": torch.get_num_threads(), "requests": {}}
    plain = None
    for method in ("plain", "lookup"):
        with LlamaCppProcess(info["path"], out["threads"], n_ctx, lookup=method == "lookup") as proc:
            out["node_llama_cpp"] = proc.hello["node_llama_cpp"]
            proc.generate(ids[:16], 8)  # warm up
            reqs = out["requests"][method] = []
            for i in range(repeats):
                r = proc.generate(ids, new_tokens)
                plain = plain or r["tokens"]
                p = r["predictions"]
                drafted = p["validated"] + p["refuted"]
                reqs.append({"request": i + 1, "decode_tok_s": r["decode_tok_s"], "ttft_ms": 1e3 * r["ttft_s"],
                             "drafted": drafted, "acceptance": p["validated"] / drafted if drafted else None,
                             "same_as_plain": r["tokens"] == plain})
    return out


def run(model: str, stage: str = "fused", repeats: int = 8, new_tokens: int = 128,
        dtypes: tuple[str, ...] = ("float32", "bfloat16"), llama_cpp: bool = True) -> dict:
    """The workload in each of ``dtypes`` (fp32 first: there every reply must equal plain greedy's, so the targets
    are read there), llama.cpp's peer where it is installed, and the drafter's own cost."""
    from ..model.config import Qwen2Config
    from .measure import cpu_model, device_name, git_commit

    cfg = Qwen2Config.from_json(Path(model) / "config.json")
    record = {"meta": {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
                       "model": Path(model).name, "layers": cfg.num_hidden_layers, "stage": stage,
                       "device_name": device_name("cpu"), "cpu_model": cpu_model(), "new_tokens": new_tokens,
                       "repeats": repeats},
              "runs": {d: run_dtype(model, stage, d, repeats, new_tokens) for d in dtypes}}
    record["meta"]["prompt_tokens"] = next(iter(record["runs"].values()))["prompt_tokens"]
    if llama_cpp:
        from ..model.tokenizer import chat_ids, load_tokenizer

        ids = chat_ids(load_tokenizer(model), [{"role": "user", "content": REQUEST}])  # what Engine.encode gives
        record["llama_cpp"] = run_llama_cpp(model, ids, repeats, new_tokens)
    record["drafting"] = drafting_ms()
    record["targets"] = targets(record)
    return record


def summary(requests: dict) -> dict:
    plain = statistics.median(r["decode_tok_s"] for r in requests["plain"])
    out = {"plain_decode_tok_s": plain}
    for method in METHODS[1:]:
        reqs = requests[method]
        later = reqs[1:]
        out[method] = {"first_tokens_per_forward": reqs[0]["tokens_per_forward"],
                       "first_speedup": reqs[0]["decode_tok_s"] / plain,
                       "later_tokens_per_forward": min(r["tokens_per_forward"] for r in later),
                       "later_speedup": min(r["decode_tok_s"] for r in later) / plain,
                       "same_as_plain": sum(r["same_as_plain"] for r in reqs)}
    return out


def targets(record: dict) -> list[dict]:
    """Read on the fp32 run (the first), where speculation must not change a greedy token."""
    dtype, run_ = next(iter(record["runs"].items()))
    s = run_["summary"]
    same = all(s[m]["same_as_plain"] == record["meta"]["repeats"] for m in METHODS[1:])
    per_forward, speedup = s["suffix"]["later_tokens_per_forward"], s["suffix"]["later_speedup"]
    return [
        {"what": f"suffix, requests 2 on: tokens per forward, the least ({dtype})", "value": per_forward,
         "goal": 3.0, "met": per_forward >= 3.0},
        {"what": f"suffix, requests 2 on: decode tok/s over plain's, the least ({dtype})", "value": speedup,
         "goal": 2.0, "met": speedup >= 2.0},
        {"what": "drafting 64 rows, ms per step (median)", "value": record["drafting"]["median_ms"], "goal": 1.0,
         "met": record["drafting"]["median_ms"] < 1.0},
        {"what": f"every speculative reply equals plain greedy's ({dtype})", "value": float(same), "goal": 1.0,
         "met": same}]


HEADER = ["request", "plain tok/s", "prompt lookup tok/s", "tokens/forward", "suffix tok/s", "tokens/forward"]


def rows(run_: dict) -> list[list[str]]:
    req = run_["requests"]
    return [[str(i + 1), f"{p['decode_tok_s']:.1f}", f"{lk['decode_tok_s']:.1f}", f"{lk['tokens_per_forward']:.2f}",
             f"{sf['decode_tok_s']:.1f}", f"{sf['tokens_per_forward']:.2f}"]
            for i, (p, lk, sf) in enumerate(zip(req["plain"], req["prompt_lookup"], req["suffix"]))]


def markdown(record: dict) -> str:
    m, d = record["meta"], record["drafting"]
    lines = [f"# Suffix speculation beside plain decoding and prompt lookup: {m['model']} ({m['layers']} layers)", "",
             f"- {m['cpu_model']}, {m['device_name']}; {m['stage']} rung; commit {m['commit']}, {m['timestamp']}",
             f"- one \"edit this code\" chat request ({m['prompt_tokens']} prompt tokens), sent {m['repeats']} times "
             f"in a row to each engine; {m['new_tokens']} greedy tokens each, stop tokens off"]
    for dtype, run_ in record["runs"].items():
        s = run_["summary"]
        lines += ["", f"## {dtype}: {run_['label']}", "", *markdown_table(HEADER, rows(run_), first="---:"), "",
                  f"Replies equal to plain greedy's: prompt lookup {s['prompt_lookup']['same_as_plain']} of "
                  f"{m['repeats']}, suffix {s['suffix']['same_as_plain']} of {m['repeats']}."]
    lines += llama_cpp_lines(record)
    lines += ["", f"Drafting alone: {d['rows']} rows, {d['prompt_tokens']}-token contexts, median {d['median_ms']:.3f} "
              f"ms a step (worst {d['max_ms']:.3f}).", ""]
    met = sum(t["met"] for t in record["targets"])
    lines += [f"Targets met: {met} of {len(record['targets'])}."]
    lines += [f"- {'met' if t['met'] else 'NOT met'}: {t['what']} = {t['value']:.3g} (goal {t['goal']})"
              for t in record["targets"]]
    return "\n".join(lines) + "\n"


LLAMA_HEADER = ["request", "plain tok/s", "lookup tok/s", "drafts accepted", "same as plain"]


def llama_cpp_rows(peer: dict) -> list[list[str]]:
    req = peer["requests"]
    return [[str(i + 1), f"{p['decode_tok_s']:.1f}", f"{lk['decode_tok_s']:.1f}",
             "none drafted" if lk["acceptance"] is None else f"{lk['acceptance']:.0%} of {lk['drafted']}",
             "yes" if lk["same_as_plain"] else "no"] for i, (p, lk) in enumerate(zip(req["plain"], req["lookup"]))]


def llama_cpp_lines(record: dict) -> list[str]:
    peer = record.get("llama_cpp")
    if peer is None:
        return []
    if "skipped" in peer:
        return ["", f"llama.cpp: not run here ({peer['skipped']})."]
    lines = ["", f"## llama.cpp: {peer['gguf']} GGUF of the same checkpoint, node-llama-cpp {peer['node_llama_cpp']}, "
             f"{peer['threads']} threads", "",
             "The same request ids; lookup is the binding's InputLookupTokenPredictor (prompt lookup at its defaults, "
             "nothing kept between requests).", "", *markdown_table(LLAMA_HEADER, llama_cpp_rows(peer), first="---:")]
    sentence = llama_cpp_sentence(record)
    return lines + (["", sentence] if sentence else [])


def llama_cpp_sentence(record: dict) -> str | None:
    """Requests 2 on (medians): llama.cpp plain and with lookup, beside the engine's bf16 suffix run."""
    peer, bf16 = record.get("llama_cpp", {}), record["runs"].get("bfloat16")
    if "requests" not in peer or not bf16:
        return None
    later = {m: statistics.median(r["decode_tok_s"] for r in peer["requests"][m][1:]) for m in ("plain", "lookup")}
    ours = statistics.median(r["decode_tok_s"] for r in bf16["requests"]["suffix"][1:])
    return (f"Requests 2 on, median decode: llama.cpp {later['plain']:.1f} tok/s plain, {later['lookup']:.1f} with "
            f"lookup; the engine in bfloat16 with suffix speculation {ours:.1f} ({ours / later['lookup']:.2f}x "
            "llama.cpp with lookup).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_lib.bench.suffix_spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--stage", default="fused")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the targets are read on the first")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even where node-llama-cpp is installed")
    p.add_argument("--out", default="book/results")
    args = p.parse_args(argv)
    record = run(args.model, args.stage, args.repeats, args.new_tokens, tuple(args.dtypes), not args.no_llama_cpp)
    from .run import slug

    stem = slug(f"{record['meta']['device_name']} {record['meta']['cpu_model'] or ''} {record['meta']['model']}")
    out = Path(args.out) / f"{stem}.suffix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_name(f"{stem}.suffix.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
