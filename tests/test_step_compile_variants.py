"""Compile once and say so (issue 14): the compiled step's variants are few by design, each is
announced before it compiles and timed after, and new shapes inside a variant reuse it."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from engine_lib import Engine
from engine_lib.sampling import SamplingParams, SamplingState, pick_modes
from engine_lib.step import compiled as compiled_step

OPTIONS = [dict(do_sample=False), dict(do_sample=False, repetition_penalty=1.2),
           dict(do_sample=True, top_k=20, seed=0), dict(do_sample=True, top_k=0, top_p=0.9, seed=0)]


def test_the_variant_count_stays_under_dynamos_recompile_limit_by_design():
    vocab = 151936
    assert compiled_step.max_variants(vocab) <= torch._dynamo.config.recompile_limit
    state = SamplingState(2, vocab, torch.device("cpu"))
    modes = set()
    for greedy in (True, False):
        for top_k in (0, 1, 20, 50, 64, 65, 1000):
            for penalty in (1.0, 1.1):
                for top_p in (1.0, 0.8):
                    p = SamplingParams(do_sample=not greedy, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
                    modes.add(state.load([p, p]))
    assert modes <= set(pick_modes(vocab)) and len(modes) == len(pick_modes(vocab))


def test_each_variant_compiles_once_announced_and_shapes_inside_it_reuse_it(tiny_dir, prompts, capsys,
                                                                           monkeypatch):
    monkeypatch.setattr(compiled_step, "BACKEND", "eager")  # dynamo's tracing and guards, no inductor build
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    monkeypatch.setattr(compiled_step, "_VARIANTS", {})
    torch._dynamo.reset()
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="fused")
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for options in OPTIONS:
            engine.generate(prompts[0], max_new_tokens=3, **options)  # batch 1
            engine.generate_batch([prompts[1], prompts[2]], max_new_tokens=3, **options)  # batch 2, 256 slots
            engine.generate_batch([prompts[3]] * 3 + [list(range(1000, 1300))], max_new_tokens=3,
                                  **options)  # batch 4, 512 slots: the same variant
    assert engine.fallbacks == [] and engine.step_form == "compiled", caught
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs == 2 * len(OPTIONS) <= compiled_step.max_variants(engine.config.vocab_size)
    lines = [line for line in capsys.readouterr().out.splitlines() if "Compiling the decode step" in line]
    assert len(lines) == graphs and all(line.rstrip().endswith(" s.") and "done in" in line for line in lines)
    assert all(len(line) <= 90 for line in lines), lines  # the book's printed width


def traced_step(tiny_dir, prompts, batch: int, cache: str, monkeypatch):
    """The one graph dynamo traces for a greedy decode batch of ``batch`` rows: Engine.generate's (over chapter
    05's contiguous cache) or the server runner's (over the paged cache)."""
    from engine_lib.bench.loop_ops import GreedyRow
    from engine_lib.cache.blocks import blocks_for
    from engine_lib.cache.paged import PagedKVCache
    from engine_lib.loop.model_runner import ModelRunner, ScheduledBatch
    from engine_lib.step.forward import Row, paged_forward

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compiled_step, "BACKEND", keep)
    monkeypatch.setattr(compiled_step, "_COMPILED", {})
    monkeypatch.setattr(compiled_step, "_VARIANTS", {})
    torch._dynamo.reset()
    engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="fused")
    if cache == "contiguous":
        engine.generate_batch([prompts[i] for i in range(batch)], max_new_tokens=2, do_sample=False)
    else:
        cfg = engine.config
        paged = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=64,
                             dtype=torch.float32, device="cpu")
        rows = []
        for ids in prompts[:batch]:
            table = paged.allocator.allocate(blocks_for(len(ids) + 2, paged.block_size))
            first = int(paged_forward(engine.model, paged, [Row(ids, 0, table)])[0].argmax())
            rows.append(Row([first], len(ids), table))
        runner = ModelRunner(engine.model, paged, max_model_len=512, compile_step=True)
        with torch.inference_mode():
            runner.execute(ScheduledBatch((GreedyRow(),) * batch, tuple(rows), prefill=False))
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 3])
def test_only_batch_and_cache_lengths_are_symbolic(tiny_dir, prompts, batch, cache, monkeypatch):
    """The batch and the cache's lengths are symbols (the contiguous cache: its slots per row, in the K/V
    buffers and ``key_valid``; the paged one: the read span (block tables, slots, positions) and the pool of
    slots of its K/V buffers); heads, head_dim, vocab and the norms' eps are constants in the traced step."""
    graph = traced_step(tiny_dir, prompts, batch, cache, monkeypatch)
    symbolic = set()
    for node in graph.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymFloat):
            pytest.fail(f"a float is symbolic: {node}")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor):
            continue
        dims = {i for i, size in enumerate(value.shape) if isinstance(size, torch.SymInt)}
        if cache == "contiguous":  # k, v: (batch, kv_heads, max_len, head_dim); key_valid: (batch, max_len)
            length = {1} if node.name.endswith("key_valid") else {2} if "_kv_" in node.name else set()
        else:
            length = ({1} if node.name.endswith(("tables", "key_valid"))
                      else {0} if node.name.endswith(("span_positions", "read_slots")) or "_kv_" in node.name
                      else set())
        allowed = length | ({0} if batch > 1 else set())
        assert dims <= allowed, f"{node.name}: dims {sorted(dims - allowed)} of {tuple(value.shape)} are symbolic"
        symbolic |= {(bool(length) and i in length, i == 0 and not (length and i in length)) for i in dims}
    assert (True, False) in symbolic  # a cache length is a symbol
    assert ((False, True) in symbolic) == (batch > 1)  # and so is a batch of more than one
