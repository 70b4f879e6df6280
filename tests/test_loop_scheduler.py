"""The paged cache and the continuous-batching scheduler, without HTTP: every request's tokens
equal its solo batch-1 run (``Engine.generate``, stage kv_cache, fp32) token for token."""

import random
import threading
import time

import pytest
import torch
from scheduler_helpers import prefill_rows, run_queued, wait_done, wait_tokens

from engine_lib.cache.blocks import BlockAllocator, OutOfBlocks, blocks_for
from engine_lib.cache.paged import BLOCK_SIZE, RESERVED, PagedKVCache
from engine_lib.loop.config import SchedulerConfig
from engine_lib.loop.model_runner import ModelRunner
from engine_lib.loop.sequence import Delta, Finished, StopText
from engine_lib.loop.serving import QueueFull, ServingLoop
from engine_lib.step.forward import Row, paged_forward

WORDS = "the quick brown fox jumps over a lazy dog while servers batch many users at once".split()


def ragged_prompts(engine, n, seed=0, most=60):
    rng = random.Random(seed)
    return [engine.encode(" ".join(rng.choices(WORDS, k=rng.randint(1, most)))) for _ in range(n)]


def solo(engine, ids, n, **options):
    return engine.generate(ids, max_new_tokens=n, do_sample=False, **options).token_ids


def make_scheduler(engine, gib=0.02, max_model_len=None, **config):
    cache = PagedKVCache.from_budget(engine.config, gib, engine.dtype, "cpu")
    return ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(**config), max_model_len=max_model_len)


@pytest.fixture
def engine(engines):
    return engines("kv_cache")


LOOPS = [dict(decode_steps=1), dict(decode_steps=4), dict(speculative="prompt_lookup")]  # one step, run ahead, drafts


def test_allocator_is_all_or_nothing():
    a = BlockAllocator(6, RESERVED)
    assert a.usable == a.num_free == 6 - RESERVED
    got = a.allocate(3)
    assert len(set(got)) == 3 and min(got) >= RESERVED
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    assert a.num_free == 1  # a failed allocation takes nothing
    a.free(got)
    assert a.num_free == 4
    assert blocks_for(16, BLOCK_SIZE) == 1 and blocks_for(17, BLOCK_SIZE) == 2


def test_paged_forward_equals_the_contiguous_cache(engine):
    """Rows of different lengths through scattered blocks give the logits of a plain batch-1 prefill."""
    cache = PagedKVCache(engine.config.num_hidden_layers, engine.config.num_key_value_heads, engine.config.head_dim,
                         num_blocks=40, dtype=torch.float32, device="cpu")
    prompts = ragged_prompts(engine, 3, seed=1)
    tables = [cache.allocator.allocate(blocks_for(len(p) + 1, BLOCK_SIZE)) for p in prompts]
    tables[1].reverse()  # blocks need not be in order
    logits = paged_forward(engine.model, cache, [Row(p, 0, t) for p, t in zip(prompts, tables)])
    for p, row in zip(prompts, logits):
        ref = engine.logits(p)[-1]
        torch.testing.assert_close(row.float(), ref, rtol=1e-4, atol=1e-4)
    # one decode token each, rows at different lengths
    nxt = [int(r.argmax()) for r in logits]
    step = paged_forward(engine.model, cache, [Row([t], len(p), tb) for p, t, tb in zip(prompts, nxt, tables)])
    for p, t, row in zip(prompts, nxt, step):
        torch.testing.assert_close(row.float(), engine.logits(p + [t])[-1], rtol=1e-4, atol=1e-4)


def test_a_prompt_chunk_and_decode_rows_in_one_forward_cost_their_real_tokens(engine):
    """A prefill forward with one-token decode rows beside a prompt (the scheduler's riders): each row's logits are
    its own, and the MLP sees the real tokens only, not rows x the prompt's length."""
    cache = PagedKVCache(engine.config.num_hidden_layers, engine.config.num_key_value_heads, engine.config.head_dim,
                         num_blocks=40, dtype=torch.float32, device="cpu")
    prompts = ragged_prompts(engine, 4, seed=5, most=30)
    tables = [cache.allocator.allocate(blocks_for(len(p) + 1, BLOCK_SIZE)) for p in prompts]
    first = paged_forward(engine.model, cache, [Row(p, 0, t) for p, t in zip(prompts[:3], tables)])
    nxt = [int(r.argmax()) for r in first]
    rows = [Row(prompts[3], 0, tables[3])] + [Row([t], len(p), tb) for p, t, tb in zip(prompts, nxt, tables)]
    seen = []
    hook = engine.model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[:-1].numel()))
    try:
        mixed = paged_forward(engine.model, cache, rows)
    finally:
        hook.remove()
    assert seen == [len(prompts[3]) + 3] and len(prompts[3]) > 1
    torch.testing.assert_close(mixed[0].float(), engine.logits(prompts[3])[-1], rtol=1e-4, atol=1e-4)
    for p, t, row in zip(prompts, nxt, mixed[1:]):
        torch.testing.assert_close(row.float(), engine.logits(p + [t])[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loop", LOOPS, ids=["one_step", "run_ahead", "speculative"])
def test_sixteen_ragged_requests_arriving_at_different_times_equal_solo(engine, loop):
    """Run ahead: once nothing waits, decode batches run four steps ahead of the host. Speculative: greedy
    rows with a draft verify it, beside the others' decode batch."""
    prompts = ragged_prompts(engine, 16)
    n = [8 + (7 * i) % 17 for i in range(16)]  # different max_tokens too
    want = [solo(engine, p, k) for p, k in zip(prompts, n)]
    sched = make_scheduler(engine, prefill_chunk=48, **loop).start()  # long prompts: in chunks
    try:
        results = [None] * 16
        done = threading.Event()

        def submit_all():
            rng = random.Random(3)
            for i, (p, k) in enumerate(zip(prompts, n)):
                texts = []

                def sink(ev, i=i, texts=texts):
                    if isinstance(ev, Delta):
                        texts.append(ev.text)
                    else:
                        results[i] = ev
                        if all(r is not None for r in results):
                            done.set()

                seq = sched.new_sequence(p, engine.sampling(do_sample=False, max_tokens=k), sink=sink)
                seqs.append(seq)
                sched.submit(seq)
                time.sleep(rng.choice([0, 0, 0.005, 0.02]))

        seqs = []
        submit_all()
        assert done.wait(120)
        for i, seq in enumerate(seqs):
            assert seq.output_ids == want[i], f"request {i} ({len(prompts[i])} prompt tokens) differs from solo"
            assert results[i].reason in ("length", "stop")
        assert sched.cache.allocator.num_free == sched.cache.allocator.usable
        assert sched.metrics.generation_tokens == sum(len(w) for w in want)
        assert sched.metrics.accepted > 0 if "speculative" in loop else sched.metrics.drafted == 0
    finally:
        sched.stop()


@pytest.mark.parametrize("invariant", [False, True])
def test_prompts_admitted_together_are_prefilled_in_one_forward(engine, monkeypatch, invariant):
    """The weights are read once for all of a step's prompt chunks; a batch-invariant server runs
    each alone. Either way every request's tokens are its solo ones."""
    prompts = ragged_prompts(engine, 5, seed=7, most=20)
    want = [solo(engine, p, 6) for p in prompts]
    rows = prefill_rows(monkeypatch)
    sched = make_scheduler(engine, batch_invariant=invariant, prefix_caching=False)
    seqs = [sched.new_sequence(p, engine.sampling(do_sample=False, max_tokens=6)) for p in prompts]
    run_queued(sched, seqs)
    assert [s.output_ids for s in seqs] == want
    assert sum(rows) == len(prompts)
    assert max(rows) == (1 if invariant else len(prompts)), rows


@pytest.mark.parametrize("loop", LOOPS, ids=["one_step", "run_ahead", "speculative"])
def test_block_exhaustion_queues_and_preempts_without_changing_outputs(engine, loop):
    prompts = ragged_prompts(engine, 8, seed=5, most=30)
    want = [solo(engine, p, 24) for p in prompts]
    per_block = 16 * 2 * engine.config.num_hidden_layers * engine.config.num_key_value_heads * engine.config.head_dim * 4
    sched = make_scheduler(engine, gib=(RESERVED + 12) * per_block / 2**30,  # 12 blocks: about 3 requests
                           **loop).start()
    try:
        got = sched.generate(prompts, engine.sampling(do_sample=False, max_tokens=24))
    finally:
        sched.stop()
    assert [r.token_ids for r in got] == want
    assert sched.metrics.preemptions > 0, "the budget was meant to force preemption"
    assert sched.metrics.accepted > 0 if "speculative" in loop else sched.metrics.drafted == 0
    assert sched.cache.allocator.num_free == sched.cache.allocator.usable


def test_cancel_midway_frees_its_blocks_at_once(engine):
    prompts = ragged_prompts(engine, 3, seed=7)
    want = [solo(engine, p, 40) for p in prompts]
    sched = make_scheduler(engine).start()
    try:
        events = {i: [] for i in range(3)}
        seqs = [sched.new_sequence(p, engine.sampling(do_sample=False, max_tokens=40), sink=events[i].append)
                for i, p in enumerate(prompts)]
        for s in seqs:
            sched.submit(s)
        wait_tokens(seqs[1], 5)
        sched.cancel(seqs[1].id)
        wait_done([seqs[1]])
        assert seqs[1].blocks == [] and seqs[1] not in sched.scheduler.active
        wait_done(seqs)
        assert isinstance(events[1][-1], Finished) and events[1][-1].reason == "cancelled"
        assert len(seqs[1].output_ids) < 40
        assert seqs[0].output_ids == want[0] and seqs[2].output_ids == want[2]
        assert sched.cache.allocator.num_free == sched.cache.allocator.usable
        assert sched.metrics.requests["cancelled"] == 1
    finally:
        sched.stop()


@pytest.mark.parametrize("steps", [1, 8])
def test_stop_string_ends_the_reply_before_it(engine, steps):
    """``steps`` 8: the tokens made after the stop string, in the same run ahead, are dropped."""
    prompt = ragged_prompts(engine, 1, seed=11)[0]
    ids = solo(engine, prompt, 40)
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    at = next(i for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].isalnum())
    stop = text[at:at + 3]
    sched = make_scheduler(engine, decode_steps=steps).start()
    try:
        got = sched.generate([prompt], engine.sampling(do_sample=False, max_tokens=40, stop=(stop,)))[0]
    finally:
        sched.stop()
    assert got.finish_reason == "stop"
    assert got.text == text[:text.find(stop)]
    assert got.token_ids == ids[:len(got.token_ids)] and len(got.token_ids) < len(ids)


def test_stop_text_holds_back_a_possible_stop_string():
    class Chars:  # a "tokenizer" whose token i is chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    st = StopText(Chars(), ("END",))
    out = [st.push(ord(c)) for c in "abEN"]
    assert "".join(t for t, _ in out) == "ab"  # "EN" might start "END"
    assert st.push(ord("X")) == ("ENX", False)
    assert st.push(ord("E"))[0] == "" and st.push(ord("N"))[0] == ""
    assert st.push(ord("D")) == ("", True)
    assert st.text == "abENX"


@pytest.mark.parametrize("invariant", [False, True])
def test_running_decodes_ride_along_in_a_prefill_forward(engine, monkeypatch, invariant):
    """A step that prefills takes the running decode rows into the same forward (the weights read once), each
    picking its next token as alone: greedy, seeded, with a repetition penalty. A batch-invariant server keeps
    them apart, in a decode batch of their own."""
    prompts = ragged_prompts(engine, 4, seed=11, most=40)
    settings = [dict(do_sample=True, temperature=0.9, top_k=30, seed=5), dict(do_sample=False, repetition_penalty=1.3),
                dict(do_sample=False), dict(do_sample=True, temperature=1.1, seed=9)]
    want = [engine.generate(p, max_new_tokens=10, **s).token_ids for p, s in zip(prompts, settings)]
    forwards, real = [], ModelRunner.execute

    def recording(self, batch):  # per forward: is it a prefill, and which of its rows are past their prompt
        forwards.append((batch.prefill, [r.start >= len(s.prompt_ids) for s, r in zip(batch.seqs, batch.rows)]))
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    sched = make_scheduler(engine, batch_invariant=invariant, prefill_chunk=16, prefix_caching=False).start()
    try:
        seqs = [sched.new_sequence(p, engine.sampling(**s, max_tokens=10)) for p, s in zip(prompts, settings)]
        sched.submit(seqs[0])
        wait_tokens(seqs[0], 2)  # decoding when the others arrive; their prompts take several 16-token chunks
        for seq in seqs[1:]:
            sched.submit(seq)
        wait_done(seqs)
    finally:
        sched.stop()
    assert [s.output_ids for s in seqs] == want
    mixed = [rows for prefill, rows in forwards if prefill and any(rows)]
    if invariant:
        assert not mixed, forwards
    else:  # the prompt chunks first, then the riders
        assert mixed and all(not rows[0] and rows[-1] for rows in mixed), forwards


@pytest.mark.parametrize("steps", [1, 4])
def test_each_request_keeps_its_own_sampling_settings_and_seed(engine, steps):
    prompts = ragged_prompts(engine, 4, seed=2)
    settings = [dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7),
                dict(do_sample=True, temperature=1.2, seed=8), dict(do_sample=False, repetition_penalty=1.3)]
    want = [engine.generate(p, max_new_tokens=12, **s).token_ids for p, s in zip(prompts, settings)]
    sched = make_scheduler(engine, decode_steps=steps).start()
    try:
        got = sched.generate(prompts, [engine.sampling(**s, max_tokens=12) for s in settings])
    finally:
        sched.stop()
    assert [r.token_ids for r in got] == want


@pytest.mark.parametrize("steps", [1, 4])
def test_batch_invariant_mode_gives_the_same_tokens_alone_and_together(engine, steps):
    prompts = ragged_prompts(engine, 6, seed=4)
    sched = make_scheduler(engine, batch_invariant=True, prefill_chunk=32, max_model_len=256,
                           decode_steps=steps).start()
    try:
        alone = [sched.generate([p], engine.sampling(do_sample=False, max_tokens=16))[0].token_ids for p in prompts]
        together = [r.token_ids for r in sched.generate(prompts, engine.sampling(do_sample=False, max_tokens=16))]
    finally:
        sched.stop()
    assert together == alone


def test_queue_limit_refuses_and_impossible_requests_are_refused(engine):
    sched = make_scheduler(engine, max_queue=2)  # not started: submit only looks at the queues
    greedy = engine.sampling(do_sample=False, max_tokens=4)
    sched.submit(sched.new_sequence([1, 2, 3], greedy))
    sched.submit(sched.new_sequence([1, 2, 3], greedy))
    with pytest.raises(QueueFull):
        sched.submit(sched.new_sequence([1, 2, 3], greedy))
    with pytest.raises(ValueError, match="does not fit"):
        sched.submit(sched.new_sequence([1, 2, 3], greedy.merged(max_tokens=sched.cache.capacity_tokens)))


def test_logprobs_survive_chunked_prefill_and_preemption(engine):
    """Prompt and token logprobs, with prompts prefilled in chunks of 8 and a cache so small that
    sequences are preempted and recomputed: each prompt is scored once, fully, as the engine's forward."""
    from engine_lib.loop.sequence import PromptLogprobs

    prompts = ragged_prompts(engine, 6, seed=5, most=30)
    per_block = 16 * 2 * engine.config.num_hidden_layers * engine.config.num_key_value_heads * engine.config.head_dim * 4
    sched = make_scheduler(engine, gib=(RESERVED + 12) * per_block / 2**30, prefill_chunk=8).start()
    events = {i: [] for i in range(len(prompts))}
    try:
        seqs = [sched.new_sequence(p, engine.sampling(do_sample=False, max_tokens=24, logprobs=2, prompt_logprobs=1),
                                   sink=events[i].append) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.submit(s)
        wait_done(seqs, 120)
    finally:
        sched.stop()
    assert sched.metrics.preemptions > 0, "the budget was meant to force preemption"
    for i, (p, seq) in enumerate(zip(prompts, seqs)):
        ref = engine.logits(p + seq.output_ids).log_softmax(-1)
        scored = [ev for ev in events[i] if isinstance(ev, PromptLogprobs)]
        assert len(scored) == 1 and len(scored[0].entries) == len(p) and scored[0].entries[0] is None
        got = [e.logprob for e in scored[0].entries[1:]]
        assert got == pytest.approx([float(ref[j, p[j + 1]]) for j in range(len(p) - 1)], abs=1e-3)
        tokens = [e for ev in events[i] if isinstance(ev, Delta) for e in ev.logprobs]
        assert [e.token for e in tokens] == seq.output_ids
        assert [e.logprob for e in tokens] == pytest.approx(
            [float(ref[len(p) - 1 + j, t]) for j, t in enumerate(seq.output_ids)], abs=1e-3)
        assert all(e.top[0][0] == e.token for e in tokens)  # greedy: the chosen one is the most likely


@pytest.mark.parametrize("stage", ["kv_cache", "fused"])
def test_rows_with_logits_adjustments_are_picked_in_the_step_as_the_host_picks_them(engines, stage, monkeypatch):
    """logit_bias, presence and frequency penalties, min_tokens and min_p, greedy and seeded, batched
    with plain rows: picked inside the decode step, each row gets the tokens its own sampler picks on
    the host from the same logits."""
    from engine_lib.loop.sampler import RowSampler

    engine = engines(stage)
    prompts = ragged_prompts(engine, 6, seed=9, most=20)
    eos = engine.sampling().stop_token_ids
    greedy, seeded = dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=30, seed=11)
    requests = [(greedy, {}), (greedy, dict(logit_bias=((int(prompts[1][0]), 6.0),))),
                (greedy, dict(presence_penalty=1.5, frequency_penalty=1.0, min_tokens=4)),
                (seeded, dict(min_p=0.2, frequency_penalty=0.5)), (seeded, {}),
                (dict(do_sample=False, repetition_penalty=1.2), dict(logit_bias=((int(prompts[5][-1]), -3.0),)))]

    def served(in_step: bool) -> list[list[int]]:
        if not in_step:
            monkeypatch.setattr(RowSampler, "in_step", property(lambda self: False))
        host = []
        real = RowSampler.pick
        monkeypatch.setattr(RowSampler, "pick", lambda self, logits: host.append(1) or real(self, logits))
        sched = make_scheduler(engine)
        seqs = [sched.new_sequence(p, engine.sampling(**s, **x, stop_token_ids=eos, max_tokens=12))
                for p, (s, x) in zip(prompts, requests)]
        run_queued(sched, seqs, 120)
        monkeypatch.undo()
        # in the step, the host picks only the prefills' first tokens (row 0's comes from a shared argmax)
        assert (len(host) == len(prompts) - 1) == in_step
        return [s.output_ids for s in seqs]

    in_step = served(True)
    assert in_step == served(False)
    plain = [engine.generate(prompts[i], max_new_tokens=12, **requests[i][0], stop_token_ids=eos).token_ids
             for i in (0, 4)]
    assert [in_step[0], in_step[4]] == plain
    assert in_step[1].count(int(prompts[1][0])) > 0  # the bias shows


def decode_steps_run(monkeypatch) -> list[int]:
    """The ``steps`` of every decode batch the scheduler runs from now on, in order."""
    seen, real = [], ModelRunner.execute

    def recording(self, batch):
        if not batch.prefill:
            seen.append(batch.steps)
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return seen


def test_a_lone_decode_runs_ahead_and_the_host_reads_once_per_run(engine, monkeypatch):
    """One request of 10 tokens at ``decode_steps`` 4: the prefill picks the first, then runs of 4, 4
    and the 1 left; the tokens are the solo ones, and the host copied them over once per run."""
    prompt = ragged_prompts(engine, 1, seed=3)[0]
    want = solo(engine, prompt, 10, stop_token_ids=[])
    steps = decode_steps_run(monkeypatch)
    reads, tolist = [], torch.Tensor.tolist

    def counting(t):
        reads.append(tuple(t.shape))
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    sched = make_scheduler(engine, decode_steps=4)
    seq = sched.new_sequence(prompt, engine.sampling(do_sample=False, stop_token_ids=[], max_tokens=10))
    run_queued(sched, [seq])
    assert seq.output_ids == want
    assert steps == [4, 4, 1]
    assert [r for r in reads if r in ((1, 4), (1,))].count((1, 4)) == 2  # one read per run ahead


def test_a_stop_token_inside_a_run_drops_what_came_after_it(engine, monkeypatch):
    prompt = ragged_prompts(engine, 1, seed=3)[0]
    free = solo(engine, prompt, 12, stop_token_ids=[])
    stop = next(t for t in free[3:] if t not in free[:3])  # first made inside the first run of 8
    sched = make_scheduler(engine, decode_steps=8)
    seq = sched.new_sequence(prompt, engine.sampling(do_sample=False, stop_token_ids=[stop], max_tokens=12))
    steps = decode_steps_run(monkeypatch)
    run_queued(sched, [seq])
    assert seq.output_ids == free[:free.index(stop)] and steps[0] == 8
    assert sched.cache.allocator.num_free == sched.cache.allocator.usable  # its run-ahead blocks came back


def test_rows_that_need_the_host_between_tokens_run_one_step_at_a_time(engine):
    """Logprobs, a logits adjustment (min_tokens), a draft to verify or a waiting request keep a batch at one step."""
    from engine_lib.loop.sampler import RowSampler

    loop = make_scheduler(engine, decode_steps=4)
    sched = loop.scheduler

    def admitted(**options):
        seq = loop.new_sequence([1, 2, 3], engine.sampling(do_sample=False, max_tokens=20, **options))
        seq.sampler = RowSampler(seq.params, loop.vocab_size, "cpu")
        return seq

    plain = admitted()
    assert sched.steps_ahead([plain]) == 4
    assert sched.steps_ahead([plain, admitted(logprobs=2)]) == 1
    assert sched.steps_ahead([plain, admitted(min_tokens=5)]) == 1
    drafting = admitted()
    drafting.draft_k = 2  # speculates: its next forward verifies a draft (EngineCore._with_drafts)
    assert sched.steps_ahead([plain, drafting]) == 1
    plain.output_ids = [7] * 18  # two tokens left
    assert sched.steps_ahead([plain]) == 2
    sched.waiting.append(admitted())
    assert sched.steps_ahead([admitted()]) == 1
    assert make_scheduler(engine).scheduler.decode_steps == 1  # on a CPU, by default
    with pytest.raises(ValueError, match="decode_steps must be a whole number"):
        SchedulerConfig(decode_steps=0)
