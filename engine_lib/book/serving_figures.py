"""Figures of chapters 12 (serving many users) and 13 (prefix caching) drawn from the engine's own serving code.

``shared_prefix_diagram`` runs the real ``PrefixCachingAllocator`` on made-up token ids (a
system prompt shared by every request, then each request's own question) and draws what it
did: each request's block table, and the pool with the blocks they share.
"""

from __future__ import annotations

from ..cache.blocks import blocks_for
from ..cache.paged import BLOCK_SIZE, RESERVED
from ..cache.prefix import PrefixCachingAllocator

COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B2")
SHARED = "#DD8452"


def shared_prefix_tables(system_tokens: int, tails: list[int], block_size: int = BLOCK_SIZE,
                         num_blocks: int | None = None) -> tuple[dict[str, list[int]], dict[str, int], list[int]]:
    """Requests A, B, ... with a ``system_tokens``-token prefix in common and ``tails[i]`` tokens of
    their own, admitted one after another through the prefix-caching allocator (each prompt's
    blocks keyed once computed) -> (block table per request, prompt tokens found cached per
    request, the blocks more than one request holds)."""
    total = sum(blocks_for(system_tokens + t, block_size) for t in tails)
    alloc = PrefixCachingAllocator(num_blocks or RESERVED + total, block_size)
    system = list(range(1000, 1000 + system_tokens))
    tables, cached = {}, {}
    for i, tail in enumerate(tails):
        name = chr(ord("A") + i)
        tokens = system + [10_000 * (i + 1) + j for j in range(tail)]
        blocks, found = alloc.acquire(tokens, blocks_for(len(tokens), block_size))
        alloc.seal(blocks, tokens, len(tokens))  # the prompt is computed: its full blocks become findable
        tables[name], cached[name] = blocks, found
    shared = sorted(b for b, n in alloc.refs.items() if n > 1)
    return tables, cached, shared


def shared_prefix_diagram(system_tokens: int = 40, tails: tuple[int, ...] = (12, 30, 7),
                          block_size: int = BLOCK_SIZE):
    """Block tables (left) and the pool (right) of requests sharing a system prompt."""
    import matplotlib.pyplot as plt

    tables, cached, shared = shared_prefix_tables(system_tokens, list(tails), block_size)
    lengths = {n: system_tokens + t for n, t in zip(tables, tails)}
    owner = {b: n for n, t in tables.items() for b in t if b not in shared}
    num_blocks = RESERVED + len(owner) + len(shared)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.6), gridspec_kw={"width_ratios": [1.15, 1]})
    width = max(len(t) for t in tables.values())
    for row, (name, table) in enumerate(tables.items()):
        y = len(tables) - 1 - row
        for i, block in enumerate(table):
            filled = min(block_size, lengths[name] - i * block_size) / block_size
            face = SHARED if block in shared else COLORS[row % len(COLORS)]
            ax1.add_patch(plt.Rectangle((i, y + 0.15), 0.9, 0.7, fill=False, ec="0.3"))
            ax1.add_patch(plt.Rectangle((i, y + 0.15), 0.9 * filled, 0.7, color=face, alpha=0.85))
            ax1.text(i + 0.45, y + 0.5, str(block), ha="center", va="center", fontsize=10)
        ax1.text(-0.15, y + 0.5, f"{name}: {lengths[name]} tok,\n{cached[name]} cached", ha="right",
                 va="center", fontsize=10)
    ax1.set_xlim(-2.6, width)
    ax1.set_ylim(-0.1, len(tables))
    ax1.set_title("block tables (logical -> physical)", fontsize=10)
    ax1.axis("off")
    cols = 4
    for b in range(num_blocks):
        x, y = b % cols, -(b // cols)
        if b in shared:
            face, label = SHARED, "shared"
        elif b in owner:
            face, label = COLORS[list(tables).index(owner[b]) % len(COLORS)], owner[b]
        else:
            face, label = "0.75", "reserved"
        ax2.add_patch(plt.Rectangle((x, y), 0.9, 0.8, facecolor=face, ec="0.3", alpha=0.85))
        ax2.text(x + 0.45, y + 0.5, str(b), ha="center", fontsize=10)
        ax2.text(x + 0.45, y + 0.12, label, ha="center", fontsize=10)
    ax2.set_xlim(-0.1, cols)
    ax2.set_ylim(-((num_blocks - 1) // cols) - 0.1, 1)
    ax2.set_title(f"the pool: {len(shared)} blocks held by {len(tables)} requests", fontsize=10)
    ax2.axis("off")
    fig.suptitle(f"a {system_tokens}-token system prompt in blocks of {block_size}: its "
                 f"{system_tokens // block_size} full block(s) are shared", fontsize=10)
    fig.tight_layout()
    return fig


def token_loop_diagram(step_form: str = "eager", buckets: tuple[int, ...] = ()):
    """Where a token is made: one token loop (scheduler, runner, output processor) with two clients, the
    HTTP server and ``Engine.generate`` / ``Engine.stream``; its decode batches run the compiled
    ``decode_step``. ``step_form`` and ``buckets`` label the decode path as it ran (live values)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    w, gap = 1.8, 0.7
    col = [i * (w + gap) for i in range(4)]
    boxes = [  # (column, bottom, height, text, colour)
        (0, 3.6, 0.8, "HTTP request\n(serve/app.py)", "0.85"),
        (0, 2.5, 0.8, "Engine.generate /\nEngine.stream\n(loop/local.py)", "0.85"),
        (1, 3.0, 1.0, "Scheduler\nadmit, blocks,\npreempt, chunks", COLORS[0]),
        (2, 3.0, 1.0, "ModelRunner\nprefill: paged_forward\ndecode: bucket of rows", COLORS[1]),
        (3, 3.0, 1.0, "OutputProcessor\ntext, stop strings,\nlogprobs, metrics", COLORS[3]),
        (2, 0.6, 1.0, "CompiledStep\n-> decode_step\n(forward, pick, advance)", SHARED),
    ]
    for c, y, h, text, colour in boxes:
        ax.add_patch(plt.Rectangle((col[c], y), w, h, facecolor=colour, ec="0.3", alpha=0.8))
        ax.text(col[c] + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)

    def arrow(a, b, label=""):
        ax.annotate("", xy=b, xytext=a, arrowprops=dict(arrowstyle="->", color="0.2"))
        if label:
            ax.text((a[0] + b[0]) / 2, a[1] - 0.32, label, ha="center", va="top", fontsize=8)

    arrow((col[0] + w, 4.0), (col[1], 3.75))  # both clients submit sequences to the one scheduler
    arrow((col[0] + w, 2.9), (col[1], 3.25))
    arrow((col[1] + w, 3.5), (col[2], 3.5), "Scheduled\nBatch")
    arrow((col[2] + w, 3.5), (col[3], 3.5), "token\nids")
    arrow((col[3] + w / 2, 4.0), (col[0] + w, 4.3))  # events back to the clients: the server's, above;
    # the engine's, below the compiled step, so that no line crosses another
    ax.plot([col[3] + w / 2, col[3] + w / 2, col[0] + w / 2], [3.0, 0.35, 0.35], color="0.2", lw=1)
    arrow((col[0] + w / 2, 0.35), (col[0] + w / 2, 2.5))
    ax.text((col[1] + col[3] + w) / 2, 4.3, "Delta / Finished events, back to each client", ha="center", fontsize=8)
    arrow((col[2] + w / 2, 3.0), (col[2] + w / 2, 1.6))
    ax.text(col[2] + w / 2 + 0.1, 1.85, "decode batches", fontsize=8, va="center")
    form = {"cuda_graph": "one CUDA graph replay per bucket", "compiled": "one compiled call",
            "eager": "eager (this rung does not compile)"}.get(step_form, step_form)
    seen = f"\nbatch sizes run: {', '.join(map(str, buckets))}" if buckets else ""
    ax.text(col[2] - 0.15, 1.1, f"the decode step\nran as: {form}{seen}", fontsize=8, va="center", ha="right")
    ax.set_xlim(-0.1, col[3] + w + 0.1)
    ax.set_ylim(0.2, 4.6)
    ax.axis("off")
    ax.set_title("Where a token is made: one token loop, two clients", fontsize=10)
    fig.tight_layout()
    return fig
