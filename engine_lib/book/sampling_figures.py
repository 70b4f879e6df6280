"""How sampled text scores, for chapter 09 (beyond greedy): repetition and likelihood.

Temperature trades one failure for another. Low temperatures (and greedy) fall into loops, which
``repeated_ngram_share`` counts; high ones wander into text the model itself finds unlikely, which
``sequence_nll`` measures. Sampling itself lives in ``engine_lib.sampling.pick`` and ``Engine.generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def repeated_ngram_share(ids: Sequence[int], n: int = 4) -> float:
    """The share of the ``n``-grams of ``ids`` that repeat an earlier one: 1 - distinct / total
    ("rep-n", Welleck et al. 2019). 0.0 when none repeats (or ``ids`` is shorter than ``n``);
    it approaches 1 as a loop fills the text."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


@torch.inference_mode()
def sequence_nll(engine, prompt_ids: Sequence[int], continuation: Sequence[int]) -> float:
    """Mean negative log-likelihood, in nats per token, of ``continuation`` after ``prompt_ids`` under
    the engine's model at temperature 1 with no filter: how unlikely the model itself finds the text.
    One forward of prompt + continuation (``Engine.logits``)."""
    if not prompt_ids or not continuation:
        raise ValueError("sequence_nll needs at least one prompt token and one continuation token")
    logits = engine.logits(list(prompt_ids) + list(continuation))  # (seq, vocab) float32
    logp = logits[len(prompt_ids) - 1:-1].log_softmax(-1)  # row i predicts continuation[i]
    target = torch.tensor(list(continuation), device=logp.device)
    return -logp.gather(1, target[:, None]).mean().item()
