"""CUDA-graph warm-up writes no slot past the cache (issue 14), checked on CPU.

The capture path is CUDA-only, but its warm-up (``CompiledStep.warm_up``) is plain steps over
``DecodeState``: here it runs eagerly on CPU before the last decode step a cache has room for, where
the old warm-up (two steps that advanced the buffers) wrote one slot past the step's own.
"""

import pytest
import torch

from engine_lib import Engine
from engine_lib.loop.local import CACHE_BUCKET
from engine_lib.step.compiled import CompiledStep
from engine_lib.step.drivers import ContiguousSteps


def check_warm_up(model, st, mode) -> None:
    """Warm up from the loaded state: only the newest token's slot may change, and the state is restored."""
    kv_before = [t.clone() for t in st.cache.k + st.cache.v]
    saved = st.snapshot()
    step = CompiledStep(compile_step=False, cuda_graph=False)
    with torch.inference_mode():
        step.warm_up(model, st, mode, saved)
    slot = int(st.cache_pos[0, 0])
    for before, after in zip(kv_before, st.cache.k + st.cache.v):  # only the newest token's slot changed
        assert torch.equal(before[:, :, :slot], after[:, :, :slot])
        assert torch.equal(before[:, :, slot + 1:], after[:, :, slot + 1:])  # the scratch slot included
    assert all(torch.equal(a, b) for a, b in zip(saved, st.snapshot()))  # state as before the warm-up


@pytest.mark.parametrize("where", ["bucket_edge", "max_model_len"])
def test_warm_up_at_the_cache_end_writes_only_the_steps_own_slots(tiny_dir, monkeypatch, where):
    if where == "bucket_edge":
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="half")
        prompt_len, new_tokens, slots = CACHE_BUCKET - 4, 4, CACHE_BUCKET + 1  # exactly one bucket
    else:
        engine = Engine.from_pretrained(tiny_dir, device="cpu", dtype=torch.float32, stage="half",
                                        max_model_len=40)
        prompt_len, new_tokens, slots = 30, 10, 41  # the whole context (+ the scratch slot)
    ids = list(range(1000, 1000 + prompt_len))
    opts = dict(max_new_tokens=new_tokens, do_sample=False, stop_token_ids=[])
    checked, real = [], ContiguousSteps.run

    def warmed_run(self, st, mode):
        if int(st.cache_pos[0, 0]) == prompt_len + new_tokens - 2:  # the last token that is fed
            assert st.max_len == slots
            assert int(st.cache_pos[0, 0]) == st.cache.block_size - 2  # a row has room for no further step
            check_warm_up(engine.model, st, mode)
            checked.append(True)
        real(self, st, mode)

    monkeypatch.setattr(ContiguousSteps, "run", warmed_run)
    warmed = engine.generate(ids, **opts)
    assert checked == [True]
    monkeypatch.undo()
    # the real step that follows produced what it would have without a warm-up
    assert warmed.token_ids == engine.generate(ids, **opts).token_ids
    assert len(warmed.token_ids) == new_tokens
