"""Chapter 09's temperature trade-off on the trained preset ``qwen2-stdlib-small``, and the helpers
that score sampled text (``engine_lib/book/sampling_figures.py``).

The thresholds were calibrated by measurement (CPU, torch 2.13, the preset retrained on the
training vocabulary, held-out perplexity 190.98); each states the measured value and its margin.
Sampling is seeded, so on one machine the numbers are fixed; the margins absorb other CPUs' rounding.
"""

import statistics

import pytest
import torch
import torch.nn.functional as F

from engine_lib import Engine
from engine_lib.book.sampling_figures import repeated_ngram_share, sequence_nll
from engine_lib.model.checkpoints import STDLIB_SMALL, ensure_checkpoint

PROMPT = 'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self'  # the chapter's
NEW_TOKENS, SAMPLES, SEED = 40, 4, 0
OFF = dict(top_k=0, top_p=1.0, repetition_penalty=1.0)  # temperature alone, as in the chapter

GREEDY_REP_MIN = 0.30  # plain greedy repeats 51.4% of its 4-grams here (a loop); margin 0.21
REP_GAP_MIN = 0.05  # mean repeated-4-gram share, T=0.5 minus T=1.5: measured 0.128 (0.054 and 0.095 at seeds 1, 2)
NLL_GAP_MIN = 6.0  # mean NLL (nats/token), T=1.5 minus T=0.5: measured 10.93 (10.14 and 10.75 at seeds 1, 2)


def test_repeated_ngram_share_counts_repeats_of_earlier_ngrams():
    assert repeated_ngram_share([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # shorter than n: no 4-gram at all
    assert repeated_ngram_share([]) == 0.0
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # 5 grams, 4 distinct
    assert repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)  # a loop of one token
    assert repeated_ngram_share([1, 2, 1, 2, 1], n=2) == pytest.approx(2 / 4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = ensure_checkpoint(STDLIB_SMALL, root=tmp_path_factory.mktemp("ckpt"))
    return Engine.from_pretrained(path, device="cpu", stage="kv_cache")


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return engine.tokenizer.encode(PROMPT, add_special_tokens=False)


def test_sequence_nll_is_the_models_cross_entropy_on_the_continuation(engine, prompt_ids):
    cont = engine.tokenizer.encode(", maxsize=0):\n        self.maxsize = maxsize\n", add_special_tokens=False)
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt_ids + cont]))[0].float()
    want = F.cross_entropy(logits[len(prompt_ids) - 1:-1], torch.tensor(cont)).item()
    assert sequence_nll(engine, prompt_ids, cont) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError):
        sequence_nll(engine, prompt_ids, [])


def scores(engine, prompt_ids, temperature):
    outs = engine.generate_batch([prompt_ids] * SAMPLES, max_new_tokens=NEW_TOKENS, stop_token_ids=[], do_sample=True,
                                 temperature=temperature, seed=SEED, **OFF)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    return (statistics.fmean(repeated_ngram_share(o.token_ids) for o in outs),
            statistics.fmean(sequence_nll(engine, prompt_ids, o.token_ids) for o in outs))


def test_greedy_loops_on_python(engine, prompt_ids):
    ids = engine.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False, stop_token_ids=[]).token_ids
    assert repeated_ngram_share(ids) >= GREEDY_REP_MIN, engine.tokenizer.decode(ids)


def test_temperature_trades_repetition_for_unlikeliness(engine, prompt_ids):
    rep_cold, nll_cold = scores(engine, prompt_ids, 0.5)
    rep_hot, nll_hot = scores(engine, prompt_ids, 1.5)
    assert rep_cold - rep_hot >= REP_GAP_MIN, (rep_cold, rep_hot)
    assert nll_hot - nll_cold >= NLL_GAP_MIN, (nll_cold, nll_hot)
