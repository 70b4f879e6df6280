"""The roofline argument in numbers: FLOPs, bytes and arithmetic intensity of one forward, from a config.

Defined in chapter 00 (what an inference engine does), where the book explains the roofline once
(section "Prefill, decode and the roofline", label ``roofline``); chapters 05, 07, 08, 10 and 11
refer back to it. The device roofs (peak FLOP/s, bandwidth, ridge) are ``figures.T4`` and
``figures.H200``, from the datasheets.

The cost model counts what dominates at batch 1 and says what it leaves out:

- FLOPs: 2 per weight per token through the decoder layers (one multiply-add; the biases and norm
  weights are counted as weights too, a rounding error), 2 per weight of the LM head for each
  position that is scored (the engine scores only the last one of a prompt: ``last_only``), and
  attention's own work, ``4 x hidden`` per (query, visible key) pair per layer (q.k and p.v).
- Bytes: every weight read once per forward (the tied embedding table once, as the LM head; an
  embedding lookup reads only a few rows), plus the keys and values attention reads from the
  cache. Activations are left out: at batch 1 they are small next to 3 GB of weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.contiguous import kv_bytes_per_token
from ..model.config import Qwen2Config


@dataclass(frozen=True)
class ForwardCost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved from memory."""
        return self.flops / self.bytes


def layer_parameters(cfg: Qwen2Config) -> int:
    """Parameters of all decoder layers: everything but the embedding/LM head and the final norm."""
    table = cfg.vocab_size * cfg.hidden_size
    return cfg.num_parameters() - table * (1 if cfg.tie_word_embeddings else 2) - cfg.hidden_size


def forward_cost(cfg: Qwen2Config, new_tokens: int, bytes_per_param: float, context: int = 0,
                 last_only: bool = True, kv_bytes_per_element: float | None = None) -> ForwardCost:
    """FLOPs and bytes of one batch-1 forward of ``new_tokens`` tokens after ``context`` cached ones.

    A prefill is ``forward_cost(cfg, t, b)``; a decode step after n tokens is
    ``forward_cost(cfg, 1, b, context=n)``. The KV cache is in the weights' dtype unless
    ``kv_bytes_per_element`` says otherwise.
    """
    if new_tokens < 1 or context < 0:
        raise ValueError(f"need new_tokens >= 1 and context >= 0, got {new_tokens=}, {context=}")
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    head = cfg.vocab_size * h
    scored = 1 if last_only else new_tokens
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) // 2  # (query, visible key): causal
    flops = 2 * layer_parameters(cfg) * new_tokens + 2 * head * scored + L * 4 * h * pairs
    weights = cfg.num_parameters() - (0 if cfg.tie_word_embeddings else head)  # untied: the table is looked up
    kv_elem = bytes_per_param if kv_bytes_per_element is None else kv_bytes_per_element
    kv = kv_bytes_per_token(cfg, 1) * kv_elem * (context + new_tokens)  # keys and values attention reads
    return ForwardCost(flops, weights * bytes_per_param + kv)


def compute_bound_from(cfg: Qwen2Config, ridge: float, bytes_per_param: float,
                       max_model_len: int | None = None) -> int | None:
    """The shortest prompt whose prefill's intensity reaches ``ridge`` FLOP/byte (compute-bound on
    that device), or None when no prompt up to ``max_model_len`` (default: the model's context) does."""
    max_model_len = max_model_len or cfg.max_position_embeddings
    if forward_cost(cfg, max_model_len, bytes_per_param).intensity < ridge:
        return None
    lo, hi = 1, max_model_len  # intensity grows with the prompt: find the first length at or over the ridge
    while lo < hi:
        mid = (lo + hi) // 2
        if forward_cost(cfg, mid, bytes_per_param).intensity >= ridge:
            hi = mid
        else:
            lo = mid + 1
    return lo


def bound_by(cost: ForwardCost, peak_flops: float, bandwidth: float) -> str:
    """'compute' when the arithmetic takes longer than the memory traffic at the datasheet peaks, else 'memory'."""
    return "compute" if cost.flops / peak_flops >= cost.bytes / bandwidth else "memory"


def intensity_figure(cfg: Qwen2Config, bytes_per_param: float, roofs, prompt_lengths: list[int], model: str):
    """Arithmetic intensity of a prefill against its length, the decode step's, and each device's ridge."""
    import matplotlib.pyplot as plt

    from .plots import plain_log_axis

    lengths = sorted({2 ** k for k in range(13)} | set(prompt_lengths))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.loglog(lengths, [forward_cost(cfg, t, bytes_per_param).intensity for t in lengths], color="tab:blue",
              label="prefill of t prompt tokens")
    decode = forward_cost(cfg, 1, bytes_per_param, context=max(prompt_lengths)).intensity
    ax.plot([lengths[0], lengths[-1]], [decode, decode], color="tab:orange", ls="--",
            label=f"decode step (one token): {decode:.1f} FLOP/B")
    for roof, c in zip(roofs, ("tab:gray", "black")):
        ax.axhline(roof.ridge, color=c, lw=1)
    ridges = ", ".join(f"{roof.name} {roof.ridge:.0f}" for roof in roofs)  # near each other: one label
    ax.text(lengths[0], max(r.ridge for r in roofs) * 1.1, f"ridges (FLOP/B): {ridges}", fontsize=9)
    ax.axvspan(min(prompt_lengths), max(prompt_lengths), color="tab:green", alpha=0.2,
               label=f"the book's prompts: {min(prompt_lengths)} to {max(prompt_lengths)} tokens")
    ax.set_xlabel("prompt tokens t (batch 1)", fontsize=9)
    ax.set_ylabel("FLOP per byte from memory", fontsize=9)
    plain_log_axis(ax.xaxis)
    plain_log_axis(ax.yaxis)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"Arithmetic intensity of a forward: {model}, {bytes_per_param:g}-byte weights\n"
                 "(computed from the config; under a ridge, bandwidth is the limit)", fontsize=10)
    fig.tight_layout()
    return fig
