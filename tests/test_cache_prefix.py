"""Automatic prefix caching: chained block keys, reference counts, LRU eviction, and the
scheduler's outputs unchanged by it while it computes fewer prompt tokens."""

import random
import time

import pytest
from scheduler_helpers import prefill_rows, run_queued, wait_done, wait_tokens

from engine_lib.cache.blocks import OutOfBlocks
from engine_lib.cache.paged import RESERVED, PagedKVCache
from engine_lib.cache.prefix import PrefixCachingAllocator, block_key
from engine_lib.loop.config import SchedulerConfig
from engine_lib.loop.model_runner import ModelRunner
from engine_lib.loop.serving import ServingLoop

BS = 4  # a small block size for the allocator tests: few tokens per block
WORDS = "the quick brown fox jumps over a lazy dog while servers batch many users at once".split()


def sealed(alloc, tokens):
    """A sequence of ``tokens`` admitted, fully computed and keyed; -> its blocks (still held)."""
    blocks, cached = alloc.acquire(tokens, -(-len(tokens) // BS))
    alloc.seal(blocks, tokens, len(tokens))
    return blocks, cached


def test_block_keys_chain_over_the_prefix():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert block_key(None, a) == block_key(None, list(a))
    assert block_key(block_key(None, a), b) != block_key(block_key(None, [9, 9, 9, 9]), b)
    alloc = PrefixCachingAllocator(RESERVED + 16, BS)
    first, _ = sealed(alloc, a + b + [0])
    # the same second block under another first block is not a hit
    _, cached = sealed(alloc, [9, 9, 9, 9] + b + [0])
    assert cached == 0
    blocks, cached = alloc.acquire(a + b + [0, 1], 3)
    assert cached == 2 * BS and blocks[:2] == first[:2] and blocks[2] not in first
    assert alloc.refs[first[0]] == 2


def test_the_block_of_the_last_token_is_never_matched():
    """A prompt made only of cached blocks still computes its last block: its logits pick the next token."""
    alloc = PrefixCachingAllocator(RESERVED + 8, BS)
    tokens = list(range(2 * BS))
    first, _ = sealed(alloc, tokens)
    again, cached = alloc.acquire(tokens, 2)
    assert cached == BS and again[0] == first[0] and again[1] != first[1]


def test_refcounts_keep_blocks_cached_and_eviction_is_least_recently_released():
    alloc = PrefixCachingAllocator(RESERVED + 4, BS)
    x, y = [1] * BS + [2], [3] * BS + [4]
    bx, _ = sealed(alloc, x)  # 2 blocks, the first keyed
    by, _ = sealed(alloc, y)
    assert alloc.num_free == 0 and alloc.num_cached == 2
    with pytest.raises(OutOfBlocks):
        alloc.acquire(x, 2)  # the hit is held already, but there is no block for the rest
    alloc.free(bx)
    assert alloc.num_free == 2 and alloc.num_cached == 2  # released, still findable
    alloc.free(by)
    assert alloc.num_free == 4 and alloc.num_cached == 2
    assert alloc.lookup(x) == bx[:1] and alloc.lookup(y) == by[:1]
    # the free list first, then x's keyed block (released before y's): y stays findable
    fresh = alloc.allocate(3)
    assert bx[0] in fresh and by[0] not in fresh and alloc.num_cached == 1
    assert alloc.lookup(x) == [] and alloc.lookup(y) == by[:1]
    alloc.allocate(1)  # the last one: y's block goes too
    assert alloc.lookup(y) == [] and alloc.num_cached == 0 and alloc.num_free == 0


def test_a_released_chain_is_evicted_tail_first():
    alloc = PrefixCachingAllocator(RESERVED + 4, BS)
    tokens = list(range(3 * BS + 1))
    blocks, _ = sealed(alloc, tokens)  # 3 keyed blocks and a partial one
    alloc.free(blocks)
    alloc.allocate(2)  # the free block, then the chain's last keyed block
    assert alloc.lookup(tokens) == blocks[:2]


def test_acquire_is_all_or_nothing_and_counts_taking_an_unheld_hit():
    alloc = PrefixCachingAllocator(RESERVED + 3, BS)
    bx, _ = sealed(alloc, [1] * BS + [2])
    alloc.free(bx)
    assert alloc.num_free == 3
    before = dict(alloc.refs), alloc.num_free
    with pytest.raises(OutOfBlocks):
        alloc.acquire([1] * BS + [2] * 5, 3, reserve=1)  # 1 hit (unheld) + 2 fresh + 1 kept > 3
    assert (dict(alloc.refs), alloc.num_free) == before
    blocks, cached = alloc.acquire([1] * BS + [2] * 5, 3)
    assert cached == BS and blocks[0] == bx[0] and alloc.num_free == 0


def test_reuse_swaps_unwritten_blocks_for_a_siblings_cached_ones():
    alloc = PrefixCachingAllocator(RESERVED + 8, BS)
    tokens = list(range(3 * BS + 1))
    a, _ = alloc.acquire(tokens, 4)
    b, _ = alloc.acquire(tokens, 4)  # admitted together: nothing cached yet
    alloc.seal(a, tokens, 2 * BS)  # a computed its first two blocks
    assert alloc.reuse(b, tokens, 0) == 2 * BS and b[:2] == a[:2] and alloc.refs[a[0]] == 2
    assert alloc.num_free == 8 - 6  # b's two unwritten blocks went back
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 8 and not alloc.refs


# ---------------------------------------------------------------- through the scheduler
@pytest.fixture(scope="module")
def engine(engines):
    return engines("kv_cache")


def make_scheduler(engine, gib=0.02, **config):
    cache = PagedKVCache.from_budget(engine.config, gib, engine.dtype, "cpu")
    return ServingLoop(engine.model, engine.tokenizer, cache, SchedulerConfig(**config))


def shared_prompts(engine, n, system_words=60, seed=0):
    rng = random.Random(seed)
    system = engine.encode("You are a helpful assistant. " + " ".join(rng.choices(WORDS, k=system_words)))
    return system, [system + engine.encode(f" Question {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12))))
                    for i in range(n)]


@pytest.fixture
def forwarded(monkeypatch):
    """Counts the tokens the scheduler pushes through the model (prefill and decode)."""
    count = [0]
    real = ModelRunner.execute

    def counting(self, batch):
        count[0] += sum(len(r.tokens) for r in batch.rows)
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", counting)
    return count


def run(engine, prompts, params, max_tokens, waves=1, **config):
    """The prompts in ``waves`` (each waits for the one before, so later waves find a warm cache)."""
    sched = make_scheduler(engine, **config).start()
    try:
        out, k = [], -(-len(prompts) // waves)
        for i in range(0, len(prompts), k):
            out += sched.generate(prompts[i:i + k], [sp.merged(max_tokens=max_tokens) for sp in params[i:i + k]])
    finally:
        sched.stop()
    return [r.token_ids for r in out], sched


def test_outputs_are_identical_with_prefix_caching_on_and_off(engine):
    """Greedy and seeded sampling, requests sharing a system prompt, in two waves (the second
    finds the first's blocks) and in chunks that do not line up with the shared prefix."""
    system, prompts = shared_prompts(engine, 8)
    settings = [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=30, seed=11)] * 4
    params = [engine.sampling(**s) for s in settings]
    off, _ = run(engine, prompts, params, 16, waves=2, prefill_chunk=48, prefix_caching=False)
    on, sched = run(engine, prompts, params, 16, waves=2, prefill_chunk=48)
    assert on == off
    assert sched.metrics.prefix_hits >= 4 * (len(system) // 16 * 16), "the second wave should find the system prompt"
    assert not sched.cache.allocator.refs and sched.cache.allocator.num_free == sched.cache.allocator.usable


def test_a_shared_prefix_is_not_computed_again(engine, forwarded):
    system, (p1, p2) = shared_prompts(engine, 2)
    greedy = [engine.sampling(do_sample=False, max_tokens=1)]  # max_tokens 1: the prefill only
    sched = make_scheduler(engine).start()
    try:
        sched.generate([p1], greedy)
        cold, forwarded[0] = forwarded[0], 0
        sched.generate([p2], greedy)
        warm = forwarded[0]
    finally:
        sched.stop()
    cached = len(system) // 16 * 16  # the system prompt's full blocks
    assert cold == len(p1)
    assert warm <= len(p2) - cached, f"{warm} tokens computed for a {len(p2)}-token prompt, {cached} of them cached"
    assert sched.metrics.prefix_hits == len(p2) - warm
    assert sched.metrics.prefix_queries == len(p1) + len(p2)


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(engine, forwarded):
    """``echo`` with logprobs needs the logits of every prompt position: no cached block for it
    (it still leaves its own blocks cached for others)."""
    _, (p1, p2) = shared_prompts(engine, 2)
    greedy = engine.sampling(do_sample=False, max_tokens=1)
    sched = make_scheduler(engine)
    seqs = [sched.new_sequence(p, sp) for p, sp in ((p1, greedy), (p1, greedy.merged(prompt_logprobs=0)), (p2, greedy))]
    assert seqs[1].prompt_entries == [None] and seqs[1].scores_prompt  # an echo with logprobs
    sched.start()
    try:
        for seq in seqs:
            sched.submit(seq)
            while not seq.done:
                time.sleep(0.005)
    finally:
        sched.stop()
    hits = sched.metrics.prefix_hits
    assert hits >= 16 and forwarded[0] == 2 * len(p1) + len(p2) - hits, "only the third request hits"
    assert sched.metrics.prefix_queries == len(p1) + len(p2)  # the second was not looked up


def test_same_prompt_siblings_share_their_blocks(engine, forwarded):
    """n copies of one prompt submitted together (what ``n > 1`` does): one prefill's full blocks serve all."""
    _, (prompt,) = shared_prompts(engine, 1, system_words=100)
    seeds = [engine.sampling(do_sample=True, temperature=1.0, seed=s, max_tokens=1) for s in (1, 2, 3)]
    sched = make_scheduler(engine).start()
    try:
        got = sched.generate([prompt] * 3, seeds)
    finally:
        sched.stop()
    assert all(r.finish_reason == "length" for r in got)
    assert forwarded[0] <= len(prompt) + 2 * (len(prompt) % 16 + 16)
    assert sched.metrics.prefix_hits == 3 * len(prompt) - forwarded[0]


def test_preemption_keeps_outputs_and_releases_every_reference(engine):
    _, prompts = shared_prompts(engine, 6, system_words=20)
    greedy = [engine.sampling(do_sample=False)] * len(prompts)
    want = [engine.generate(p, max_new_tokens=24, do_sample=False).token_ids for p in prompts]
    per_block = 16 * 2 * engine.config.num_hidden_layers * engine.config.num_key_value_heads * engine.config.head_dim * 4
    got, sched = run(engine, prompts, greedy, 24, gib=(RESERVED + 14) * per_block / 2**30)  # 14 blocks
    assert got == want
    assert sched.metrics.preemptions > 0, "the budget was meant to force preemption"
    assert sched.metrics.prefix_hits > 0
    a = sched.cache.allocator
    assert not a.refs and a.num_free == a.usable and 0 < a.num_cached <= a.usable


def test_cancelling_a_sharer_leaves_the_others_intact(engine):
    _, prompts = shared_prompts(engine, 3, system_words=40, seed=3)
    want = [engine.generate(p, max_new_tokens=40, do_sample=False).token_ids for p in prompts]
    sched = make_scheduler(engine).start()
    try:
        sched.generate(prompts[:1], [engine.sampling(do_sample=False, max_tokens=1)])  # warm the system prompt
        seqs = [sched.new_sequence(p, engine.sampling(do_sample=False, max_tokens=40)) for p in prompts]
        for s in seqs:
            sched.submit(s)
        wait_tokens(seqs[1], 5)
        shared = seqs[1].blocks[0]
        sched.cancel(seqs[1].id)
        wait_done(seqs)
    finally:
        sched.stop()
    assert seqs[1].blocks == [] and len(seqs[1].output_ids) < 40
    assert seqs[0].output_ids == want[0] and seqs[2].output_ids == want[2]
    a = sched.cache.allocator
    assert shared in a.key_of and not a.refs and a.num_free == a.usable


def test_no_prefix_caching_flag_and_metrics_over_http(engine):
    pytest.importorskip("fastapi")
    import argparse

    import httpx

    from engine_lib.bench.client import metric
    from engine_lib.loop.metrics import parse
    from engine_lib.serve.server import BackgroundServer, ServerOptions, add_arguments, build_state

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).prefix_caching and not p.parse_args(["--no-prefix-caching"]).prefix_caching
    system = "You are a terse assistant. " + " ".join(random.Random(5).choices(WORDS, k=80))
    counts = {}
    for on in (True, False):
        state, _ = build_state(ServerOptions(model="unused", served_model_name="t", kv_cache_gib=0.02,
                                             prefix_caching=on), engine=engine)
        with BackgroundServer(state) as srv:
            for q in ("Hi?", "Why?"):
                body = {"model": "t", "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
                assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
            m = parse(httpx.get(f"{srv.url}/metrics", timeout=10).text)
        counts[on] = metric(m, "engine_prefix_cache_hits_total"), metric(m, "engine_prefix_cache_queries_total")
    hits, queries = counts[True]
    assert queries > 0 and 64 <= hits < queries  # the second request found the system prompt
    assert counts[False] == (0, 0)


def test_prompts_sharing_a_prefix_wait_for_it_once_then_prefill_together(engine, monkeypatch):
    """A step's prompt chunks run as one forward, but a prompt whose first block a planned chunk is
    about to compute waits one forward and finds it; once that prefix is cached, prompts that share
    it (chat prompts with one system prompt) run together again."""
    system, prompts = shared_prompts(engine, 8)
    greedy = engine.sampling(do_sample=False, max_tokens=4)
    want = [engine.generate(p, max_new_tokens=4, do_sample=False).token_ids for p in prompts]
    rows = prefill_rows(monkeypatch)
    sched = make_scheduler(engine)
    got = []
    for wave in (prompts[:4], prompts[4:]):
        seqs = [sched.new_sequence(p, greedy) for p in wave]
        run_queued(sched, seqs)
        got += [s.output_ids for s in seqs]
    assert got == want
    assert rows == [1, 3, 4], rows  # cold: the first alone, then the three that found its blocks; warm: all four
    assert sched.metrics.prefix_hits >= 7 * (len(system) // 16 * 16)
