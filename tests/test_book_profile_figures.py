"""The measured pictures of chapters 07 and 09 (engine_lib/book/profile_figures.py) and the
sentences of chapter 09's temperature sweep (book/takeaways.py): the trace holds exactly the
calls one step makes, the memory timeline adds up to the engine's own tensors, and the words
follow the numbers."""

from types import SimpleNamespace

import matplotlib
import pytest
import torch

from engine_lib import Engine
from engine_lib.bench.measure import top_level_ops
from engine_lib.book.profile_figures import (
    Span,
    StepTrace,
    category,
    held_bytes,
    memory_figure,
    memory_timeline,
    prefill_for_trace,
    step_trace,
    timeline_figure,
)
from engine_lib.book.takeaways import temperature_takeaway, trend
from engine_lib.loop.local import LocalLoop
from engine_lib.model.checkpoints import ensure_checkpoint

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def loop():
    engine = Engine.from_pretrained(ensure_checkpoint("tiny"), device="cpu", stage="half")
    return LocalLoop(engine.model, engine.tokenizer, engine.max_model_len)  # eager, as the half rung runs


def test_a_step_trace_holds_the_calls_of_one_step(loop):
    paused = prefill_for_trace(loop, prompt_len=12)
    trace = step_trace(paused, "eager", warmup=1)
    assert trace.host_ops == top_level_ops(paused.decode) > 50  # the profiler's own count of one more step
    assert trace.kernels == 0 and trace.in_graph == 0  # a CPU, no compiled region
    assert all(0 <= s.start_us and s.start_us + s.dur_us <= trace.wall_us + 1 for s in trace.spans)
    assert any(category(s.name) == "matmul" for s in trace.spans)


@pytest.mark.parametrize("name, kind", [("aten::addmm", "matmul"), ("aten::_weight_int4pack_mm", "matmul"),
                                        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
                                        ("Torch-Compiled Region: 0/0", "compiled region"),
                                        ("cudaGraphLaunch", "graph replay"), ("aten::index", "other op")])
def test_spans_are_coloured_by_what_they_are(name, kind):
    assert category(name) == kind


def test_the_timeline_draws_every_span_in_its_lane():
    eager = StepTrace("eager", [Span("host", f"aten::op{i}", 10.0 * i, 8.0) for i in range(30)], wall_us=320.0)
    compiled = StepTrace("compiled", [Span("host", "Torch-Compiled Region: 0/0", 5.0, 200.0),
                                      Span("in graph", "aten::mm", 20.0, 30.0), Span("in graph", "aten::mm", 90.0, 30.0),
                                      Span("GPU", "void gemv_kernel", 30.0, 20.0)], wall_us=210.0)
    fig = timeline_figure([eager, compiled], "title")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 4  # eager host; compiled host, in graph, GPU
    assert any(label.startswith("eager, host\n30 calls") for label in labels)
    assert any(label.startswith("compiled, in graph\n2 library calls") for label in labels)
    bars = sum(len(c.get_paths()) for c in ax.collections)
    assert bars == len(eager.spans) + len(compiled.spans)
    assert ax.get_xlim()[1] >= eager.wall_us / 1e3


def test_the_memory_timeline_adds_up_to_the_engines_tensors(loop):
    prompt, new = list(range(1000, 1020)), 6
    tl = memory_timeline(loop, prompt, new)
    cache = loop.cache
    per_slot = cache.nbytes // cache.max_len  # one row
    assert len(tl.steady) == len(tl.peak) == len(tl.kv_filled) == new
    assert tl.weights == held_bytes(loop.model) >= sum(p.numel() * p.element_size() for p in loop.model.parameters())
    assert tl.kv_allocated == [cache.nbytes] * new and tl.slots == cache.max_len
    assert tl.kv_filled == [per_slot * (len(prompt) + 1 + i) for i in range(new)]  # one slot per token
    assert tl.steady[0] >= cache.nbytes  # the prefill allocated the cache (and the step's buffers)
    assert all(p >= s for p, s in zip(tl.peak, tl.steady)) and max(tl.transient) > 0
    assert tl.steady[-1] == tl.steady[1]  # decode steps free what they allocate: no growth
    fig = memory_figure(tl, "title")
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [
        "KV cache, filled", "KV cache, allocated, empty", "other step buffers", "transient peak in the step"]


def test_held_bytes_counts_a_tied_matrix_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert held_bytes(model) == 10 * 4 * 4


def runs(rep, nll):
    return [{"rep": r, "nll": n} for r, n in zip(rep, nll)]


def test_the_temperature_sentences_follow_the_numbers():
    defaults = SimpleNamespace(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    sweep = {"greedy": runs([0.6], [0.5]), "T=0.5": runs([0.4, 0.5], [0.9, 1.0]), "T=0.7": runs([0.3, 0.2], [1.2, 1.3]),
             "T=1.0": runs([0.1, 0.1], [2.0, 2.2]), "defaults": runs([0.25, 0.3], [1.0, 1.1])}
    text = " ".join(temperature_takeaway(sweep, defaults))
    assert "Repetition falls at every step from greedy to T=1.0" in text
    assert "NLL of the text rises at every step" in text
    assert "at T=0.5 the text is more repetitive than at T=1.0" in text and "more likely under the model" in text
    assert "made the text, on average, likelier (1.05 against 1.25 nats per token)" in text
    assert "more repetitive (27.5% against 25.0% of 4-grams repeated, the ranges overlapping)" in text
    sweep["T=0.7"] = runs([0.7, 0.7], [1.2, 1.3])  # repetition no longer falls at every step
    assert "falls overall, though not at every step" in " ".join(temperature_takeaway(sweep, defaults))


@pytest.mark.parametrize("values, words", [([1, 2, 3], "rises at every step"), ([3, 2, 1], "falls at every step"),
                                           ([1, 1, 2], "rises or stays level at every step"),
                                           ([1, 3, 2], "rises overall, though not at every step")])
def test_trend(values, words):
    assert trend(values, "rises", "falls") == words
