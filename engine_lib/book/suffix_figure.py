"""Chapter 11's picture of one suffix lookup: what followed the match in earlier replies, as a tree, and the draft.

The index is the engine's own (``speculative.suffix.SuffixAutomaton``), built over the words of a few short
replies (words stand for tokens here). The lookup is ``SuffixDrafter``'s for the global index: the context is
followed word by word to its longest suffix seen before (the blue root), and the draft takes the most frequent
next word again and again while the path stays likely enough (green). The tree below the root is every
continuation the replies hold, each word with how often it occurred there: the paper's suffix tree, read from the
automaton (a suffix automaton is the suffix tree's compact form: its states merge the tree's equal subtrees).
"""

from __future__ import annotations

from ..speculative.suffix import SEPARATOR, SuffixAutomaton


def lookup_figure(replies: list[str], context: str, k: int = 4, min_prob: float = 0.1):
    """-> (figure, the matched words, the draft's words)."""
    import matplotlib.pyplot as plt

    words = [w for r in replies for w in r.split()]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + context.split()))}
    names = {i: w for w, i in vocab.items()}
    sam = SuffixAutomaton()
    for r in replies:
        sam.extend([*(vocab[w] for w in r.split()), SEPARATOR])
    sam.count()
    ctx = [vocab[w] for w in context.split()]
    root, m = sam.match(ctx)
    draft = sam.frequent(root, k, min_prob) if m else []
    matched = [names[t] for t in ctx[len(ctx) - m:]]

    # the tree of continuations, k words deep; leaves left to right, each parent above its children's middle
    pos, leaves, edges = {}, [0], []

    def place(state, depth, key):
        kids = sorted(((t, s) for t, s in sam.next[state].items() if t != SEPARATOR), key=lambda ts: -sam.occ[ts[1]])
        if depth == k or not kids:
            pos[key] = (float(leaves[0]), -depth, state)
            leaves[0] += 1
            return pos[key][0]
        xs = []
        for tok, child in kids:
            edges.append((key, key + (tok,)))
            xs.append(place(child, depth + 1, key + (tok,)))
        pos[key] = (sum(xs) / len(xs), -depth, state)
        return pos[key][0]

    place(root, 0, ())
    on = {tuple(draft[:i]) for i in range(len(draft) + 1)}
    fig, ax = plt.subplots(figsize=(max(5.5, 1.1 * leaves[0] + 1), 3.2))
    for a, b in edges:
        both = a in on and b in on
        ax.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], color="tab:green" if both else "0.75",
                lw=2.0 if both else 0.8, zorder=1)
    for key, (x, y, state) in pos.items():
        label = " ".join(matched) if not key else f"{names[key[-1]]}\n×{sam.occ[state]}"
        edge = "tab:blue" if not key else "tab:green" if key in on else "0.5"
        ax.text(x, y, label, ha="center", va="center", fontsize=7, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec=edge, lw=1.8 if key in on else 0.6))
    ax.set_xlim(-0.8, leaves[0] - 0.2)
    ax.set_ylim(-k - 0.6, 0.6)
    ax.set_axis_off()
    ax.set_title(f"context \"...{' '.join(context.split()[-6:])}\": its longest suffix seen before (blue),\n"
                 f"what followed it in {len(replies)} earlier replies (×: how often), and the draft "
                 f"\"{' '.join(names[t] for t in draft)}\" (green)", fontsize=8)
    fig.tight_layout()
    return fig, matched, [names[t] for t in draft]
