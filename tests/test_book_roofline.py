"""engine_lib/book/roofline.py: the FLOPs, bytes and intensity the book's roofline claims rest on
(chapters 00 and 05, and every chapter that refers back to them)."""

import dataclasses

import pytest

from engine_lib.book.figures import H200, T4
from engine_lib.book.roofline import bound_by, compute_bound_from, forward_cost, layer_parameters
from engine_lib.cache.contiguous import kv_bytes_per_token
from engine_lib.model.checkpoints import REAL_CONFIG, preset_config
from engine_lib.model.config import Qwen2Config
from engine_lib.model.tokenizer import seed_prompts

REAL = Qwen2Config.from_json(REAL_CONFIG)


def test_the_parts_add_up_to_the_published_count():
    head = REAL.vocab_size * REAL.hidden_size
    assert layer_parameters(REAL) + head + REAL.hidden_size == REAL.num_parameters() == 1_543_714_304


def test_flops_and_bytes_by_hand():
    t, n = 7, 5
    cost = forward_cost(REAL, t, 2, context=n, last_only=False)
    h, L = REAL.hidden_size, REAL.num_hidden_layers
    pairs = sum(n + i + 1 for i in range(t))  # each new token sees the cache and itself and the ones before it
    assert cost.flops == 2 * layer_parameters(REAL) * t + 2 * REAL.vocab_size * h * t + L * 4 * h * pairs
    assert cost.bytes == REAL.num_parameters() * 2 + kv_bytes_per_token(REAL, 2) * (n + t)


@pytest.mark.parametrize("nbytes, want", [(2, 1.0), (4, 0.5), (1, 2.0)])
def test_decode_is_two_flops_per_weight(nbytes, want):
    """2 FLOPs per weight at batch 1: about 1 FLOP per byte in 16 bits (not 2), 0.5 in fp32."""
    assert forward_cost(REAL, 1, nbytes, context=64).intensity == pytest.approx(want, rel=0.01)


def test_intensity_grows_with_the_prompt():
    values = [forward_cost(REAL, t, 2).intensity for t in (1, 2, 8, 64, 512, 4096)]
    assert values == sorted(values) and values[-1] > 100 * values[0]


def test_the_book_prompts_are_bandwidth_bound_on_a_t4_in_16_bits():
    """Chapters 00 and 05 say so: every seed prompt's prefill sits under the T4's ridge."""
    crossover = compute_bound_from(REAL, T4.ridge, 2)
    assert crossover == 238  # from the config and the datasheet ridge (65e12 / 320e9 = 203 FLOP/B)
    assert T4.ridge == pytest.approx(203.125)
    lengths = [len(p["input_ids"]) for p in seed_prompts()]
    assert max(lengths) < crossover
    assert all(bound_by(forward_cost(REAL, t, 2), T4.peak_flops, T4.bandwidth) == "memory" for t in lengths)
    assert bound_by(forward_cost(REAL, 4096, 2), T4.peak_flops, T4.bandwidth) == "compute"
    assert bound_by(forward_cost(REAL, 1, 2, context=4096), H200.peak_flops, H200.bandwidth) == "memory"


def test_compute_bound_from_is_the_first_length_over_the_ridge():
    tiny = preset_config("tiny")
    for cfg, ridge, nbytes in [(REAL, T4.ridge, 2), (REAL, H200.ridge, 2), (REAL, T4.ridge, 1), (tiny, 50.0, 4)]:
        t = compute_bound_from(cfg, ridge, nbytes)
        assert forward_cost(cfg, t, nbytes).intensity >= ridge > forward_cost(cfg, t - 1, nbytes).intensity
    assert compute_bound_from(REAL, 0.5, 2) == 1
    assert compute_bound_from(dataclasses.replace(tiny, max_position_embeddings=512), T4.ridge, 2) is None


def test_scoring_only_the_last_position_moves_the_crossover():
    """The LM head serves one position of a prefill: counting it for every token would claim ~203."""
    every = next(t for t in range(1, 1000) if forward_cost(REAL, t, 2, last_only=False).intensity >= T4.ridge)
    assert every < compute_bound_from(REAL, T4.ridge, 2)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        forward_cost(REAL, 0, 2)


def test_the_intensity_figure_names_its_model_and_fits_the_page():
    from engine_lib.book.roofline import intensity_figure

    fig = intensity_figure(REAL, 2, (T4, H200), [35, 65], "Qwen2.5-1.5B shape")
    assert fig.get_figwidth() <= 8 and "Qwen2.5-1.5B shape" in fig.axes[0].get_title()
    assert "T4 203" in " ".join(t.get_text() for t in fig.axes[0].texts)
