"""Measuring speculative decoding: acceptance, tokens per target forward, decode speed next to plain
decoding, and what one verify forward of k + 1 tokens costs next to a one-token step.

Defined in chapter 11. Random weights make real acceptance meaningless, so beside prompt lookup
on two prompts (one that invites copying, one that does not) it forces the acceptance rate: a
drafter that replays plain greedy's own continuation (everything accepted) and one that
proposes nonsense (nothing accepted) bracket what any drafter can do on this hardware.
"""

from __future__ import annotations

import statistics

import torch

from ..sampling import SamplingParams, SamplingState
from ..speculative import Replay, verify_tokens
from ..stages import sync
from .measure import timed

CHI2_CRITICAL_DF4 = 18.47  # chi-square at p = 0.001 for 4 degrees of freedom (a 5-token vocabulary)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed ``counts`` against the distribution ``probs``."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def first_token_counts(rule=verify_tokens, draws: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token of a 5-token vocabulary is the first one emitted after a deterministic
    draft, over ``draws`` seeded rounds of the accept/reject ``rule`` -> (counts, the model's own
    first-position distribution, which an exact rule must reproduce)."""
    logits = torch.tensor([[[1.0, 0.2, 1.6, -0.5, 0.4], [0.3, 0.0, -1.0, 2.0, 0.5]]])  # (1, k + 1, vocab 5)
    draft = torch.tensor([[2]])  # a deterministic draft (as prompt lookup's): token 2
    state = SamplingState(1, 5, torch.device("cpu"))
    mode = state.load([SamplingParams(do_sample=True, temperature=1.0, seed=123)])
    counts = torch.zeros(5)
    for _ in range(draws):
        accepted, nxt = rule(logits, draft, state, mode)
        counts[draft[0, 0] if accepted[0] > 0 else nxt[0]] += 1
    return counts, logits[0, 0].softmax(-1)

# a prompt whose answer repeats its input (lookup should shine) and one whose answer does not
EDIT_PROMPT = ("Rename the variable `x` to `total` in this function and change nothing else:\n```python\n"
               "def add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n```")
FREE_PROMPT = "Write a short poem about the sea at night."


@torch.inference_mode()
def verify_cost(engine, ks: tuple[int, ...] = (1, 2, 4, 8), context: int = 256, repeats: int = 5) -> dict[int, float]:
    """One verify forward of k + 1 tokens over ``context`` cached ones, in units of a one-token
    forward (k = 0) through the same code. Re-running it rewrites the same slots, so it can be timed."""
    runner = engine.runner
    runner.prefill(torch.arange(1000, 1000 + context, device=engine.device)[None], None, [SamplingParams()],
                   max_new_tokens=max(ks) + 2)
    times = {}
    for k in (0, *ks):
        draft = torch.full((1, k), 1000, dtype=torch.long, device=engine.device)
        times[k] = timed(lambda draft=draft: runner.verify(draft), engine.device, repeats=repeats)
    return {k: times[k] / times[0] for k in ks}


def _run(engine, prompt, n: int, repeats: int) -> dict:
    opts = dict(max_new_tokens=n, do_sample=False, stop_token_ids=())
    engine.generate(prompt, **opts)  # warm up
    runs = [engine.generate(prompt, **opts) for _ in range(repeats)]
    sync(engine.device)
    out = {"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs), "tokens": runs[-1].token_ids}
    out.update({k: v for k, v in runs[-1].extra.items() if k in ("acceptance_rate", "tokens_per_target_forward")})
    return out


def measure_speculative(engine, max_new_tokens: int = 48, repeats: int = 2) -> dict:
    """Plain decoding against prompt lookup and forced acceptance, on one engine's model (greedy)."""
    from ..engine import Engine

    def variant(drafter):
        return Engine(engine.model, engine.tokenizer, engine.model_dir, engine.stage, engine.device,
                      speculative=drafter)

    out = {"stage": engine.stage.name, "dtype": str(engine.dtype).removeprefix("torch."),
           "max_new_tokens": max_new_tokens, "prompts": {}}
    for name, prompt in (("edit code (lookup should help)", EDIT_PROMPT), ("free text", FREE_PROMPT)):
        plain = _run(engine, prompt, max_new_tokens, repeats)
        rows = {"plain": plain, "prompt lookup": _run(variant("prompt_lookup"), prompt, max_new_tokens, repeats),
                "replay (all accepted)": _run(variant(Replay([plain["tokens"]])), prompt, max_new_tokens, repeats),
                "nonsense (none accepted)": _run(variant(Replay([[7] * 4 * max_new_tokens])), prompt,
                                                 max_new_tokens, repeats)}
        want, base = plain["tokens"], plain["decode_tok_s"]
        for r in rows.values():
            # identical in fp32; in half precision a verify's batched matmul rounds differently from
            # a one-token step, so a near-tie can flip: recorded, not assumed
            r["matches_plain"] = r.pop("tokens") == want
            r["speedup"] = r["decode_tok_s"] / base
        out["prompts"][name] = {"prompt_tokens": len(engine.encode(prompt)), "runs": rows}
    out["verify_cost"] = {str(k): v for k, v in verify_cost(engine).items()}
    return out
