"""Where a trained model's heads look: attention weights recorded from the engine's own layers, and a heat-map.

Defined in chapter 03 (attention). ``record_attention`` runs one forward of the engine's model and
recomputes, beside each layer, the attention weights softmax(q k^T / sqrt(d) + mask) from the very
q and k the layer computes (same projections, same RoPE), without touching the engine's code
path. ``head_stats`` and ``pick_heads`` describe the heads in numbers, so a chapter's prose and
its choice of heads come from the run, not from a guess.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..model.layers.rope import apply_rope

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FONT = 10


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) per query head, in fp32.

    q: (batch, heads, q_len, head_dim); k: (batch, kv_heads, kv_len, head_dim), shared by groups of
    heads // kv_heads consecutive query heads. -> (batch, heads, q_len, kv_len), rows summing to 1.
    """
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).float()  # (batch, heads, kv_len, head_dim): a copy is fine for a figure
    scores = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (batch, heads, q_len, kv_len)
    t, s = scores.shape[-2:]
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)[None, None]
    if mask is not None:  # (batch or 1, 1, q_len, kv_len), True = may attend
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


@torch.inference_mode()
def record_attention(model, ids: list[int]) -> torch.Tensor:
    """Attention weights of every layer and head for one prompt: (layers, heads, seq, seq), fp32 on the CPU.

    A forward pre-hook on each ``self_attn`` sees its input and the step context, and recomputes
    q and k exactly as ``Attention.forward`` does (``_project``, then RoPE).
    """
    store: dict[int, torch.Tensor] = {}

    def hook_for(i):
        def hook(attn, args):
            x, ctx = args[0], args[1]
            q, k, _ = attn._project(x)  # (batch, heads or kv_heads, seq, head_dim)
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
            store[i] = attention_probs(q, k, ctx.mask, ctx.causal)[0].cpu()
        return hook

    layers = model.model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        model(torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([store[i] for i in range(len(layers))])


def head_stats(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per (layer, head), averaged over query positions 1..: the weight on the previous token, on
    the first token, and the entropy of the row in bits (0: all weight on one key)."""
    p = probs[..., 1:, :]  # (layers, heads, seq - 1, seq): position 0 can only look at itself
    rows = torch.arange(1, probs.shape[-1])
    prev = probs[..., rows, rows - 1].mean(-1)
    first = p[..., 0].mean(-1)
    entropy = -(p * p.clamp_min(1e-30).log2()).sum(-1).mean(-1)
    return {"previous": prev, "first": first, "entropy_bits": entropy}


def pick_heads(probs: torch.Tensor) -> tuple[int, list[int]]:
    """(layer, [head, head]): the head that looks most at the previous token, and the head of the
    same layer that looks least at it, for a contrast. Chosen from the numbers, not by eye."""
    prev = head_stats(probs)["previous"]  # (layers, heads)
    layer, head = divmod(int(prev.argmax()), prev.shape[1])
    other = int(prev[layer].argmin())
    return layer, [head] if other == head else [head, other]


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Tokens as the figure shows them: a visible mark for a leading space, \\n for a newline."""
    return [t.replace("Ġ", "·").replace("Ċ", "\\n").replace("ĉ", "\\t") for t in tokenizer.convert_ids_to_tokens(ids)]


def attention_heatmap(probs: torch.Tensor, labels: list[str], layer: int, heads: list[int], model: str,
                      where: str) -> Figure:
    """One panel per head: query position (row) against key position (column), weight as colour."""
    import matplotlib.pyplot as plt

    n = len(labels)
    stats = head_stats(probs)
    small = FONT - 2 if n > 20 else FONT - 1
    fig, axes = plt.subplots(1, len(heads), figsize=(8, 5.0) if len(heads) > 1 else (5.2, 5.4), squeeze=False,
                             layout="constrained")
    for j, (ax, h) in enumerate(zip(axes[0], heads)):
        im = ax.imshow(probs[layer, h].numpy(), cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks(range(n), labels, rotation=90, fontsize=small, family="monospace")
        ax.set_yticks(range(n), labels if j == 0 else [], fontsize=small, family="monospace")
        ax.set_title(f"layer {layer}, head {h}\n{stats['previous'][layer, h]:.0%} of its weight on the previous token",
                     fontsize=FONT)
        ax.set_xlabel("key position (attended to)", fontsize=FONT - 1)
    axes[0][0].set_ylabel("query position (attending)", fontsize=FONT - 1)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.6, label="attention weight")
    fig.suptitle(f"Attention weights of {model}\n{where}, {n} tokens of Python", fontsize=FONT + 1)
    return fig
