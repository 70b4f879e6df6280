"""End-to-end generation at every rung against transformers, plus the engine's input checks."""

import math

import pytest
import torch

from conftest import hf_greedy, strip_stop
from engine_lib.errors import ContextLengthError, NonFiniteLogitsError, OptionValueError, UnsupportedOptionError

N_NEW = 64


@pytest.fixture(scope="module")
def reference_ids(hf_tiny, prompts):
    return {i: strip_stop(hf_greedy(hf_tiny, prompts[i], N_NEW)) for i in (0, 2, 5)}


@pytest.mark.parametrize("stage", ["naive", "kv_cache", "half", "fused"])
def test_fp32_greedy_ids_identical_to_transformers(engines, prompts, reference_ids, stage):
    engine = engines(stage, torch.float32)
    for i, ref in reference_ids.items():
        out = engine.generate(prompts[i], max_new_tokens=N_NEW, do_sample=False)
        assert out.token_ids == ref, f"{stage}: prompt {i}"
        assert len(ref) > 10 and len(set(ref)) > 5  # a real test: varied tokens, not one repeated
        assert out.finish_reason == ("length" if len(ref) == N_NEW else "stop")


def test_default_half_dtype_on_cpu_is_bf16(engines):
    assert engines("half", None).dtype == torch.bfloat16


def test_timings_are_reported(engines, prompts):
    out = engines("kv_cache").generate(prompts[0], max_new_tokens=8, do_sample=False)
    assert out.ttft_s > 0 and out.decode_tokens_per_s > 0 and math.isfinite(out.decode_tokens_per_s)
    assert out.prompt_tokens == len(prompts[0]) and out.text == engines("kv_cache").tokenizer.decode(out.token_ids)


def test_prompt_forms(engines):
    engine = engines("kv_cache")
    text = engine.generate("Is Stanford a real school?", max_new_tokens=5, do_sample=False)
    chat = engine.generate([{"role": "user", "content": "Is Stanford a real school?"}], max_new_tokens=5,
                           do_sample=False)
    ids = engine.generate(engine.encode("Is Stanford a real school?"), max_new_tokens=5, do_sample=False)
    assert text.token_ids == chat.token_ids == ids.token_ids


def test_batch_of_different_lengths_equals_batch_one(engines, prompts):
    for stage in ("kv_cache", "fused"):
        engine = engines(stage)
        batch = [prompts[0], prompts[2], prompts[5]]
        assert len({len(p) for p in batch}) == 3
        together = engine.generate_batch(batch, max_new_tokens=24, do_sample=False)
        for ids, out in zip(batch, together):
            assert out.token_ids == engine.generate(ids, max_new_tokens=24, do_sample=False).token_ids, stage


def test_kv_cache_equals_naive_on_a_long_prompt(engines):
    ids = list(range(1000, 1700))  # 700 tokens
    a = engines("naive").generate(ids, max_new_tokens=12, do_sample=False).token_ids
    b = engines("kv_cache").generate(ids, max_new_tokens=12, do_sample=False).token_ids
    assert a == b


def test_too_many_tokens_for_the_cache_fail_up_front(engines, prompts):
    engine = engines("kv_cache", max_model_len=64)
    with pytest.raises(ContextLengthError, match="exceeds"):
        engine.generate(prompts[0], max_new_tokens=100, do_sample=False)
    assert engine.generate(prompts[0], max_new_tokens=20, do_sample=False).token_ids


def test_prompt_longer_than_the_model(engines):
    with pytest.raises(ContextLengthError, match="max_position_embeddings|exceeds"):
        engines("naive").generate(list(range(32768)), max_new_tokens=1)


def test_bad_options(engines, tiny_dir):
    from engine_lib import Engine

    with pytest.raises(UnsupportedOptionError, match="unknown dtype"):
        Engine.from_pretrained(tiny_dir, dtype="float8")
    with pytest.raises(UnsupportedOptionError, match="device"):
        Engine.from_pretrained(tiny_dir, device="tpu")
    with pytest.raises(UnsupportedOptionError, match="stage"):
        Engine.from_pretrained(tiny_dir, stage="turbo")
    with pytest.raises(UnsupportedOptionError, match="prompt must be"):
        engines("kv_cache").generate(3.5)
    with pytest.raises(UnsupportedOptionError, match="out of range"):
        engines("kv_cache").generate([1, 999_999])


def test_generation_options_are_checked_by_name_and_value(engines):
    """A typo is not a bare TypeError and a NaN temperature is not greedy: both are named errors."""
    engine = engines("kv_cache")
    with pytest.raises(UnsupportedOptionError, match="'tempurature'; did you mean 'temperature'"):
        engine.generate("hi", max_new_tokens=2, tempurature=0.5)
    with pytest.raises(UnsupportedOptionError, match="did you mean 'top_k'"):
        list(engine.stream("hi", max_new_tokens=2, topk=5))
    for option in ("temperature", "top_p", "repetition_penalty"):
        for value in (math.nan, math.inf):
            with pytest.raises(OptionValueError, match=f"{option} must be .*, got {value}") as info:
                engine.generate("hi", max_new_tokens=2, do_sample=True, **{option: value})
            assert info.value.option == option


@pytest.mark.parametrize("stage", ["naive", "kv_cache"])
def test_nan_logits_raise_a_clear_error(tiny_dir, stage):
    from engine_lib import Engine

    engine = Engine.from_pretrained(tiny_dir, device="cpu", stage=stage)
    engine.model.model.norm.weight.data[0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN or Inf"):
        engine.generate([1, 2, 3], max_new_tokens=4, do_sample=False)


def test_every_cached_path_makes_its_tokens_inside_the_loop(engines, tiny_dir, prompts, monkeypatch,
                                                            tmp_path_factory):
    """At run time, not only in engine.py's source: every rung from kv_cache to int4, prompt lookup, a
    draft model, streaming and ``generate_batch`` reach the model only from inside ``EngineCore.step``
    (through the runner's contiguous-cache steps), the drafters only from there too, and never through
    the naive rung's loop."""
    import engine_lib.engine as engine_module
    from engine_lib import Engine
    from engine_lib.loop.engine_core import EngineCore
    from engine_lib.model.checkpoints import ensure_checkpoint
    from engine_lib.speculative import DraftModel, PromptLookup
    from engine_lib.step.drivers import ContiguousSteps

    depth, calls = [0], {"step": 0, "model": 0, "draft": 0}

    def core_step(original):
        def step(self):
            depth[0] += 1
            calls["step"] += 1
            try:
                return original(self)
            finally:
                depth[0] -= 1
        return step

    def inside(original, counter):
        def call(*args, **kwargs):
            assert depth[0] > 0, f"{original.__qualname__} ran outside EngineCore.step"
            calls[counter] += 1
            return original(*args, **kwargs)
        return call

    def no_naive(*args, **kwargs):
        raise AssertionError("a cached engine used the naive loop")

    monkeypatch.setattr(EngineCore, "step", core_step(EngineCore.step))
    for name in ("forward", "run"):
        monkeypatch.setattr(ContiguousSteps, name, inside(getattr(ContiguousSteps, name), "model"))
    for drafter in (PromptLookup, DraftModel):
        monkeypatch.setattr(drafter, "propose", inside(drafter.propose, "draft"))
    monkeypatch.setattr(engine_module, "naive_tokens", no_naive)

    draft_dir = ensure_checkpoint("tiny", layers=2, seed=1, root=tmp_path_factory.mktemp("draft"))
    cases = [(stage, engines(stage, torch.bfloat16 if stage != "kv_cache" else torch.float32))
             for stage in ("kv_cache", "half", "fused", "int8", "int4")]
    cases += [(f"speculative={s}", Engine.from_pretrained(tiny_dir, device="cpu", stage="kv_cache", speculative=s))
              for s in ("prompt_lookup", str(draft_dir))]
    for label, engine in cases:
        before = dict(calls)
        runs = [engine.generate(prompts[0], max_new_tokens=6, stop_token_ids=[]).token_ids,
                [r.token_ids for r in engine.generate_batch(prompts[:2], max_new_tokens=4, stop_token_ids=[])],
                "".join(engine.stream(prompts[1], max_new_tokens=4, stop_token_ids=[]))]
        assert [len(runs[0]), [len(ids) for ids in runs[1]]] == [6, [4, 4]] and runs[2], label
        assert calls["step"] > before["step"] and calls["model"] > before["model"], label
        if label.startswith("speculative"):
            assert calls["draft"] > before["draft"], f"{label}: no draft was asked for"
