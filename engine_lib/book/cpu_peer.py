"""Chapter 08's CPU section: the engine's rungs beside llama.cpp at the same weight width.

Reads the bench records that timed llama.cpp in the same run (``python -m engine_lib bench --peer
llama.cpp``: their ``peer_ratios``, see ``bench/llamacpp.py``) and turns them into a table and
sentences. Which rung a reader without a GPU should use is decided from the record: the fastest
decode among the rungs, and llama.cpp named instead when one of its files decodes faster still.
Nothing here is typed in: every number comes from a record.
"""

from __future__ import annotations

HEADER = ["bits", "rung", "llama.cpp", "decode tok/s (rung / llama.cpp)", "rung's decode x (spread)",
          "TTFT ms (rung / llama.cpp)", "llama.cpp TTFT / rung's"]


def peer_records(records: list[dict]) -> list[dict]:
    """The records in which llama.cpp was timed beside the rungs, newest first."""
    with_peer = [r for r in records if r.get("peer_ratios")]
    return sorted(with_peer, key=lambda r: r["meta"]["timestamp"], reverse=True)


def machine(record: dict) -> tuple[str, str | None]:
    """Which machine a record ran on: its ``device_name`` (the CPU's vector instructions change the answer,
    AVX2 against AVX-512 and AMX) and its CPU model where the record names it (two hosts held to the same
    instructions still differ in memory speed)."""
    return record["meta"]["device_name"], record["meta"].get("cpu_model")


def newest_per_machine(records: list[dict]) -> list[dict]:
    """The newest peer record of each machine (``machine``), newest first."""
    seen, out = set(), []
    for r in peer_records(records):
        if machine(r) not in seen:
            seen.add(machine(r))
            out.append(r)
    return out


def _seed(record: dict) -> list[dict]:
    return [v for v in record["peer_ratios"].values() if v["workload"] == "seed"]


def peer_rows(record: dict) -> list[list[str]]:
    """One row per (rung, llama.cpp file) pair of the same width, on the seed prompts."""
    from ..bench.llamacpp import readings

    rows = []
    for v in _seed(record):
        rd, pd, rt, pt = readings(record, v)  # where the pair was timed turn about, those rounds' medians
        lo, hi = v["decode_x_range"]
        rows.append([str(v["bits"]), f"{v['rung']} ({record['systems'][v['rung']]['dtype']})",
                     record["systems"][v["peer"]]["peer"], f"{rd:.1f} / {pd:.1f}",
                     f"{v['decode_x']:.2f}x ({lo:.2f}-{hi:.2f})", f"{rt:.0f} / {pt:.0f}", f"{v['ttft_x']:.2f}x"])
    return rows


def caption(record: dict) -> str:
    from ..bench.measure import host_words

    m = record["meta"]
    weights = "real weights" if m.get("real_weights") else "random weights (timings only)"
    peer = next(s for s in record["systems"].values() if s["kind"] == "peer" and "threads" in s)
    turns = next(iter(record.get("peer_paired", {}).values()), None)
    how = (f", each rung and its llama.cpp file answering them in turn ({turns['rounds']} rounds, "
           f"{turns['new_tokens']} new tokens)") if turns and any(v.get("paired") for v in _seed(record)) else ""
    cpu = f" ({host_words(m) or 'CPU model not recorded'})"
    return (f"{m['model']}, {weights}, {m['device_name']}{cpu}, {peer['threads']} threads for both, greedy, the seed "
            f"prompts{how}; {record['file']}, {m['timestamp'][:10]}. Ratios above 1: the rung is faster.")


def advice(record: dict) -> list[str]:
    """Sentences from one record: how each width compares, and which to run on this CPU."""
    systems = record["systems"]
    pairs = _seed(record)
    if not pairs:
        return ["This record has no seed-prompt pair of a rung and llama.cpp at the same width."]

    def rate(name: str) -> float:
        return systems[name]["workloads"]["seed"]["decode_tok_s"]

    out = []
    for best in best_pairs(record):
        bits = best["bits"]
        x = best["ttft_x"]  # llama.cpp's TTFT / the rung's: above 1, the rung's first token came sooner
        first = f"came {x:.2f}x as fast" if x >= 1 else f"took {1 / x:.2f}x as long as llama.cpp's"
        out.append(f"At {bits} bits, the {best['rung']} rung decoded {best['decode_words']} llama.cpp's "
                   f"{systems[best['peer']]['peer']} ({best['decode_x']:.2f}x), and its first token {first}.")
    rungs = sorted({v["rung"] for v in pairs}, key=rate, reverse=True)
    peers = sorted({v["peer"] for v in pairs}, key=rate, reverse=True)
    top, top_peer = rungs[0], peers[0]
    # each system's own run ranks them all; the table's turn-about figures pair one rung with one file
    alone = ", each timed alone," if any(v.get("paired") for v in pairs) else ""
    line = (f"The fastest rung here{alone} was {top} at {rate(top):.1f} tokens/s; llama.cpp's fastest file was "
            f"{systems[top_peer]['peer']} at {rate(top_peer):.1f}.")
    pair = next((v for v in pairs if v["rung"] == top and v["peer"] == top_peer), None)
    if pair is not None and pair["decode_x_range"][0] < 1 < pair["decode_x_range"][1]:  # the spread straddles 1
        lo, hi = pair["decode_x_range"]
        line += (f" Without a GPU, run the {top} rung or llama.cpp's {systems[top_peer]['peer']}: they decoded within"
                 f" noise of each other ({pair['decode_x']:.2f}x, spread {lo:.2f}-{hi:.2f}), faster than the rest.")
    elif rate(top) >= rate(top_peer):
        line += f" Without a GPU, run the {top} rung: on this CPU it is the fastest of all."
    else:
        line += (f" To run a model on a CPU like this one, llama.cpp's {systems[top_peer]['peer']} is the faster"
                 f" choice ({rate(top_peer) / rate(top):.2f}x the {top} rung); of this engine's rungs, use {top}.")
    out.append(line)
    return out


def best_pairs(record: dict) -> list[dict]:
    """Per weight width, widest first, the seed-prompt pair whose rung leads llama.cpp most (the table's rows)."""
    pairs = _seed(record)
    return [max((v for v in pairs if v["bits"] == bits), key=lambda v: v["decode_x"])
            for bits in sorted({v["bits"] for v in pairs}, reverse=True)]


def peer_chart(records: list[dict]):
    """One row of bars per record (a kind of CPU): at each width, the best rung's decode rate over its llama.cpp
    file's, the table's "rung's decode x" (above 1: the rung is faster). -> a matplotlib figure."""
    import matplotlib.pyplot as plt

    widths = sorted({v["bits"] for rec in records for v in best_pairs(rec)}, reverse=True)
    colors = dict(zip(widths, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    fig, ax = plt.subplots(figsize=(6.8, 0.9 + 0.75 * len(records)))
    step = 0.8 / max(len(widths), 1)
    for row, rec in enumerate(records):
        for v in best_pairs(rec):
            y = row - 0.4 + step * (widths.index(v["bits"]) + 0.5)
            ax.barh(y, v["decode_x"], step, color=colors[v["bits"]],
                    label=f"{v['bits']} bits" if row == 0 else None)
    ax.axvline(1.0, color="black", linewidth=1)
    names = [rec["meta"]["device_name"].removeprefix("CPU (x86_64, ").removesuffix(")") for rec in records]
    ax.set_yticks(range(len(records)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode rate, best rung / llama.cpp at the same width (seed prompts)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
