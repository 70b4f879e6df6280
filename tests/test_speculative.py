"""Speculative decoding: greedy output unchanged token for token, sampling distributed exactly as the
model's (a chi-square test that can fail), drafters that look up, replay or run a draft model."""

import pytest
import torch

from engine_lib import Engine
from engine_lib.bench.speculative import CHI2_CRITICAL_DF4, chi_square, first_token_counts
from engine_lib.model.checkpoints import ensure_checkpoint
from engine_lib.speculative import PromptLookup, Replay, verify_tokens

N_NEW = 40


def test_prompt_lookup_copies_what_followed_the_latest_ngram():
    ctx = [5, 1, 2, 3, 9, 8, 7, 1, 2, 3]
    assert PromptLookup.lookup(ctx, 3) == [9, 8, 7]  # the 3-gram [1, 2, 3] occurred before
    assert PromptLookup.lookup([4, 7, 6, 4, 8, 1, 6], 2) == [4, 8]  # only the 1-gram [6] recurs
    assert PromptLookup.lookup([1, 2, 3, 4], 3) == []  # nothing recurs: nothing to propose


@pytest.fixture(scope="module")
def plain(engines, prompts):
    def run(stage, ids, **opts):
        return engines(stage).generate(ids, max_new_tokens=N_NEW, **opts).token_ids
    return run


@pytest.fixture(scope="module")
def spec_engines(tiny_dir):
    cache = {}

    def get(stage, speculative="prompt_lookup"):
        key = (stage, speculative if isinstance(speculative, str) else id(speculative))
        if key not in cache:
            cache[key] = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage=stage,
                                                speculative=speculative)
        return cache[key]
    return get


@pytest.mark.parametrize("stage", ["kv_cache", "fused"])
def test_greedy_output_is_plain_greedy_token_for_token(spec_engines, plain, prompts, stage):
    engine = spec_engines(stage)
    for i in (0, 3, 6, 9):
        got = engine.generate(prompts[i], max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
        assert got.token_ids == plain(stage, prompts[i], do_sample=False, stop_token_ids=[]), f"prompt {i}"
        assert got.extra["drafter"] == "prompt_lookup" and got.extra["target_forwards"] <= N_NEW


def test_ragged_batch_equals_each_prompt_alone(spec_engines, plain, prompts):
    engine = spec_engines("kv_cache")
    batch = [prompts[0], prompts[2], prompts[5]]
    assert len({len(p) for p in batch}) == 3
    together = engine.generate_batch(batch, max_new_tokens=24, do_sample=False, stop_token_ids=[])
    for ids, out in zip(batch, together):
        want = plain("kv_cache", ids, do_sample=False, stop_token_ids=[])[:24]
        assert out.token_ids == want


def test_stop_tokens_and_the_repetition_penalty(spec_engines, plain, prompts):
    engine = spec_engines("kv_cache")
    ids = prompts[4]
    want = plain("kv_cache", ids, do_sample=False, repetition_penalty=1.3)
    assert engine.generate(ids, max_new_tokens=N_NEW, do_sample=False, repetition_penalty=1.3).token_ids == want
    stop = want[5]  # stop at the 6th token: the reply is the 5 before it
    got = engine.generate(ids, max_new_tokens=N_NEW, do_sample=False, repetition_penalty=1.3, stop_token_ids=[stop])
    assert got.token_ids == want[:want.index(stop)] and got.finish_reason == "stop"


def test_streaming_emits_the_same_text(spec_engines):
    engine = spec_engines("kv_cache")
    full = engine.generate("Repeat: a b c a b c a b c", max_new_tokens=24, do_sample=False).text
    assert "".join(engine.stream("Repeat: a b c a b c a b c", max_new_tokens=24, do_sample=False)) == full


def test_forced_acceptance_replays_and_a_wrong_draft_changes_nothing(tiny_dir, plain, prompts):
    ids = prompts[1]
    want = plain("kv_cache", ids, do_sample=False, stop_token_ids=[])
    right = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache", speculative=Replay([want]))
    got = right.generate(ids, max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
    assert got.token_ids == want and got.extra["acceptance_rate"] > 0.95
    assert got.extra["tokens_per_target_forward"] > 3
    wrong = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache", speculative=Replay([[7] * 100]))
    got = wrong.generate(ids, max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
    assert got.token_ids == want and got.extra["acceptance_rate"] < 0.1


def test_a_draft_model_with_its_own_cache(tiny_dir, plain, prompts, tmp_path_factory):
    draft_dir = ensure_checkpoint("tiny", layers=2, seed=1, root=tmp_path_factory.mktemp("draft"))
    engine = Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache", speculative=str(draft_dir))
    for i in (0, 7):
        got = engine.generate(prompts[i], max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
        assert got.token_ids == plain("kv_cache", prompts[i], do_sample=False, stop_token_ids=[])
        assert got.extra["drafter"] == "draft_model"
    batch = engine.generate_batch([prompts[0], prompts[7]], max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
    assert [r.token_ids for r in batch] == [plain("kv_cache", prompts[i], do_sample=False, stop_token_ids=[])
                                            for i in (0, 7)]


def test_sampled_speculation_keeps_the_models_distribution():
    """The first emitted token must be distributed as the model's own first-position distribution."""
    counts, probs = first_token_counts(verify_tokens)
    assert chi_square(counts, probs) < CHI2_CRITICAL_DF4, (counts, probs)


def test_the_chi_square_test_catches_a_wrong_rule():
    """Negative control: accepting a draft whenever p(x) > 0.2 (instead of with probability p(x))."""
    def wrong(logits, draft, state, mode):
        accepted, nxt = verify_tokens(logits, draft, state, mode)
        p = logits[0, 0].softmax(-1)[draft[0, 0]]
        return torch.tensor([1 if p > 0.2 else 0]), nxt

    counts, probs = first_token_counts(wrong, draws=5_000)
    assert chi_square(counts, probs) > CHI2_CRITICAL_DF4


def test_sampled_generation_is_seeded(spec_engines, prompts):
    engine = spec_engines("kv_cache")
    a = engine.generate(prompts[2], max_new_tokens=24, do_sample=True, seed=9, stop_token_ids=[]).token_ids
    b = engine.generate(prompts[2], max_new_tokens=24, do_sample=True, seed=9, stop_token_ids=[]).token_ids
    assert a == b and len(a) == 24


def test_naive_stage_refuses_speculation(tiny_dir):
    from engine_lib.errors import UnsupportedOptionError

    with pytest.raises(UnsupportedOptionError, match="needs a KV cache"):
        Engine.from_pretrained(tiny_dir, device="cpu", stage="naive", speculative="prompt_lookup")


def test_draft_start_is_where_the_lookup_draft_begins():
    ctx = [5, 1, 2, 3, 9, 8, 7, 1, 2, 3]
    start = PromptLookup.draft_start(ctx, 3)
    assert start == 4 and ctx[start:start + 3] == PromptLookup.lookup(ctx, 3)  # after the earlier [1, 2, 3]
    assert PromptLookup.draft_start([1, 2, 3, 4], 3) is None
