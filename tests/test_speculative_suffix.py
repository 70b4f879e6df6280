"""Suffix speculation: the trie's counts, matches and drafts, the global trie's bound, and greedy output unchanged
on every cached rung, in a batch of mixed requests, with the global trie in use, and in the server."""

import pytest

from engine_lib.speculative.suffix import SEPARATOR, SuffixAutomaton, SuffixDrafter

N_NEW = 32


class Seq:
    """What the drafter reads of a sequence: its prompt and output."""

    def __init__(self, prompt, output=()):
        self.prompt_ids, self.output_ids = list(prompt), list(output)

    @property
    def tokens(self):
        return self.prompt_ids + self.output_ids


def _occurrences(text: list[int], sub: list[int]) -> int:
    return sum(text[i:i + len(sub)] == sub for i in range(len(text) - len(sub) + 1))


@pytest.mark.parametrize("seed", range(4))
def test_the_automaton_matches_counts_and_repeats_as_brute_force_does(seed):
    import random

    rng = random.Random(seed)
    text = [rng.randrange(3) for _ in range(40)]
    sam = SuffixAutomaton()
    sam.extend(text)
    sam.count()
    for _ in range(60):
        ctx = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
        state, m = sam.match(ctx)
        longest = max(n for n in range(len(ctx) + 1) if _occurrences(text, ctx[len(ctx) - n:]) or n == 0)
        assert m == longest
        if m:
            assert sam.occ[state] == _occurrences(text, ctx[len(ctx) - m:])
            assert text[sam.first[state] - m + 1:sam.first[state] + 1] == ctx[len(ctx) - m:]  # where it first ends
    m, end = sam.repeat()
    want = max(n for n in range(len(text)) if _occurrences(text, text[len(text) - n:]) >= 2 or n == 0)
    assert m == want and text[end - m + 1:end + 1] == text[len(text) - m:] and end < len(text) - 1


def test_frequent_follows_the_most_common_continuation_while_it_is_likely_enough():
    sam = SuffixAutomaton()
    sam.extend([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, SEPARATOR])
    sam.count()
    state, m = sam.match([7, 1, 2])
    assert m == 2 and sam.frequent(state, 4, 0.1) == [3, 9, 1, 2]  # "1 2" -> "3" twice of three
    assert sam.frequent(state, 4, 0.7) == []  # 2/3 is below 0.7
    sam.extend([5, 6, 7])  # not counted yet: what followed its first occurrence
    state, m = sam.match([5])
    assert sam.occ[state] == 0 and sam.frequent(state, 5, 0.9) == [6, 7]


def test_a_request_drafts_from_its_own_context_as_long_as_the_match_allows():
    drafter = SuffixDrafter(alpha=1.0, min_match=2)
    seq = Seq([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert drafter.propose([(seq, 8)]) == [[4, 5, 6]]  # a 3-token match drafts at most 3
    assert drafter.propose([(Seq([1, 2, 3, 9]), 8)]) == [[]]  # "9" never occurred before: no match
    seq.output_ids += [4, 5]  # accepted tokens extend its own automaton
    assert drafter.propose([(seq, 8)]) == [[6, 7, 1, 2, 3]]
    assert drafter.propose([(seq, 2)]) == [[6, 7]]  # and k caps it


def test_finished_replies_teach_later_requests_and_the_oldest_are_forgotten_first():
    drafter = SuffixDrafter(alpha=4.0, global_tokens=12)
    first = Seq([100, 101], [7, 8, 9, 10, 11, 12])
    drafter.finished(first)
    later = Seq([200, 201], [7, 8])  # a new request whose reply starts as the first one's did
    assert drafter.propose([(later, 8)]) == [[9, 10, 11, 12]]
    drafter.finished(first)  # once only
    assert drafter.held == 6
    drafter.finished(Seq([1], [30, 31, 32, 33, 34, 35, 36]))  # 13 tokens held > 12: the first reply goes
    assert drafter.held == 7 and len(drafter.replies) == 1
    assert drafter.propose([(later, 8)]) == [[]]
    later.output_ids += [30, 31]
    assert drafter.propose([(later, 3)]) == [[32, 33, 34]]  # its match followed the rebuilt automaton
    with pytest.raises(Exception, match="need alpha > 0"):
        SuffixDrafter(alpha=0)


def test_drafting_for_64_rows_is_timed_by_the_bench():
    from engine_lib.bench.suffix_spec import drafting_ms

    r = drafting_ms(rows=8, steps=3, prompt=64)
    assert r["rows"] == 8 and 0 < r["median_ms"] <= r["max_ms"]


@pytest.fixture(scope="module")
def suffix_engines(engines):
    """A suffix-speculating engine over the plain one's model (loaded, and quantized, once)."""
    from engine_lib import Engine

    cache = {}

    def get(stage):
        if stage not in cache:
            base = engines(stage)
            cache[stage] = Engine(base.model, base.tokenizer, base.model_dir, base.stage, base.device,
                                  speculative="suffix")
        return cache[stage]
    return get


@pytest.mark.parametrize("stage", ["kv_cache", "half", "fused", "int8", "int4"])
def test_greedy_output_is_plain_greedy_on_every_cached_rung_and_repeats_draft_from_the_global_trie(
        suffix_engines, engines, prompts, stage):
    """fp32 at every rung: the verify's argmax is the plain step's, token for token. The second round of the same
    prompts drafts from the first round's replies (the global trie), and every draft is kept."""
    engine = suffix_engines(stage)
    batch = [prompts[0], prompts[4], prompts[7]]  # a batch of mixed lengths
    want = [engines(stage).generate(p, max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[]).token_ids
            for p in batch]
    for round_ in range(2):
        got = engine.generate_batch(batch, max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[])
        assert [g.token_ids for g in got] == want, f"round {round_}"
    assert all(g.extra["drafter"] == "suffix" for g in got)
    assert all(g.extra["accepted"] == g.extra["drafted"] > 0 for g in got)  # the replies repeat: all kept
    assert all(g.extra["tokens_per_target_forward"] > 2 for g in got)


def test_the_server_speculates_with_suffix_and_counts_it(engines, prompts):
    import argparse

    from engine_lib.bench.client import metric
    from engine_lib.loop.metrics import parse
    from engine_lib.sampling import SamplingParams
    from engine_lib.serve.server import ServerOptions, add_arguments, build_state

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--speculative", "suffix"]).speculative == "suffix"
    engine = engines("kv_cache")
    want = engine.generate(prompts[1], max_new_tokens=N_NEW, do_sample=False, stop_token_ids=[]).token_ids
    state, _ = build_state(ServerOptions(model="unused", served_model_name="t", kv_cache_gib=0.02,
                                         speculative="suffix", speculative_tokens=8), engine=engine)
    try:
        params = SamplingParams(max_tokens=N_NEW, temperature=0.0, stop_token_ids=())
        for _ in range(2):  # the second request drafts from the first one's reply
            assert state.loop.generate([prompts[1]], params)[0].token_ids == want
        m = parse(state.loop.core.metrics.render())
        drafted = metric(m, "engine_spec_decode_draft_tokens_total")
        assert drafted > 0 and metric(m, "engine_spec_decode_accepted_tokens_total") == drafted
    finally:
        state.loop.stop()
        state.loop.release()


def test_the_suffix_record_reads_its_targets_on_the_first_dtype():
    from engine_lib.bench import suffix_spec

    def req(rate, per_forward, same=True):
        return {"decode_tok_s": rate, "tokens_per_forward": per_forward, "same_as_plain": same}

    def run(later_rate, same=True):
        requests = {"plain": [req(10.0, 1.0)] * 3, "prompt_lookup": [req(11.0, 1.5, same)] * 3,
                    "suffix": [req(10.5, 1.2, same), *[req(later_rate, 7.0, same)] * 2]}
        return {"label": "m", "prompt_tokens": 100, "requests": requests, "summary": suffix_spec.summary(requests)}

    record = {"meta": {"model": "m", "layers": 28, "cpu_model": "EPYC", "device_name": "CPU", "stage": "fused",
                       "commit": "abc", "timestamp": "now", "prompt_tokens": 100, "repeats": 3, "new_tokens": 128},
              "runs": {"float32": run(25.0), "bfloat16": run(15.0, same=False)},
              "drafting": {"rows": 64, "prompt_tokens": 512, "median_ms": 0.3, "max_ms": 0.5}}
    met = [t["met"] for t in suffix_spec.targets(record)]
    assert met == [True, True, True, True]  # 7 tokens a forward, 2.5x, 0.3 ms, every fp32 reply unchanged
    record["runs"] = {"float32": run(15.0, same=False)}
    assert [t["met"] for t in suffix_spec.targets(record)] == [True, False, True, False]
    record["targets"] = suffix_spec.targets(record)
    text = suffix_spec.markdown(record)
    assert "Targets met: 2 of 4." in text and "| 2 | 10.0 | 11.0 | 1.50 | 15.0 | 7.00 |" in text
    assert "suffix 0 of 3" in text
    record["llama_cpp"] = {"skipped": "Node.js is not installed"}
    assert "llama.cpp: not run here (Node.js is not installed)." in suffix_spec.markdown(record)

    def peer(rate, drafted, accepted):
        return {"decode_tok_s": rate, "drafted": drafted, "acceptance": accepted / drafted if drafted else None,
                "same_as_plain": True}

    record["runs"]["bfloat16"] = run(30.0)
    record["llama_cpp"] = {"gguf": "BF16", "node_llama_cpp": "3.21.1", "threads": 2, "requests": {
        "plain": [peer(12.0, 0, 0)] * 3, "lookup": [peer(14.0, 40, 10), peer(15.0, 0, 0), peer(16.0, 40, 30)]}}
    text = suffix_spec.markdown(record)
    assert "| 1 | 12.0 | 14.0 | 25% of 40 | yes |" in text and "| 2 | 12.0 | 15.0 | none drafted | yes |" in text
    # requests 2 on, medians: llama.cpp with lookup 15.5, the engine's bf16 suffix 30.0
    assert "llama.cpp 12.0 tok/s plain, 15.5 with lookup; the engine in bfloat16 with suffix speculation 30.0 (1.94x" in text


def test_llama_cpp_runs_the_same_request_plain_and_with_its_lookup_drafts(tiny_dir):
    from engine_lib.bench.llamacpp import unavailable_reason
    from engine_lib.bench.suffix_spec import run_llama_cpp

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp peer unavailable: {reason}")
    ids = list(range(1000, 1040)) * 2  # a prompt that repeats itself: lookup has something to draft from
    out = run_llama_cpp(str(tiny_dir), ids, repeats=2, new_tokens=12, gguf_type="F16")
    assert [len(out["requests"][m]) for m in ("plain", "lookup")] == [2, 2]
    assert all(r["decode_tok_s"] > 0 for m in ("plain", "lookup") for r in out["requests"][m])
    assert all(r["same_as_plain"] for r in out["requests"]["plain"])  # greedy, the same ids: the same reply
    assert all(r["drafted"] == 0 for r in out["requests"]["plain"])  # drafts only where the predictor is set
