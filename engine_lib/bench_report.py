"""Turning a benchmark record into ratios, a markdown table and a chart.

Defined in chapter 08 (results).
"""

from __future__ import annotations

from pathlib import Path


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
    steps = {n: s.get("step_latency_s", {}) for n, s in systems.items()}
    if "512" in steps.get("naive", {}) and "512" in steps.get("kv_cache", {}):
        out["naive step / kv_cache step @512"] = steps["naive"]["512"] / steps["kv_cache"]["512"]
    kv = steps.get("kv_cache", {})
    if "64" in kv and "2048" in kv:
        out["kv_cache step growth 64 -> 2048"] = kv["2048"] / kv["64"] - 1
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


def markdown(record: dict) -> str:
    m = record["meta"]
    lines = [f"# Benchmark: {m['model']} on {m['device_name']}", "",
             f"- measured {m['timestamp']} at commit `{m['git_commit']}`, torch {m['torch']}, "
             f"transformers {m['transformers']}",
             f"- weights: {'real' if m['real_weights'] else 'RANDOM (speed does not depend on the values)'}; "
             f"{m['num_parameters']:,} parameters",
             "- workloads: " + "; ".join(f"{w}: {d['prompts']} prompt(s), {d['prompt_tokens']} prompt tokens, "
                                          f"{d['max_new_tokens']} new" for w, d in m["workloads"].items()),
             f"- medians of {m['repeats']} repeat(s) after a warm-up; naive systems generate fewer tokens "
             f"(their cost grows with every token). Memory: {m['memory_note']}", "",
             "| system | dtype | workload | TTFT (ms) | decode (tok/s) | peak memory (GiB) |",
             "|---|---|---|---:|---:|---:|"]
    for name, s in record["systems"].items():
        mem = s.get("peak_memory_bytes")
        mem_s = f"{mem / 2**30:.2f}" if mem else "n/a"
        for w, r in s["workloads"].items():
            if "error" in r:
                lines.append(f"| {name} | {s['dtype']} | {w} | error | {r['error'][:80]} | |")
            else:
                lines.append(f"| {name} | {s['dtype']} | {w} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {mem_s} |")
    lines += ["", "## Ratios (rung vs baseline; > 1 means the rung is faster)", ""]
    for k, v in record["ratios"].items():
        if isinstance(v, dict):
            lines.append(f"- {k}: decode {v['decode_x']:.2f}x, TTFT {v['ttft_x']:.2f}x")
        else:
            lines.append(f"- {k}: {v:.2f}" + ("x" if "/" in k else f" ({100 * v:.1f}%)"))
    lines += ["", f"## Roofline (measured copy bandwidth {record['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s)", "",
              "| rung | bytes/token (GB) | roofline (tok/s) | measured (tok/s) | % of roofline |", "|---|---:|---:|---:|---:|"]
    for name, r in record["roofline"].items():
        gb = record["systems"][name]["weight_bytes"] / 1e9
        lines.append(f"| {name} | {gb:.3f} | {r['roofline_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {100 * r['fraction']:.0f}% |")
    return "\n".join(lines) + "\n"


def chart(record: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = record["meta"]
    names = list(record["systems"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (key, label, scale) in zip(axes, [("ttft_ms", "TTFT, seed prompts (ms, lower is better)", 1),
                                              ("decode_tok_s", "decode, seed prompts (tok/s, higher is better)", 1),
                                              (None, "peak memory (GiB)", 2**-30)]):
        vals = []
        for n in names:
            s = record["systems"][n]
            v = s.get("peak_memory_bytes") if key is None else s["workloads"].get("seed", {}).get(key)
            vals.append((v or 0) * scale)
        colors = ["tab:blue" if record["systems"][n]["kind"] == "engine" else "tab:gray" for n in names]
        ax.barh(names, vals, color=colors)
        ax.set_title(label, fontsize=10)
        ax.invert_yaxis()
    weights = "real weights" if m["real_weights"] else "RANDOM weights"
    fig.suptitle(f"{m['model']} ({weights}) on {m['device_name']} | blue: engine rungs, grey: transformers "
                 f"| {m['workloads']['seed']['prompts']} seed prompts, {m['workloads']['seed']['max_new_tokens']} new tokens",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
