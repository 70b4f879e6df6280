"""What a trained embedding table learned: each token's nearest neighbours by cosine similarity.

Defined in chapter 02 (from tokens to vectors). The numbers come from the model's own embedding
table (``model.model.embed_tokens.weight``), which Qwen2 ties to the LM head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FONT = 10


def nearest_tokens(table: torch.Tensor, token_id: int, k: int = 5, rows: int | None = None) -> list[tuple[int, float]]:
    """The ``k`` rows of ``table`` (vocab, hidden) most similar to row ``token_id`` by cosine, itself left out.

    ``rows`` limits the search to the first ``rows`` rows (the tokenizer's real tokens, not the
    padding rows after them). -> [(token id, cosine similarity)], most similar first.
    """
    table = table[:rows].float()
    unit = table / table.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # a zero row has similarity 0, not NaN
    sims = unit @ unit[token_id]  # (rows,)
    sims[token_id] = -float("inf")
    top = sims.topk(k)
    return [(int(i), float(s)) for s, i in zip(top.values, top.indices)]


def single_token_ids(tokenizer, words: list[str]) -> list[int]:
    """Each word's id; a word that is not one token is an error (a figure of halves would mislead)."""
    out = []
    for w in words:
        ids = tokenizer.encode(w)
        if len(ids) != 1:
            raise ValueError(f"{w!r} is {len(ids)} tokens, not one")
        out.append(ids[0])
    return out


def shown(tokenizer, token_id: int) -> str:
    """A token as a label: its text with a visible mark for a leading space."""
    text = tokenizer.decode([token_id])
    return repr(text.replace(" ", "·"))[1:-1]


def neighbours_figure(table: torch.Tensor, tokenizer, words: list[str], model: str, k: int = 5) -> Figure:
    """One small bar chart per word: its ``k`` nearest tokens and their cosine similarity."""
    import matplotlib.pyplot as plt

    ids = single_token_ids(tokenizer, words)
    cols = 3
    rows_n = -(-len(ids) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(8, 1.9 * rows_n + 0.8), squeeze=False)
    for ax, tid in zip(axes.flat, ids):
        near = nearest_tokens(table, tid, k, rows=len(tokenizer))
        ax.barh(range(k), [s for _, s in near], color="tab:blue")
        ax.set_yticks(range(k), [shown(tokenizer, i) for i, _ in near], fontsize=FONT, family="monospace")
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.tick_params(axis="x", labelsize=FONT - 1)
        ax.set_title(f"nearest to {shown(tokenizer, tid)}", fontsize=FONT, family="monospace")
    for ax in list(axes.flat)[len(ids):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("cosine similarity", fontsize=FONT - 1)
    fig.suptitle(f"Nearest tokens in the embedding table of {model}\n(cosine similarity of rows, "
                 f"{table.shape[1]} numbers each; a dot marks a leading space)", fontsize=FONT + 1)
    fig.tight_layout()
    return fig
