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
