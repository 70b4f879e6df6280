"""Figures of the book's ideas, drawn from code: every number on them comes from a config or a record.

Each function returns a matplotlib ``Figure`` (never shown here), at most 8 inches wide.

- ``gqa_diagram``: defined in chapter 03 (attention), query heads sharing K/V heads.
- ``decoder_diagram``: defined in chapter 04 (the whole model), the decoder with its tensor shapes.
- ``kv_cache_diagram``: defined in chapter 05 (the KV cache), what the buffers hold, where the next token goes.
- ``prefill_decode_timeline``: defined in chapter 00, reused in 05: one parallel prefill, one forward per token.
- ``roofline_points`` / ``roofline_plot``: defined in chapter 00, reused in 08 (results): measured prefill
  and decode against the T4 and H200 datasheet rooflines.
"""

from __future__ import annotations

import statistics
import textwrap
from typing import TYPE_CHECKING, NamedTuple

from ..cache.contiguous import kv_bytes_per_token
from ..model.config import Qwen2Config

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FONT = 10  # the smallest size used: figures are drawn at the column's width (book.COLUMN_IN) and shown unscaled


class Roof(NamedTuple):
    name: str
    peak_flops: float  # FLOP/s
    bandwidth: float  # bytes/s

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which the peak FLOP/s, not bandwidth, is the limit."""
        return self.peak_flops / self.bandwidth


# NVIDIA T4 datasheet: 65 TFLOP/s mixed-precision (FP16) tensor-core peak, 320 GB/s GDDR6.
T4 = Roof("T4", 65e12, 320e9)
# NVIDIA H200 datasheet (SXM): 1,979 TFLOP/s BF16 tensor core *with sparsity*, so 989 dense; 4.8 TB/s HBM3e.
H200 = Roof("H200", 989e12, 4.8e12)
ROOFS = (T4, H200)


def _figure(width: float, height: float):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height))
    return fig, ax


def _box(ax, x: float, y: float, w: float, h: float, text: str, fill: str = "white", **kw) -> None:
    """A rounded box centred on (x, y)."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=fill, ec="black", lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=kw.pop("fontsize", FONT + 1), **kw)


def _arrow(ax, x0: float, y0: float, x1: float, y1: float, **kw) -> None:
    ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="-|>", color=kw.pop("color", "black"), lw=1.2,
                                                        shrinkA=0, shrinkB=0, **kw))


def decoder_diagram(cfg: Qwen2Config) -> Figure:
    """The Qwen2 decoder, top to bottom, with the shape of the tensor on every arrow."""
    h, i, d, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv, v = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
    fig, ax = _figure(7.5, 9.2)
    cx, bw, gap = 4.6, 5.2, 0.62  # column centre, box width, arrow length
    hid = f"(seq, {h})"
    y = 16.0
    centres = {}

    def step(name, text, shape, height=0.6, color="white"):
        """A box below the last one, then the arrow that leaves it, labelled with its output shape."""
        nonlocal y
        y -= height / 2
        _box(ax, cx, y, bw, height, text, color)
        centres[name] = y
        y -= height / 2
        if shape:
            _arrow(ax, cx, y, cx, y - gap)
            ax.text(cx + 0.12, y - gap / 2, shape, fontsize=FONT, va="center", color="dimgray")
            y -= gap

    def residual(top, label):
        """The skip connection: from the arrow above a sub-block around it into the add."""
        nonlocal y
        y -= 0.22
        ax.plot(cx, y, "o", ms=17, mfc="white", mec="black")
        ax.text(cx, y, "+", ha="center", va="center", fontsize=FONT + 4)
        xs = cx - bw / 2 - 0.35
        ax.plot([cx, xs, xs], [top, top, y], color="tab:blue", lw=1.2)
        _arrow(ax, xs, y, cx - 0.2, y, color="tab:blue")
        ax.text(cx + 0.3, y, label, fontsize=FONT, va="center", color="tab:blue")
        y -= 0.22
        _arrow(ax, cx, y, cx, y - gap)
        ax.text(cx + 0.12, y - gap / 2, hid, fontsize=FONT, va="center", color="dimgray")
        y -= gap

    step("ids", "token ids", "(seq,)", color="whitesmoke")
    step("embed", f"embedding  {v:,} × {h:,}", hid, color="#fde9c9")
    layer_top, branch = y + gap * 0.85, y + gap / 2  # the band's edges clear the shape labels
    step("norm1", "RMSNorm", hid)
    step("attn", f"grouped-query attention, RoPE on q and k\nq: {q} heads × {d}   k, v: {kv} heads × {d}\n"
                 f"q/k/v projections with bias, o: {q * d:,} → {h:,}", None, height=1.15, color="#dbe9f6")
    residual(branch, "residual add")
    mid = y + gap / 2
    step("norm2", "RMSNorm", hid)
    step("mlp", f"SwiGLU MLP\ngate, up: {h:,} → {i:,}   down: {i:,} → {h:,}", None, height=0.85, color="#dff0d8")
    residual(mid, "residual add")
    layer_bottom = y + gap * 0.15
    step("final", "final RMSNorm", hid)
    step("head", f"LM head{' (tied)' if cfg.tie_word_embeddings else ''}  {h:,} × {v:,}", f"(seq, {v})", color="#fde9c9")
    step("logits", "logits: one score per vocabulary entry", None, color="whitesmoke")

    # the repeated layer: a shaded band and a bracket with the count
    from matplotlib.patches import Rectangle
    ax.add_patch(Rectangle((cx - bw / 2 - 0.6, layer_bottom), bw + 1.2, layer_top - layer_bottom,
                           fc="0.95", ec="0.6", ls="--", zorder=0))
    xb = cx - bw / 2 - 0.85
    ax.plot([xb + 0.15, xb, xb, xb + 0.15], [layer_top, layer_top, layer_bottom, layer_bottom], color="black")
    ax.text(xb - 0.15, (layer_top + layer_bottom) / 2, f"× {L} layers", rotation=90, ha="right", va="center",
            fontsize=FONT + 3, fontweight="bold")

    # tied embeddings: the LM head multiplies by the embedding matrix, transposed
    xt = cx + bw / 2 + 0.9
    tie = "same matrix (tied), used transposed" if cfg.tie_word_embeddings else "separate matrices (not tied)"
    ax.plot([cx + bw / 2, xt, xt, cx + bw / 2], [centres["embed"], centres["embed"], centres["head"], centres["head"]],
            ls="--", color="tab:orange", lw=1.5)
    ax.text(xt + 0.12, (centres["embed"] + centres["head"]) / 2, tie, rotation=90, ha="left", va="center",
            fontsize=FONT + 1, color="tab:orange")
    ax.set(xlim=(0.6, xt + 0.7), ylim=(y - 0.1, 16.1))
    ax.axis("off")
    ax.set_title(f"The Qwen2 decoder: {L} layers, hidden size {h:,}, vocabulary {v:,}", fontsize=FONT + 3)
    fig.tight_layout()
    return fig


def prefill_decode_timeline(prompt_tokens: int, ttft_s: float, step_s: float, new_tokens: int, label: str,
                            max_steps: int = 24) -> Figure:
    """One prefill forward over the whole prompt, then one decode forward per further token, in measured ms."""
    fig, ax = _figure(8, 2.9)
    ttft, step = 1e3 * ttft_s, 1e3 * step_s
    steps = max(new_tokens - 1, 0)
    shown = min(steps, max_steps)
    ax.broken_barh([(0, ttft)], (0, 1), fc="tab:orange", ec="black")
    ax.broken_barh([(ttft + k * step, step) for k in range(shown)], (0, 1), fc="tab:blue", ec="white",
                   lw=1 if step > 0.004 * (ttft + shown * step) else 0.2)  # thin blocks: thin gaps
    end = ttft + shown * step
    if shown < steps:  # the rest would only stretch the axis: say how many and when they end
        ax.text(end + 0.01 * end, 0.5, f"… {steps - shown} more steps\n(done at {ttft + steps * step:,.0f} ms)",
                va="center", fontsize=FONT)
        end *= 1.2

    def bracket(x0, x1, y, tick, text, ha):
        ax.plot([x0, x0, x1, x1], [y - tick, y, y, y - tick], color="black", lw=0.9)
        ax.text({"left": x0, "right": x1}[ha], y + 2 * tick, text, ha=ha, va="bottom" if tick > 0 else "top", fontsize=FONT)

    bracket(0, ttft, 1.15, 0.1, f"prefill: {prompt_tokens} positions in one forward\n(first token after {ttft:,.0f} ms)",
            "left")
    if shown:  # right-align under a prefill that takes most of the width, so the text stays inside
        bracket(ttft, ttft + shown * step, -0.15, -0.1, f"decode: one position per forward\n{step:,.1f} ms each "
                f"({1e3 / step:,.1f} tok/s)", "left" if ttft < 0.5 * end else "right")
    ax.set(xlim=(0, end * 1.02), ylim=(-1.1, 2.1), yticks=[], xlabel="time since the prompt arrived (ms)")
    ax.tick_params(labelsize=FONT)
    ax.xaxis.label.set_size(FONT)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"Prefill then decode, {new_tokens} new tokens: {label}", fontsize=FONT + 2)
    fig.tight_layout()
    return fig


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" or n == int(n) else f"{n:,.1f} {unit}"
        n /= 1024


DTYPE_NAMES = {4: "fp32", 2: "bf16", 1: "int8"}


def kv_cache_text(cfg: Qwen2Config, bytes_per_element: int = 2) -> str:
    """'2 (K and V) × layers × kv heads × head_dim × bytes = N per token', computed from the config."""
    per_token = kv_bytes_per_token(cfg, bytes_per_element)
    dtype = DTYPE_NAMES.get(bytes_per_element, f"{bytes_per_element}-byte elements")
    return (f"2 (K and V) × {cfg.num_hidden_layers} layers × {cfg.num_key_value_heads} kv heads × {cfg.head_dim} × "
            f"{bytes_per_element} bytes = {_size(per_token)} per token in {dtype}")


def kv_cache_diagram(cfg: Qwen2Config, max_len: int = 16, filled: int = 9, bytes_per_element: int = 2,
                     batch: int = 1) -> Figure:
    """Per layer one K and one V buffer (batch, kv_heads, max_len, head_dim); each cell is one head_dim vector."""
    from matplotlib.patches import Rectangle

    if not 0 <= filled < max_len <= 32:
        raise ValueError(f"need 0 <= filled < max_len <= 32 (a diagram, not a dump); got {filled=}, {max_len=}")
    L, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    layers = list(range(L)) if L <= 4 else [0, 1, None, L - 1]  # None: the elided middle
    # layout in cells; the label column, the K-V gap and the margins keep their inches whatever the cell size
    width = 2 * max_len / (1 - (1.1 + 0.4 + 0.25) / 8)
    x0_in, x_k = 0.1 / 8 * width, 1.1 / 8 * width
    x_v = x_k + max_len + 0.4 / 8 * width
    row_h = kvh + 1.6
    cell_in = 8 / width
    height_cells = (len(layers) - 1) * row_h + kvh + 1.2  # grids plus the slot numbers on top
    top_in, bottom_in = 1.0, 0.75  # title + arrow, and three lines of text
    fig, ax = _figure(8, top_in + height_cells * cell_in + bottom_in)
    H = fig.get_figheight()
    ax.set_position([0, bottom_in / H, 1, height_cells * cell_in / H])
    for r, layer in enumerate(layers):
        y0 = -r * row_h
        if layer is None:
            for x0 in (x_k, x_v):
                ax.text(x0 + max_len / 2, y0 + kvh / 2 + 0.3, "⋮", ha="center", va="center", fontsize=FONT + 8)
            ax.text(x0_in, y0 + kvh / 2, f"layers 2 … {L - 2}", va="center", fontsize=FONT + 1, color="dimgray")
            continue
        ax.text(x0_in, y0 + kvh / 2, f"layer {layer}", va="center", fontsize=FONT + 1)
        for x0, name in ((x_k, "K"), (x_v, "V")):
            ax.text(x0 - 0.3, y0 + kvh / 2, name, ha="right", va="center", fontsize=FONT + 1, fontweight="bold")
            for head in range(kvh):
                for s in range(max_len):
                    fc = "tab:blue" if s < filled else ("tab:orange" if s == filled else "white")
                    ax.add_patch(Rectangle((x0 + s, y0 + kvh - 1 - head), 1, 1, fc=fc, ec="0.4", lw=0.6,
                                           alpha=0.55 if s < filled else 1))
    top = kvh + 0.15
    ax.text(x0_in, top, "slot →", fontsize=FONT, color="dimgray", va="bottom")
    for x0 in (x_k, x_v):
        for s in sorted({0, filled, max_len - 1}):
            ax.text(x0 + s + 0.5, top, str(s), ha="center", va="bottom", fontsize=FONT)
    # the text starts over slot 0 and is wider than the grid, so a vertical arrow from it reaches any slot
    ax.annotate(f"the next token's k/v go here: slot = filled = {filled}", (x_k, top + 1.1), (0, 20),
                textcoords="offset points", va="bottom", fontsize=FONT + 1, color="tab:orange", annotation_clip=False)
    ax.annotate("", (x_k + filled + 0.5, top + 1.1), (0, 19), textcoords="offset points", annotation_clip=False,
                arrowprops=dict(arrowstyle="-|>", color="tab:orange", shrinkA=0, shrinkB=0))
    written = "none yet" if filled == 0 else f"slots 0 … {filled - 1}" if filled > 1 else "slot 0"
    fig.text(0.1 / 8, bottom_in / H - 0.05 / H, f"each buffer: (batch={batch}, kv_heads={kvh}, max_len={max_len}, "
             f"head_dim={cfg.head_dim}); one row per kv head, one cell = {cfg.head_dim} values\nblue: written ({written}), "
             f"orange: next, white: allocated, not yet written\n" + kv_cache_text(cfg, bytes_per_element),
             va="top", fontsize=FONT)
    ax.set(xlim=(0, width), ylim=(y0 - 0.1, top + 1.1))
    ax.axis("off")
    fig.suptitle(f"What the KV cache holds: {L} layers × (K, V), {filled} of {max_len} slots filled", fontsize=FONT + 2,
                 y=1 - 0.08 / H, va="top")
    return fig


def gqa_diagram(cfg: Qwen2Config) -> Figure:
    """Query heads drawn as boxes, in groups that each read one shared K/V head."""
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    g = q // kv
    fig, ax = _figure(8, 3.2)
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:olive", "tab:cyan", "tab:pink"]
    span = q + (kv - 1) * 0.6  # boxes one unit apart, a small gap between groups
    for j in range(kv):
        c = colors[j % len(colors)]
        xs = [j * (g + 0.6) + k + 0.5 for k in range(g)]
        xm = sum(xs) / g
        _box(ax, xm, 0, min(g * 0.75, 3.2), 0.55, f"K/V head {j}", c, color="white", fontsize=FONT + 1)
        for k, x in enumerate(xs):
            _box(ax, x, 2, 0.82, 0.55, f"q{j * g + k}", "white", fontsize=FONT + 1)
            _arrow(ax, x, 1.7, xm + (x - xm) * 0.15, 0.3, color=c)
    ax.text(span / 2, -0.75, f"{g} query heads share one K/V head: the cache is {g}x smaller than with one K/V per query "
                             f"head", ha="center", fontsize=FONT + 1)
    ax.text(span / 2, 2.55, f"{q} query heads × {cfg.head_dim}", ha="center", fontsize=FONT + 1)
    ax.set(xlim=(-0.2, span + 0.2), ylim=(-1.1, 2.9))
    ax.axis("off")
    ax.set_title(f"Grouped-query attention: {q} query heads, {kv} key/value heads", fontsize=FONT + 2)
    fig.tight_layout()
    return fig


def _usable(w: dict | None, key: str) -> bool:
    v = (w or {}).get(key)
    return w is not None and "error" not in w and isinstance(v, (int, float)) and v == v and v > 0  # v == v: not NaN


def roofline_points(record: dict) -> list[dict]:
    """Two roofline points (decode, prefill) per engine rung of one benchmark record.

    Model FLOPs are approximated as 2 × parameters per token (one multiply-add per weight); this
    ignores attention's own FLOPs (scores and weighted sum), small at these prompt lengths.
    Decode (seed workload): every weight read once per token at batch 1, so bytes/token = weight_bytes,
    attained FLOP/s = 2 × params × decode tok/s. Prefill (``long`` workload, else ``seed``): the weights are
    read once for the whole prompt, so FLOPs = 2 × params × prompt tokens (median prompt, as TTFT is a
    median), bytes ≈ weight_bytes, attained FLOP/s = FLOPs / TTFT. Errored or NaN workloads are skipped.
    """
    meta = record["meta"]
    flops_tok = 2 * meta["num_parameters"]
    points = []
    for rung, s in record["systems"].items():
        if s.get("kind") != "engine":
            continue
        base = {"rung": rung, "device_name": meta["device_name"], "dtype": s["dtype"],
                "real_weights": meta["real_weights"]}
        wl = s.get("workloads", {})
        if _usable(wl.get("seed"), "decode_tok_s"):
            points.append({**base, "phase": "decode", "intensity": flops_tok / s["weight_bytes"],
                           "flops_per_s": flops_tok * wl["seed"]["decode_tok_s"]})
        pre = next((wl[n] for n in ("long", "seed") if _usable(wl.get(n), "ttft_ms")), None)
        if pre is not None:
            flops = flops_tok * statistics.median(pre["prompt_tokens"])
            points.append({**base, "phase": "prefill", "intensity": flops / s["weight_bytes"],
                           "flops_per_s": flops / (pre["ttft_ms"] / 1e3)})
    return points


def roofline_plot(records: list[dict], title: str | None = None) -> Figure:
    """Log-log roofline: T4 and H200 roofs from datasheets, and every record's measured points."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, (ax, key) = plt.subplots(2, 1, figsize=(6.8, 8.4), gridspec_kw={"height_ratios": [3, 1.45]})
    key.axis("off")  # the legend's own panel, under the plot: grouped by who measured what
    all_points = [roofline_points(r) for r in records]
    xs = [p["intensity"] for pts in all_points for p in pts] + [r.ridge for r in ROOFS]
    lo, hi = min(xs) / 4, max(max(xs) * 8, 300 * max(r.ridge for r in ROOFS))  # room for the ridge labels
    handles = []
    for roof, c in zip(ROOFS, ("tab:gray", "black")):
        ax.plot([lo, roof.ridge, hi], [roof.bandwidth * lo, roof.peak_flops, roof.peak_flops], color=c, lw=1.6)
        ax.plot(roof.ridge, roof.peak_flops, "o", color=c, ms=5)  # labels sit under points, over lines
        ax.annotate(f"{roof.name} ridge: ~{roof.ridge:.0f} FLOP/B", (roof.ridge, roof.peak_flops), (4, -5),
                    textcoords="offset points", fontsize=FONT, va="top",
                    bbox=dict(fc="white", ec="none", pad=1), zorder=3)
        handles.append(Line2D([], [], color=c, lw=1.6, label=f"{roof.name}: {roof.peak_flops / 1e12:.0f} TFLOP/s, "
                                                             f"{roof.bandwidth / 1e9:,.0f} GB/s"))
    rungs = list(dict.fromkeys(p["rung"] for pts in all_points for p in pts))
    colors = {r: f"C{k}" for k, r in enumerate(rungs)}
    markers, fills, dashes = {"decode": "o", "prefill": "s"}, ("full", "none", "left", "bottom"), (":", "-.", "--")
    handles.insert(0, Line2D([], [], ls="", label="datasheet roofs (GPU)"))
    by_device: dict[str, list[Line2D]] = {}  # the legend is grouped by the device that measured
    for k, (record, pts) in enumerate(zip(records, all_points)):
        fill, ls = fills[k % len(fills)], dashes[k % len(dashes)]
        for p in pts:
            ax.plot(p["intensity"], p["flops_per_s"], markers[p["phase"]], color=colors[p["rung"]], fillstyle=fill,
                    ms=8, mew=1.5, zorder=4)
        m = record["meta"]
        bw = record.get("copy_bandwidth_bytes_s")
        weights = "real weights" if m["real_weights"] else "random weights"
        group = by_device.setdefault(m["device_name"], [])
        group.append(Line2D([], [], ls="", marker="o", color="0.3", fillstyle=fill, ms=8, mew=1.5,
                            label=textwrap.fill(f"{m.get('model', 'model?')}, {weights}", 40)))
        if bw:  # the record's own measured bandwidth: a memory roof, with no compute roof known
            ax.plot([lo, hi], [bw * lo, bw * hi], ls=ls, color="tab:red", lw=1.2)
            group.append(Line2D([], [], ls=ls, color="tab:red", label=textwrap.fill(
                f"measured copy bandwidth {bw / 1e9:,.{1 if bw < 1e11 else 0}f} GB/s", 40)))
    for device, group in by_device.items():
        handles += [Line2D([], [], ls="", label=textwrap.fill(f"measured on {device}", 40))] + group  # beside the rungs' key
    rung_handles = [Line2D([], [], ls="", marker="o", color=colors[r], label=r) for r in rungs]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ys = [p["flops_per_s"] for pts in all_points for p in pts]
    ax.set(xlim=(lo, hi), ylim=(min(ys + [T4.bandwidth * lo]) / 3, max(r.peak_flops for r in ROOFS) * 4))
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights read)", fontsize=FONT)
    ax.set_ylabel("attained FLOP/s (2 × params per token)", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    ax.grid(True, which="major", alpha=0.3)
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # "1e+12" and "100", never "10^2" with a times sign
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    first = key.legend(handles=handles, fontsize=FONT, loc="upper left", bbox_to_anchor=(-0.1, 1.0), frameon=False)
    for text in first.get_texts():  # group headings in bold
        if text.get_text().startswith(("datasheet", "measured on")):
            text.set_fontweight("bold")
    key.add_artist(first)
    key.legend(handles=rung_handles, fontsize=FONT, title="rung (colour)", title_fontsize=FONT, loc="upper left",
               bbox_to_anchor=(0.62, 1.0), frameon=False, ncol=2)
    fig.suptitle(title or "Roofline: decode (o) and prefill (s) points\nagainst T4 and H200 datasheet roofs",
                 fontsize=FONT + 1)
    fig.tight_layout()
    return fig
