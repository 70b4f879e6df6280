"""CUDA-graph warm-up writes no slot past the cache (issue 14), checked on CPU.

The capture path is CUDA-only, but its warm-up (``CompiledStep.warm_up``) is plain steps over
``DecodeState``: here it runs eagerly on CPU at the cache's very end, where the old warm-up
(two steps that advanced the buffers) wrote one slot past the buffers.
"""

import pytest
import torch

from engine_lib import Engine
from engine_lib.step.compiled import CompiledStep
from engine_lib.step.runner import CACHE_BUCKET


def state_at_the_edge(engine, prompt_len, new_tokens):
    """Prefill so that the next decode step is the last one the cache has room for."""
    ids = torch.arange(1000, 1000 + prompt_len)[None]
    engine.runner.prefill(ids, None, [engine.sampling(do_sample=False)], new_tokens)
    st = engine.runner.state
    for _ in range(new_tokens - 2):
        engine.runner.decode()
    assert st.length == st.max_len - 1  # one decode step left, whose history slot is the last one
    return st


@pytest.mark.parametrize("where", ["bucket_edge", "max_model_len"])
def test_warm_up_at_the_cache_end_writes_only_the_steps_own_slots(tiny_dir, where):
    if where == "bucket_edge":
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="half")
        st = state_at_the_edge(engine, CACHE_BUCKET - 4, 4)  # needs exactly one bucket
        assert st.max_len == CACHE_BUCKET
    else:
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="half",
                                        max_model_len=40)
        st = state_at_the_edge(engine, 30, 10)
        assert st.max_len == 40
    mode = st.sampling.mode
    kv_before = [t.clone() for t in st.cache.k + st.cache.v]
    history_before = st.history.clone()
    saved = st.snapshot()
    step = CompiledStep(compile_step=False, cuda_graph=False)
    with torch.inference_mode():  # as the runner runs it
        step.warm_up(engine.model, st, mode, saved)  # the old warm-up raised IndexError here (slot max_len)
    slot = int(st.cache_pos[0, 0])
    for before, after in zip(kv_before, st.cache.k + st.cache.v):  # only the newest token's slot changed
        assert torch.equal(before[:, :, :slot], after[:, :, :slot])
        assert torch.equal(before[:, :, slot + 1:], after[:, :, slot + 1:])
    assert torch.equal(history_before[:, :slot + 1], st.history[:, :slot + 1])
    assert all(torch.equal(a, b) for a, b in zip(saved, st.snapshot()))  # state as before the warm-up
    # the real step that follows produces what it would have without a warm-up
    engine.runner.decode()
    assert st.length == st.max_len
