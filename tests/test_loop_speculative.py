"""Speculative decoding in the token loop (``SchedulerConfig.speculative``): greedy rows that find a
draft in their own context verify it in one forward and keep what the model agrees with. The replies
are those of plain decoding, token for token (fp32, tiny checkpoint); a drafter that knows the
continuation shows the mechanics (fewer forwards, a stop inside the kept drafts, ``max_tokens``)."""

import random

import pytest
from scheduler_helpers import run_queued

from engine_lib.cache.paged import PagedKVCache
from engine_lib.errors import OptionValueError
from engine_lib.loop.config import SchedulerConfig
from engine_lib.loop.engine_core import FIRST_DRAFT
from engine_lib.loop.metrics import parse
from engine_lib.loop.model_runner import ModelRunner
from engine_lib.loop.serving import ServingLoop
from engine_lib.speculative import PromptLookup, Replay

WORDS = "the quick brown fox jumps over a lazy dog while servers batch many users at once".split()


@pytest.fixture
def engine(engines):
    return engines("kv_cache")


def prompts(engine, n, seed=0):
    rng = random.Random(seed)
    return [engine.encode(" ".join(rng.choices(WORDS, k=rng.randint(1, 60)))) for _ in range(n)]


def serve(engine, prompt_ids, options, max_tokens, **config):
    """Every prompt queued at once, the loop run to the end: -> (each reply's tokens, the scheduler)."""
    cache = PagedKVCache.from_budget(engine.config, 0.02, engine.dtype, "cpu")
    sched = ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(**config))
    seqs = [sched.new_sequence(p, engine.sampling(**o, max_tokens=max_tokens)) for p, o in zip(prompt_ids, options)]
    run_queued(sched, seqs)
    return [s.output_ids for s in seqs], sched


def batches_run(monkeypatch) -> list[tuple[str, int]]:
    """(kind, rows) of every batch the runner executes from now on: 'prefill', 'verify' or 'decode'."""
    seen, real = [], ModelRunner.execute

    def recording(self, batch):
        kind = "prefill" if batch.prefill else "verify" if batch.drafts else "decode"
        seen.append((kind, len(batch.rows)))
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return seen


def test_greedy_replies_with_speculation_equal_plain_decoding(engine, monkeypatch):
    """Eight ragged greedy requests, every third with a repetition penalty: the same tokens with and
    without speculation, some drafts kept (so the verify path made tokens), every block returned."""
    ids = prompts(engine, 8)
    options = [dict(do_sample=False, **({"repetition_penalty": 1.3} if i % 3 == 2 else {})) for i in range(8)]
    want, _ = serve(engine, ids, options, 40)
    ran = batches_run(monkeypatch)
    got, sched = serve(engine, ids, options, 40, speculative="prompt_lookup")
    assert got == want
    assert any(kind == "verify" for kind, _ in ran)
    drafted, accepted = sched.metrics.drafted, sched.metrics.accepted
    assert 0 < accepted < drafted
    counters = parse(sched.metrics.render())
    assert counters["engine_spec_decode_accepted_tokens_total"] == accepted
    assert sched.cache.allocator.num_free == sched.cache.allocator.usable
    assert sched.metrics.generation_tokens == sum(map(len, want))


def knows_the_reply(monkeypatch, replies: dict[tuple[int, ...], list[int]]) -> None:
    """The server's drafter proposes the true continuation (chapter 11's ``Replay``): every draft is kept."""
    replay = Replay(list(replies.values()), [list(p) for p in replies])
    monkeypatch.setattr(PromptLookup, "propose", lambda self, requests: replay.propose(requests))


def test_kept_drafts_make_several_tokens_per_forward(engine, monkeypatch):
    """A lone greedy request of 20 tokens whose drafts are always right, 4 at a time: the prefill makes
    the first token and each verify forward 5 more (4 kept drafts and the model's next), so 4 verifies."""
    ids = prompts(engine, 1, seed=5)
    want, _ = serve(engine, ids, [dict(do_sample=False, stop_token_ids=[])], 20)
    knows_the_reply(monkeypatch, {tuple(ids[0]): want[0]})
    ran = batches_run(monkeypatch)
    got, sched = serve(engine, ids, [dict(do_sample=False, stop_token_ids=[])], 20, speculative="prompt_lookup")
    assert got == want
    assert ran == [("prefill", 1)] + [("verify", 1)] * 4
    assert (sched.metrics.drafted, sched.metrics.accepted) == (15, 15)  # 4 + 4 + 4 + 3: none past max_tokens


def test_a_stop_token_among_kept_drafts_drops_what_follows(engine, monkeypatch):
    ids = prompts(engine, 1, seed=5)
    free, _ = serve(engine, ids, [dict(do_sample=False, stop_token_ids=[])], 20)
    free = free[0]
    stop = next(t for t in free[2:] if t not in free[:2])  # made inside the first verify's kept drafts
    knows_the_reply(monkeypatch, {tuple(ids[0]): free})
    got, sched = serve(engine, ids, [dict(do_sample=False, stop_token_ids=[stop])], 20, speculative="prompt_lookup")
    assert got == [free[:free.index(stop)]]
    assert sched.cache.allocator.num_free == sched.cache.allocator.usable


def test_sampled_rows_decode_one_token_at_a_time_beside_verifying_ones(engine, monkeypatch):
    """Seeded sampled requests never speculate (their draws must stay those of plain decoding): they get
    the tokens they get without speculation, in decode batches of their own while greedy rows verify."""
    ids = prompts(engine, 4, seed=2)
    options = [dict(do_sample=False), dict(do_sample=True, seed=7), dict(do_sample=False),
               dict(do_sample=True, seed=8, temperature=0.8)]
    want, _ = serve(engine, ids, options, 24)
    replies = {tuple(p): w for p, w in zip(ids, want)}
    knows_the_reply(monkeypatch, replies)
    verify_rows = []
    real = ModelRunner.execute

    def recording(self, batch):
        if batch.drafts:
            verify_rows.extend(s.sampler.mode.greedy for s in batch.seqs)
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)  # the drafter would draft for any row it is asked for
    got, _ = serve(engine, ids, options, 24, speculative="prompt_lookup")
    assert got == want
    assert verify_rows and all(verify_rows)


def test_the_loops_draft_rule_skips_sampled_rows_and_the_last_token(engine, monkeypatch):
    """``EngineCore._with_drafts`` asks the drafter for greedy rows only, at most for the tokens left after the
    model's own next one; a row with a draft verifies it, the others stay one decode batch."""
    cache = PagedKVCache.from_budget(engine.config, 0.02, engine.dtype, "cpu")
    core = ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(speculative="prompt_lookup")).core
    ids = [1, 2, 3, 1, 2, 3, 1, 2]  # the tail (1, 2) recurs: "3, 1, 2" followed it
    greedy = core.new_sequence(ids, engine.sampling(do_sample=False, max_tokens=10))
    sampled = core.new_sequence(ids, engine.sampling(do_sample=True, seed=1, max_tokens=10))
    last = core.new_sequence(ids, engine.sampling(do_sample=False, max_tokens=1))
    for seq in (greedy, sampled, last):
        core.add(seq)
    for seq in core.scheduler.admit():
        core._admitted(seq)
    assert (greedy.draft_k, sampled.draft_k, last.draft_k) == (FIRST_DRAFT, 0, FIRST_DRAFT)
    for seq in (greedy, sampled, last):
        seq.computed = seq.length - 1  # as if prefilled up to the newest token: each is a decode row
    (batch,) = core.scheduler.schedule()
    assert not batch.prefill and batch.seqs == (greedy, sampled, last)
    asked, real = [], PromptLookup.propose
    monkeypatch.setattr(PromptLookup, "propose", lambda self, requests: asked.extend(requests) or real(self, requests))
    verify, plain = core._with_drafts(batch)
    assert asked == [(greedy, FIRST_DRAFT)]  # last: its one token is the model's own, nothing to draft
    assert verify.seqs == (greedy,) and verify.drafts == ((3, 1, 2),)
    assert verify.rows[0].tokens == [2, 3, 1, 2] and verify.rows[0].start == len(ids) - 1
    assert plain.seqs == (sampled, last) and not plain.drafts


@pytest.mark.parametrize("config", [dict(speculative="draft_model"), dict(speculative="ngram"),
                                    dict(speculative="prompt_lookup", speculative_tokens=0)])
def test_unknown_speculative_options_are_refused_by_name(config):
    with pytest.raises(OptionValueError, match="speculative"):
        SchedulerConfig(**config)
