"""Host-dispatched operators per decode step, for both clients of the token loop.

Defined for chapter 12 (serving many users) and the serving bench. On a GPU every operator the
host dispatches outside a compiled region or a CUDA graph is a kernel launch of a few
microseconds; counted on the CPU (``measure.top_level_ops``), it is the proxy for that cost.
``Engine.generate`` is counted per generated token, the server's runner per decode step of a
batch (one token for every row).
"""

from __future__ import annotations

from collections import Counter

import torch

from ..cache.blocks import blocks_for
from ..cache.paged import PagedKVCache
from ..loop.model_runner import ModelRunner, ScheduledBatch
from ..sampling import SamplingParams
from ..step.decode import GREEDY
from ..step.forward import Row, paged_forward
from .measure import eager_ops_per_token, top_level_op_names

PROMPTS = ("Tell me about the sea.", "Why is the sky blue?", "Write a haiku about autumn.", "Name three rivers.")


class GreedyRow:
    """What the runner asks of a scheduled sequence, for a plain-greedy row with no logprobs."""

    class sampler:  # noqa: N801 (an attribute namespace, as a Sequence's sampler is)
        plain_greedy = in_step = True
        mode, adjust = GREEDY, None

        @staticmethod
        def took(token: int) -> None:
            pass

    params = SamplingParams()


def served_ops_per_step(engine, rows: int = 4) -> int:
    """Top-level operators of one steady-state decode step of ``rows`` greedy rows through the
    server's runner (after its compile and warm-up), at the engine's rung."""
    return sum(served_op_names(engine, rows).values())


def served_op_names(engine, rows: int = 4) -> Counter:
    """``served_ops_per_step`` by operator name."""
    cfg = engine.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 8 * rows + 4, engine.dtype,
                         engine.device)
    batch_rows = []
    for i in range(rows):
        ids = engine.encode(PROMPTS[i % len(PROMPTS)])
        table = cache.allocator.allocate(blocks_for(len(ids) + 4, cache.block_size))
        first = int(paged_forward(engine.model, cache, [Row(ids, 0, table)])[0].float().argmax())
        batch_rows.append(Row([first], len(ids), table))
    runner = ModelRunner(engine.model, cache, max_model_len=512, compile_step=engine.compile_step,
                         cuda_graph=engine.cuda_graph)
    batch = ScheduledBatch((GreedyRow(),) * rows, tuple(batch_rows), prefill=False)
    with torch.inference_mode():
        for _ in range(2):  # compile (once per process), capture, warm up
            runner.execute(batch)
        return top_level_op_names(lambda: runner.execute(batch))


def loop_ops(engine, rows: int = 4) -> dict:
    """Operators the host dispatches per decode step: ``Engine.generate`` (per token) and the server
    (per step of ``rows`` rows), in total and per layer."""
    layers = engine.config.num_hidden_layers
    generate = eager_ops_per_token(engine, PROMPTS[0])
    served = served_ops_per_step(engine, rows)
    return {"stage": engine.stage.name, "layers": layers, "rows": rows,
            "generate_per_token": generate, "generate_per_layer": generate / layers,
            "served_per_step": served, "served_per_layer": served / layers}
