"""Chapter 08's and the CPU appendix's CPU figures: the engine beside llama.cpp at the real model's depth.

Reads the committed full-depth records (``python -m engine_lib.bench.cpu_depth``, ``<name>.depth.json``): every
system started in a process of its own and timed from its launch, its peak memory the operating system's count
(see ``bench/cpu_depth.py``). It turns them into tables, sentences and a figure. Which rung a reader without a
GPU should run is decided from the record: the fastest decode among the rungs, and llama.cpp named instead when
one of its files decodes faster still. Nothing here is typed in: every number comes from a record.
"""

from __future__ import annotations

# each pair of figures: the rung's / llama.cpp's (seven columns: the book's text column holds no more)
PAIR_HEADER = ["rung / llama.cpp", "decode tok/s", "decode x (spread)", "TTFT ms", "TTFT x", "peak RSS GiB",
               "first token s"]
SYSTEM_HEADER = ["system", "load s", "first token from launch s", "TTFT ms", "decode tok/s", "peak RSS GiB",
                 "first start: load s / peak RSS GiB"]
BITS = {"half": 16, "fused": 16, "int8": 8, "int4": 4}


def machine(record: dict) -> tuple[str, str | None]:
    """Which machine a record ran on: its ``device_name`` (the CPU's vector instructions change the answer,
    AVX2 against AVX-512 and AMX) and its CPU model (two hosts held to the same instructions still differ)."""
    return record["meta"]["device_name"], record["meta"].get("cpu_model")


def newest_per_machine(records: list[dict]) -> list[dict]:
    """The newest full-depth record of each machine (``machine``), newest first."""
    seen, out = set(), []
    for r in sorted(records, key=lambda r: r["meta"]["timestamp"], reverse=True):
        if machine(r) not in seen:
            seen.add(machine(r))
            out.append(r)
    return out


def _best(record: dict, name: str, key: str) -> float:
    from ..bench.cpu_depth import best

    return best(record["systems"][name], key)[0]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def system_rows(record: dict) -> list[list[str]]:
    """One row per system: its best later start (load, first token from launch, TTFT, decode, peak RSS), and its
    first start's load and peak (where the quantized rungs quantize and save)."""
    from ..bench.cpu_depth import best

    rows = []
    for name, s in record["systems"].items():
        if best(s, "decode_tok_s") is None:
            rows.append([name] + ["failed"] * (len(SYSTEM_HEADER) - 1))
            continue
        first = s.get("first_start") or {}
        rows.append([name, f"{best(s, 'load_s')[0]:.1f}", f"{best(s, 'first_token_s')[0]:.1f}",
                     f"{best(s, 'ttft_ms')[0]:.0f}", f"{best(s, 'decode_tok_s')[0]:.1f}",
                     _gib(best(s, "peak_rss_bytes")[0]),
                     f"{first['load_s']:.1f} / {_gib(first['peak_rss_bytes'])}" if "load_s" in first else "failed"])
    return rows


def _pair(record: dict, rung: str, peer: str, key: str, fmt: str, scale: float = 1.0) -> str:
    """'<the rung's figure> / <llama.cpp's>', each its best later start."""
    return f"{_best(record, rung, key) * scale:{fmt}} / {_best(record, peer, key) * scale:{fmt}}"


def peer_rows(record: dict) -> list[list[str]]:
    """One row per (rung, llama.cpp file) pair of the same width, best against best: each pair of figures the
    rung's / llama.cpp's, the ratios above 1 where the rung is ahead (the decode ratio with its spread)."""
    rows = []
    for v in record.get("ratios", []):
        r, p = f"engine:{v['rung']}", f"llama.cpp:{v['peer']}"
        lo, hi = v["decode_x_range"]
        rows.append([f"{v['rung']} / {v['peer']}", _pair(record, r, p, "decode_tok_s", ".1f"),
                     f"{v['decode_x']:.2f}x ({lo:.2f}-{hi:.2f})", _pair(record, r, p, "ttft_ms", ".0f"),
                     f"{v['ttft_x']:.2f}x", _pair(record, r, p, "peak_rss_bytes", ".2f", 2**-30),
                     _pair(record, r, p, "first_token_s", ".1f")])
    return rows


def caption(record: dict) -> str:
    m = record["meta"]
    held = " held to AVX2" if m.get("held_to") else ""
    weights = "random weights (timings only)" if m.get("checkpoint") else "real weights"
    return (f"{m['model']} ({m['layers']} layers, {weights}) on {m['cpu_model'] or 'an unnamed CPU'}{held}, "
            f"{m['device_name']}, {m['threads']} threads for every system; each system started fresh in its own "
            f"process, best of {m['rounds']} later starts; greedy, {m['new_tokens']} new tokens on each of the "
            f"first {m['prompts']} seed prompts; {record['file']}, {m['timestamp'][:10]}.")


def best_pairs(record: dict) -> list[dict]:
    """Per weight width, widest first, the pair whose rung leads its llama.cpp file by the least: a width is only
    ahead if it is ahead of every file of its width."""
    pairs = record.get("ratios", [])
    return [min((v for v in pairs if BITS[v["rung"]] == bits), key=lambda v: v["decode_x"])
            for bits in sorted({BITS[v["rung"]] for v in pairs}, reverse=True)]


def advice(record: dict) -> list[str]:
    """Sentences from one record: how each width compares, what it holds, and which system to run on this CPU."""
    if not record.get("ratios"):
        return ["This record has no rung timed beside a llama.cpp file of its width."]
    out = []
    for v in best_pairs(record):
        first = (f"came {v['ttft_x']:.2f}x as fast" if v["ttft_x"] >= 1
                 else f"took {1 / v['ttft_x']:.2f}x as long as llama.cpp's")
        out.append(f"At {BITS[v['rung']]} bits, the {v['rung']} rung decoded at {v['decode_x']:.2f}x llama.cpp's "
                   f"{v['peer']} (spread {v['decode_x_range'][0]:.2f}-{v['decode_x_range'][1]:.2f}), its first "
                   f"token {first}, and it held {v['rss_x']:.2f}x llama.cpp's peak memory.")
    rates = {n: _best(record, n, "decode_tok_s") for n in record["systems"]
             if n.startswith(("engine:", "llama.cpp:")) and record["systems"][n]["rounds"]
             and "error" not in record["systems"][n]["rounds"][0]}
    rungs = sorted((n for n in rates if n.startswith("engine:")), key=rates.get, reverse=True)
    peers = sorted((n for n in rates if n.startswith("llama.cpp:")), key=rates.get, reverse=True)
    if not rungs or not peers:
        return out
    top, top_peer = rungs[0], peers[0]
    line = (f"The fastest rung here was {top.split(':')[1]} at {rates[top]:.1f} tokens/s; llama.cpp's fastest file "
            f"was {top_peer.split(':')[1]} at {rates[top_peer]:.1f}.")
    if rates[top] >= rates[top_peer]:
        line += f" Without a GPU, on a CPU like this one, run the {top.split(':')[1]} rung."
    else:
        line += (f" On a CPU like this one llama.cpp's {top_peer.split(':')[1]} is the faster choice "
                 f"({rates[top_peer] / rates[top]:.2f}x); of this engine's rungs, use {top.split(':')[1]}.")
    return out + [line]


def peer_chart(records: list[dict]):
    """One row of bars per record (a kind of CPU): each rung's decode rate over each llama.cpp file of its width
    (above 1: the rung is faster), with the spread as a line. -> a matplotlib figure."""
    import matplotlib.pyplot as plt

    pairs = [f"{v['rung']} / {v['peer']}" for v in records[0].get("ratios", [])] if records else []
    fig, ax = plt.subplots(figsize=(6.8, 1.0 + 0.32 * max(len(pairs), 1) * len(records)))
    y = 0
    ticks, labels = [], []
    for rec in records:
        for v in rec.get("ratios", []):
            lo, hi = v["decode_x_range"]
            color = "tab:green" if v["decode_x"] >= 1.1 else "tab:orange" if v["decode_x"] >= 1 else "tab:red"
            ax.barh(y, v["decode_x"], 0.7, color=color)
            ax.plot([lo, hi], [y, y], color="black", linewidth=1)
            ticks.append(y)
            labels.append(f"{v['rung']} / {v['peer']}" + (f" ({machine(rec)[1]})" if len(records) > 1 else ""))
            y += 1
        y += 0.5
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvline(1.1, color="gray", linewidth=1, linestyle="--")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode rate, rung / llama.cpp at the same width (best of the later starts; line: spread)",
                  fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
