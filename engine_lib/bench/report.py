"""Turning a benchmark record into ratios, target checks, a markdown table and a chart.

Defined in chapter 08 (results). Every ratio and every target verdict is computed here from
the timings of one record (one run, one machine): nothing is typed in.
"""

from __future__ import annotations

import math
import re
from pathlib import Path


def markdown_table(header: list[str], rows: list[list[str]], first: str = "---") -> list[str]:
    """A markdown table's lines: the header, the rule (``first`` aligns the first column, the rest are
    right-aligned numbers) and one line a row."""
    return [f"| {' | '.join(header)} |", f"|{first}|" + "---:|" * (len(header) - 1),
            *[f"| {' | '.join(r)} |" for r in rows]]


def fmt(value, spec: str = ".1f", unit: str = "") -> str:
    """A number for the page; ``n/a`` where there is none (None, NaN)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:{spec}}{unit}"


def _seed(record: dict, name: str, key: str) -> float | None:
    w = record["systems"].get(name, {}).get("workloads", {}).get("seed", {})
    return w.get(key)


def _steps(record: dict, name: str) -> dict[str, float]:
    return record["systems"].get(name, {}).get("step_latency_s", {})


def growth(steps: dict[str, float], a: str, b: str) -> float | None:
    """Relative growth of one decode step's latency from context a to context b."""
    return steps[b] / steps[a] - 1 if a in steps and b in steps else None


def ratios(record: dict) -> dict:
    """Each rung against each baseline, per workload: decode x (higher is better), TTFT x (higher is better)."""
    systems = record["systems"]
    rungs = [n for n, s in systems.items() if s["kind"] == "engine"]
    bases = [n for n, s in systems.items() if s["kind"] == "hf"]
    out = {}
    for r in rungs:
        for b in bases:
            for w, rw in systems[r]["workloads"].items():
                bw = systems[b]["workloads"].get(w, {})
                if "error" in rw or "error" in bw or not bw:
                    continue
                out[f"{r} vs {b} [{w}]"] = {"decode_x": rw["decode_tok_s"] / bw["decode_tok_s"],
                                            "ttft_x": bw["ttft_ms"] / rw["ttft_ms"]}
    naive, kv = _steps(record, "naive"), _steps(record, "kv_cache")
    for ctx in ("512", "2048"):
        if ctx in naive and ctx in kv:
            out[f"naive step / kv_cache step @{ctx}"] = naive[ctx] / kv[ctx]
    for rung in rungs:
        steps = _steps(record, rung)
        last = max((c for c in steps), key=int, default=None)
        if rung != "naive" and last and "64" in steps and last != "64":
            out[f"{rung} step growth 64 -> {last}"] = growth(steps, "64", last)
    fused, half = _seed(record, "fused", "decode_tok_s"), _seed(record, "half", "decode_tok_s")
    if fused and half:
        out["fused decode / half decode [seed]"] = fused / half
    for quant in ("int8", "int4"):  # chapter 10: fewer bytes per token
        rate = _seed(record, quant, "decode_tok_s")
        if rate and half:
            out[f"{quant} decode / half decode [seed]"] = rate / half
    return out


def roofline(record: dict) -> dict:
    """Measured seed-prompt decode rate as a share of bandwidth / bytes-per-token."""
    bw = record["copy_bandwidth_bytes_s"]
    out = {}
    for name, s in record["systems"].items():
        seed = s["workloads"].get("seed", {})
        if s["kind"] != "engine" or "decode_tok_s" not in seed:
            continue
        limit = bw / s["weight_bytes"]
        out[name] = {"roofline_tok_s": limit, "decode_tok_s": seed["decode_tok_s"],
                     "fraction": seed["decode_tok_s"] / limit}
    return out


def targets(record: dict) -> list[dict]:
    """The project's targets that this record can decide: name, measured value, goal, met."""
    out = []

    def add(name: str, value: float | None, goal: str, met) -> None:
        if value is not None:
            out.append({"target": name, "value": value, "goal": goal, "met": bool(met(value))})

    systems = record["systems"]
    on_gpu = record["meta"]["device"].startswith("cuda")
    fused_steps, kv_steps = _steps(record, "fused"), _steps(record, "kv_cache")
    if "int8" in systems and "half" in systems:  # chapter 10: weight-only int8
        add("int8 weight bytes / half weight bytes", systems["int8"]["weight_bytes"] / systems["half"]["weight_bytes"],
            "<= 55%", lambda v: v <= 0.55)
        paired = record.get("paired_int8")
        if on_gpu:
            i, f = _seed(record, "int8", "decode_tok_s"), _seed(record, "fused", "decode_tok_s")
            add("int8 decode / fused decode (seed prompts)", i / f if i and f else None, ">= 1.4x", lambda v: v >= 1.4)
        elif paired:  # timed turn about: drift hits both alike
            add(f"int8 decode / half decode ({paired['rounds']} paired rounds)", paired["ratio"], ">= 1.3x",
                lambda v: v >= 1.3)
        else:
            i, h = _seed(record, "int8", "decode_tok_s"), _seed(record, "half", "decode_tok_s")
            add("int8 decode / half decode (seed prompts)", i / h if i and h else None, ">= 1.3x", lambda v: v >= 1.3)
    if not on_gpu:
        paired = record.get("paired")
        if paired:  # timed turn about: the comparison that drift cannot tilt
            add(f"fused decode / half decode ({paired['rounds']} paired rounds)", paired["ratio"], ">= 1.0",
                lambda v: v >= 1.0)
        else:
            f, h = _seed(record, "fused", "decode_tok_s"), _seed(record, "half", "decode_tok_s")
            add("fused decode / half decode (seed prompts)", f / h if f and h else None, ">= 1.0", lambda v: v >= 1.0)
    last = max((c for c in fused_steps if c in kv_steps), key=int, default=None)
    if last and last != "64" and "64" in fused_steps:
        fg, kg = growth(fused_steps, "64", last), growth(kv_steps, "64", last)
        add(f"fused step growth 64 -> {last} tokens", fg, "<= 25%", lambda v: v <= 0.25)
        add(f"fused step growth minus kv_cache's, 64 -> {last}", fg - kg, "<= 0 (+5% noise)", lambda v: v <= 0.05)
    naive = _steps(record, "naive")
    if "512" in naive and "512" in kv_steps:
        add("naive step / kv_cache step @512", naive["512"] / kv_steps["512"], ">= 10x", lambda v: v >= 10)
    if on_gpu and "fused" in systems:
        roof = roofline(record).get("fused")
        add("fused decode, share of the copy-bandwidth roofline", roof and roof["fraction"], ">= 75%",
            lambda v: v >= 0.75)
        hf = [n for n, s in systems.items() if s.get("hf_mode") == "generate" and s["dtype"] == systems["fused"]["dtype"]]
        static = [n for n in systems if systems[n].get("hf_mode") == "static_compile"]
        fused_rate, fused_ttft = _seed(record, "fused", "decode_tok_s"), _seed(record, "fused", "ttft_ms")
        for name in hf:
            rate, ttft = _seed(record, name, "decode_tok_s"), _seed(record, name, "ttft_ms")
            add(f"fused decode / {name}", fused_rate / rate if fused_rate and rate else None, ">= 3x", lambda v: v >= 3)
            add(f"fused TTFT gain over {name}", ttft / fused_ttft if fused_ttft and ttft else None, ">= 3x",
                lambda v: v >= 3)
        for name in static:
            rate = _seed(record, name, "decode_tok_s")
            add(f"fused decode / {name}", fused_rate / rate if fused_rate and rate else None, "> 1x", lambda v: v > 1)
        at = systems["fused"].get("step_latency", {}).get("4096", {})
        if "peak_memory_bytes" in at:
            need = systems["fused"]["weight_bytes"] + at["kv_cache_bytes"]
            add("fused peak memory @4096 / (weights + KV cache)", at["peak_memory_bytes"] / need, "<= 1.10",
                lambda v: v <= 1.10)
    return out


def ladder_table(record: dict, workload: str = "seed") -> tuple[list[str], list[list[str]]]:
    """The ladder of one record as (header, rows): each system's TTFT, decode rate and peak memory,
    and each rung's ratios to ``transformers``' generate in the same dtype (> 1: the rung is faster)."""
    systems = record["systems"]
    roof = roofline(record)
    header = ["system", "dtype", "TTFT (ms)", "decode (tok/s)", "decode vs transformers", "TTFT vs transformers",
              "% of roofline", "peak memory (GiB)"]
    rows = []
    for name, s in systems.items():
        w = s["workloads"].get(workload, {})
        if "error" in w or not w:
            rows.append([name, s["dtype"], "error" if "error" in w else "n/a"] + ["n/a"] * 5)
            continue
        base = next((b for b, bs in systems.items() if bs.get("hf_mode") == "generate" and bs["dtype"] == s["dtype"]),
                    None)
        bw = systems[base]["workloads"].get(workload, {}) if base and s["kind"] == "engine" else {}
        ok = bw and "error" not in bw
        mem = s.get("peak_memory_bytes")
        rows.append([name, s["dtype"], fmt(w["ttft_ms"]), fmt(w["decode_tok_s"]),
                     fmt(w["decode_tok_s"] / bw["decode_tok_s"], ".2f", "x") if ok else "n/a",
                     fmt(bw["ttft_ms"] / w["ttft_ms"], ".2f", "x") if ok else "n/a",
                     fmt(100 * roof[name]["fraction"], ".0f") if name in roof and workload == "seed" else "n/a",
                     fmt(mem and mem / 2**30, ".2f")])
    return header, rows


def ran_on(record: dict) -> str:
    """Which cache and step made each engine rung's tokens in this record, for a caption."""
    engines = {n: s for n, s in record["systems"].items() if s["kind"] == "engine"}
    said = {s["runs_on"] for s in engines.values() if s.get("runs_on")}
    if not said:
        return "the record does not say which cache its rungs' tokens went through (recorded before 2026-12-06)"
    forms = ", ".join(f"{n} {s['step_form']}" for n, s in engines.items() if s.get("step_form"))
    loops = {r.split(", decode_step")[0] for r in said}
    return f"engine rungs: {'; '.join(sorted(loops))}; decode_step run {forms}"


def target_value(t: dict) -> str:
    """A target's measured value as the record and chapter 08 print it: two decimals, three where two would
    print the goal's own number (1.0993 against ">= 1.1x" shows 1.099, not a missed 1.10)."""
    v = t["value"]
    if "%" in t["goal"]:
        return f"{100 * v:+.1f}%" if "growth" in t["target"] else f"{100 * v:.0f}%"
    goal = re.search(r"\d+(\.\d+)?", t["goal"])
    shown = f"{v:.2f}"
    return f"{v:.3f}" if goal and float(shown) == float(goal.group()) else shown


def _fmt_target(t: dict) -> str:
    return f"- {'met' if t['met'] else 'MISSED'}: {t['target']} = {target_value(t)} (target {t['goal']})"


def _paired_words(pr: dict, a: str, b: str) -> str:
    """'; int8 was 1.7x faster than half (paired rounds)' from every round's readings, which say
    'within noise of' when the per-round ratios straddle 1; '' for a record without them."""
    rounds = pr.get("decode_rounds")
    if not rounds or a not in rounds or b not in rounds:
        return ""
    from .timing import Samples, relation

    words = relation(Samples.rates(rounds[b]), Samples.rates(rounds[a]), paired=True)
    return f"; {b} decoded {words} {a} (per-round ratios)"


def markdown(record: dict) -> str:
    """A record as the markdown committed beside its JSON: what ran where, each system's numbers, the targets,
    and every part the run measured."""
    from .llamacpp import peer_lines

    lines = header_lines(record) + system_lines(record)
    if record.get("targets"):
        lines += ["", "## Targets (decided from this run alone)", ""] + [_fmt_target(t) for t in record["targets"]]
    lines += paired_lines(record)
    notes = [f"- {name}: {s['skipped'] if 'skipped' in s else s['note']}" for name, s in record["systems"].items()
             if "skipped" in s or "note" in s]
    if notes:
        lines += ["", "## Notes on systems", ""] + notes
    if record.get("quant_accuracy"):
        lines += quant_accuracy_lines(record["quant_accuracy"])
    if record.get("quant_perplexity"):
        from .quant_check import quant_perplexity_lines

        lines += quant_perplexity_lines(record["quant_perplexity"])
    if record.get("speculative"):
        lines += speculative_lines(record["speculative"])
    lines += peer_lines(record)
    lines += ["", "## Ratios (rung vs baseline; > 1 means the rung is faster)", ""]
    for k, v in record.get("ratios", {}).items():
        if isinstance(v, dict):
            lines.append(f"- {k}: decode {v['decode_x']:.2f}x, TTFT {v['ttft_x']:.2f}x")
        else:
            lines.append(f"- {k}: {v:.2f}" + ("x" if "/" in k else f" ({100 * v:+.1f}%)"))
    return "\n".join(lines + step_lines(record) + roofline_lines(record)) + "\n"


def header_lines(record: dict) -> list[str]:
    """The record's conditions: host, commit, versions, weights, workloads, how it was measured."""
    from .llamacpp import load_line
    from .measure import host_words

    m = record["meta"]
    lines = [f"# Benchmark: {m['model']} on {m['device_name']}", "",
             *([f"- CPU: {host_words(m)}"] if host_words(m) else []),
             f"- measured {m['timestamp']} at commit `{m['git_commit']}`, torch {m['torch']}, "
             f"transformers {m['transformers']}, preset `{m.get('preset', 'full')}`"
             + ("" if m.get("complete", True) else " (**incomplete run**: the systems below finished)"),
             f"- weights: {'real' if m['real_weights'] else 'RANDOM (speed does not depend on the values)'}; "
             f"{m['num_parameters']:,} parameters, {m['num_layers']} layers",
             "- workloads: " + "; ".join(f"{w}: {d['prompts']} prompt(s), {d['prompt_tokens']} prompt tokens, "
                                          f"{d['max_new_tokens']} new" for w, d in m["workloads"].items()),
             f"- medians of {m['repeats']} repeat(s) after a warm-up; naive systems generate fewer tokens "
             f"(their cost grows with every token). Memory: {m['memory_note']}",
             f"- tokens: {ran_on(record)}"]
    return lines + [x for x in (load_line(m), m.get("peer_skipped") and
                                f"- llama.cpp peer: skipped ({m['peer_skipped']})") if x]


def system_lines(record: dict) -> list[str]:
    lines = ["", "| system | dtype | workload | TTFT (ms) | decode (tok/s) | peak memory (GiB) |",
             "|---|---|---|---:|---:|---:|"]
    for name, s in record["systems"].items():
        mem = s.get("peak_memory_bytes")
        mem_s = f"{mem / 2**30:.2f}" if mem else "n/a"
        for w, r in s["workloads"].items():
            if "error" in r:
                lines.append(f"| {name} | {s['dtype']} | {w} | error | {r['error'][:80]} | |")
            else:
                lines.append(f"| {name} | {s['dtype']} | {w} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {mem_s} |")
    return lines


def paired_lines(record: dict) -> list[str]:
    lines = []
    for key in ("paired", "paired_int8"):
        if not record.get(key):
            continue
        pr = record[key]
        a, b = pr["stages"][:2]
        lines += ["", f"Paired: {a} and {b} ({pr['dtype']}) timed turn about, {pr['rounds']} rounds of "
                      f"{pr['new_tokens']} new tokens after a {pr['prompt_tokens']}-token prompt: {a} "
                      f"{pr['decode_tok_s'][a]:.1f} tok/s, {b} {pr['decode_tok_s'][b]:.1f} tok/s, ratio "
                      f"{pr['ratio']:.2f}" + _paired_words(pr, a, b) + "."]
    return lines


def speculative_lines(sp: dict) -> list[str]:
    lines = ["", f"## Speculative decoding ({sp['stage']} rung, {sp['dtype']}, greedy, {sp['max_new_tokens']} "
                 "new tokens)", "", "| prompt | drafter | decode (tok/s) | vs plain | accepted | tokens/forward | "
                 "same tokens |", "|---|---|---:|---:|---:|---:|---|"]
    for prompt, entry in sp["prompts"].items():
        for drafter, r in entry["runs"].items():
            acc, tpf = r.get("acceptance_rate"), r.get("tokens_per_target_forward")
            lines.append(f"| {prompt} | {drafter} | {r['decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{'n/a' if acc is None else f'{100 * acc:.0f}%'} | {'n/a' if tpf is None else f'{tpf:.2f}'}"
                         f" | {'yes' if r['matches_plain'] else 'NO'} |")
    return lines + ["", "Verify forward of k + 1 tokens, in one-token forwards: "
                    + ", ".join(f"k={k}: {v:.2f}" for k, v in sp["verify_cost"].items())]


def step_lines(record: dict) -> list[str]:
    """One decode step's time by context, per rung, with the kernels and the form it ran in."""
    contexts = record["meta"].get("step_contexts", [])
    engines = [(n, s) for n, s in record["systems"].items() if s["kind"] == "engine"]
    if not (contexts and engines):
        return []
    lines = ["", "## One decode step (ms) by context length", "",
             "| rung | " + " | ".join(str(c) for c in contexts) + " | attention kernel (decode) | step | "
             "eager ops/token (greedy, sampling) | weight matmul (decode) |",
             "|---|" + "---:|" * len(contexts) + "---|---|---|---|"]
    for name, s in engines:
        steps = s.get("step_latency_s", {})
        cells = [f"{1e3 * steps[str(c)]:.1f}" if str(c) in steps else "n/a" for c in contexts]
        ops = s.get("eager_ops_per_token", {})
        ops_s = ", ".join(f"{ops[k]:.1f}" if k in ops else "n/a" for k in ("greedy", "sampling")) if ops else "n/a"
        kernel = s.get("attention_kernels", {}).get("decode", "n/a")
        matmul = s.get("matmul_kernels", {}).get("decode", "n/a")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {kernel} | {s.get('step_form', 'n/a')} | {ops_s} "
                     f"| {matmul} |")
    return lines


def roofline_lines(record: dict) -> list[str]:
    lines = ["", f"## Roofline (measured copy bandwidth {record['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s)", "",
             "| rung | bytes/token (GB) | roofline (tok/s) | measured (tok/s) | % of roofline |",
             "|---|---:|---:|---:|---:|"]
    for name, r in record.get("roofline", {}).items():
        gb = record["systems"][name]["weight_bytes"] / 1e9
        lines.append(f"| {name} | {gb:.3f} | {r['roofline_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {100 * r['fraction']:.0f}% |")
    above = [name for name, r in record.get("roofline", {}).items() if round(100 * r["fraction"]) > 100]
    if above:  # the copy is a floor on what memory gives, not a ceiling
        lines += ["", f"Above 100% ({', '.join(above)}): a decode step only reads its weights, and a stream of reads "
                  "runs faster than a copy, whose writes first read each line they fill (the copy's bandwidth counts "
                  "its bytes once each way): on this machine the copy's figure understates what a read stream gets."]
    return lines


def quant_accuracy_lines(acc: dict) -> list[str]:
    """Markdown for ``quant_check.quant_accuracy``'s record entry."""
    n, new = acc["prompts"], acc["n_tokens"]
    ref = acc["half_vs_fp32"]
    on = f"{acc['model']}, " if acc.get("model") else ""
    lines = ["", f"## Weight-only quantization: accuracy against the half rung ({on}{n} prompts, {acc['dtype']})", "",
             f"For scale, {acc['dtype']} itself moves the first-token logits by up to {ref['max_dlogit']:.3g} from "
             "fp32.", "",
             r"| rung | max \|dlogit\| vs half | top-1 decided / disagree | vs its own dequantized weights (fp32) "
             f"| greedy tokens equal to half (mean of {new}) | all {new} equal | top-1 = half, every position |",
             "|---|---:|---|---|---:|---:|---:|"]
    if acc.get("measured"):  # added to a record after its run
        m = acc["measured"]
        lines[3:3] = [f"Measured {m['timestamp']} at commit `{m['git_commit']}`: {m['note']}.", ""]
    names = {"int8": "int8", "int4": "int4", "int4_gptq": "int4 GPTQ"}
    for mode in (k for k in names if k in acc):
        r = acc[mode]
        vs, ker = r["vs_half"], r["kernels"]
        top1 = f"{100 * r['top1']['share']:.1f}% of {r['top1']['positions']}" if "top1" in r else "n/a"
        lines.append(f"| {names[mode]} | {vs['max_dlogit']:.3g} | {len(vs['decided'])} / {len(vs['disagree'])} | "
                     rf"max \|dlogit\| {ker['max_dlogit']:.3g}, {'agrees' if ker['ok'] else 'DISAGREES'} | "
                     f"{sum(r['follow']) / len(r['follow']):.1f} | {r['full_matches']} of {n} | {top1} |")
    return lines


def chart(record: dict, path: str | Path) -> Path:

    import matplotlib.pyplot as plt

    m = record["meta"]
    names = list(record["systems"])
    fig, axes = plt.subplots(1, 3, figsize=(8, 3.6))
    for ax, (key, label, scale) in zip(axes, [("ttft_ms", "TTFT (ms)\nlower is better", 1),
                                              ("decode_tok_s", "decode (tok/s)\nhigher is better", 1),
                                              (None, "peak memory (GiB)", 2**-30)]):
        vals = []
        for n in names:
            s = record["systems"][n]
            v = s.get("peak_memory_bytes") if key is None else s["workloads"].get("seed", {}).get(key)
            vals.append((v or 0) * scale)
        kinds = {"engine": "tab:blue", "peer": "tab:orange"}
        colors = [kinds.get(record["systems"][n]["kind"], "tab:gray") for n in names]
        ax.barh(names, vals, color=colors)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
        if ax is not axes[0]:
            ax.set_yticklabels([])
    weights = "real weights" if m["real_weights"] else "RANDOM weights"
    peer = ", orange: llama.cpp" if any(s["kind"] == "peer" for s in record["systems"].values()) else ""
    fig.suptitle(f"{m['model']} ({weights}), {m['device_name']}\nblue: engine rungs, grey: transformers{peer} | "
                 f"{m['workloads']['seed']['prompts']} seed prompts, {m['workloads']['seed']['max_new_tokens']} new tokens",
                 fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
