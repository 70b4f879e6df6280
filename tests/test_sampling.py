"""Sampling, repetition penalty and generation_config defaults, against transformers."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from conftest import hf_greedy, strip_stop
from engine_lib.errors import OptionValueError, UnsupportedOptionError
from engine_lib.loop.model_runner import ModelRunner
from engine_lib.sampling import SamplingParams, SamplingState, apply_repetition_penalty, filter_top_k_top_p


def test_defaults_come_from_generation_config(engines):
    d = engines("kv_cache").defaults
    assert (d.do_sample, d.temperature, d.top_k, d.top_p, d.repetition_penalty) == (True, 0.7, 20, 0.8, 1.1)
    assert d.stop_token_ids == (151645, 151643)


def test_do_sample_false_and_temperature_zero_are_plain_greedy(engines, prompts):
    engine = engines("kv_cache")
    assert engine.sampling(do_sample=False).repetition_penalty == 1.0  # unlike transformers: no hidden penalty
    assert engine.sampling(do_sample=False, repetition_penalty=1.1).repetition_penalty == 1.1
    greedy = engine.generate(prompts[1], max_new_tokens=16, do_sample=False).token_ids
    assert engine.generate(prompts[1], max_new_tokens=16, temperature=0).token_ids == greedy


@pytest.mark.parametrize("stage", ["naive", "kv_cache"])
def test_repetition_penalty_matches_transformers_token_for_token(engines, hf_tiny, prompts, stage):
    ids = prompts[3]
    ref = strip_stop(hf_greedy(hf_tiny, ids, 48, repetition_penalty=1.1))
    ours = engines(stage).generate(ids, max_new_tokens=48, do_sample=False, repetition_penalty=1.1).token_ids
    assert ours == ref
    assert ours != engines(stage).generate(ids, max_new_tokens=48, do_sample=False).token_ids  # it did something


def test_penalty_function_matches_transformers_processor():
    torch.manual_seed(0)
    logits, ids = torch.randn(2, 50), torch.randint(0, 50, (2, 7))
    seen = torch.zeros(2, 50, dtype=torch.bool).scatter_(1, ids, True)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), ref)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (20, 0.8), (0, 0.05)])
def test_top_k_top_p_match_transformers_warpers(top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(3, 200) * 3
    ref = logits.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = filter_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert (~torch.isinf(ours)).sum(-1).min() >= 1


def test_seeded_sampling_is_reproducible(engines, prompts):
    engine = engines("kv_cache")
    a = engine.generate(prompts[0], max_new_tokens=24, do_sample=True, seed=7, stop_token_ids=[])
    b = engine.generate(prompts[0], max_new_tokens=24, do_sample=True, seed=7, stop_token_ids=[])
    c = engine.generate(prompts[0], max_new_tokens=24, do_sample=True, seed=8, stop_token_ids=[])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_top_k_one_sampling_is_greedy(engines, prompts):
    engine = engines("kv_cache")
    sampled = engine.generate(prompts[4], max_new_tokens=16, do_sample=True, top_k=1, seed=3,
                              repetition_penalty=1.0).token_ids
    assert sampled == engine.generate(prompts[4], max_new_tokens=16, do_sample=False).token_ids


def test_invalid_sampling_options():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("option, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", float("inf")), ("repetition_penalty", -float("inf")),
    ("temperature", "0.7"), ("top_p", True), ("top_k", 2.5), ("top_k", float("inf")), ("do_sample", "yes"),
    ("seed", 1.5),
])
def test_option_values_are_checked_by_type_and_finiteness(option, value):
    """NaN passes every comparison test by failing it (it used to sample greedily): a typed error names both."""
    with pytest.raises(OptionValueError, match=f"^{option} must be .*, got {value!r}$") as info:
        SamplingParams().merged(**{option: value})
    assert (info.value.option, repr(info.value.value)) == (option, repr(value))
    assert isinstance(info.value, UnsupportedOptionError)  # what callers of the engine already catch


def test_unknown_option_names_suggest_the_closest():
    with pytest.raises(UnsupportedOptionError, match="unknown generation option 'tempurature'; did you mean "
                                                     "'temperature'\\?"):
        SamplingParams().merged(tempurature=0.5)
    with pytest.raises(UnsupportedOptionError, match="'top_pp'; did you mean 'top_p'"):
        SamplingParams().merged(top_pp=None)  # a None (= the default) does not hide the typo
    with pytest.raises(UnsupportedOptionError, match="unknown generation option 'colour' \\(the options: do_sample,"):
        SamplingParams().merged(colour="red")  # nothing close: the list, no guess


def test_each_row_of_a_batch_keeps_its_own_settings_and_seed(engines, prompts, monkeypatch):
    """Per-row sampling: a greedy row and a seeded sampled row share the loop's decode steps, and each makes
    what it makes alone."""
    engine = engines("kv_cache")
    options = [dict(do_sample=False), dict(do_sample=True, temperature=1.0, top_k=50, seed=3)]  # + top-p, penalty
    pair = [prompts[0], prompts[2]]
    decode_rows, real = [], ModelRunner.execute

    def recording(self, batch):
        if not batch.prefill:
            decode_rows.append(len(batch.rows))
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    core = engine.loop.core_for(len(pair), max(map(len, pair)) + 16)
    seqs = [core.new_sequence(p, engine.sampling(**o, max_tokens=16, stop_token_ids=[])) for p, o in zip(pair, options)]
    for _ in core.drive(seqs):
        pass
    together = [s.output_ids for s in seqs]
    assert decode_rows and all(n == 2 for n in decode_rows)  # both rows in every decode step
    monkeypatch.undo()
    alone = [engine.generate(p, max_new_tokens=16, stop_token_ids=[], **o).token_ids for p, o in zip(pair, options)]
    assert together == alone
    assert alone[1] != engine.generate(prompts[2], max_new_tokens=16, do_sample=False, stop_token_ids=[]).token_ids


def test_top_candidates_never_sorts_the_whole_vocabulary_when_top_k_is_set(monkeypatch):
    calls = []
    real = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, **kw: calls.append(k) or real(self, k, **kw))
    monkeypatch.setattr(torch, "sort", lambda *a, **k: pytest.fail("full sort"))
    state = SamplingState(2, 1000, torch.device("cpu"))
    mode = state.load([SamplingParams(do_sample=True, top_k=20, top_p=0.8, seed=0)] * 2)
    state.draw_noise()
    token = state.pick(torch.randn(2, 1000), mode)
    assert token.shape == (2,) and calls == [64]  # any top-k up to 64 looks at 64 candidates: one compiled shape


def test_non_finite_flags_a_row_with_a_nan_or_an_inf_anywhere():
    from engine_lib.sampling import non_finite

    logits = torch.randn(5, 3, 1000)
    logits[1, 2, 7] = float("nan")
    logits[2, 0, 999] = float("inf")
    logits[3, 1, 0] = float("-inf")
    logits[4, 0, 5] = 3e38  # huge but finite
    want = ~torch.isfinite(logits).all(dim=-1)
    assert torch.equal(non_finite(logits), want) and non_finite(logits).sum() == 3
    assert torch.equal(non_finite(logits.bfloat16()), want)


def test_a_greedy_pick_of_equal_maxima_takes_the_first_as_argmax_does():
    """The pick reads ``max``'s indices (faster than ``argmax`` on a CPU): on ties, the first, eagerly and compiled."""
    state = SamplingState(3, 1000, torch.device("cpu"))
    mode = state.load([SamplingParams(do_sample=False)] * 3)
    logits = torch.zeros(3, 1000)
    logits[0, [7, 500, 999]] = 2.0
    logits[1, [998, 999]] = 5.0
    logits[2, 3] = float("nan")  # a NaN row is flagged elsewhere; argmax and max both point at the NaN
    want = logits.argmax(dim=-1)
    assert want.tolist() == [7, 998, 3]
    assert torch.equal(state.pick(logits, mode), want)
    assert torch.equal(torch.compile(state.pick, fullgraph=True)(logits, mode), want)
