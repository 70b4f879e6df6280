"""The timing helper knows its noise, and the takeaways follow the data (issue 19)."""

import random
import time

import pytest

from engine_lib.bench import timing
from engine_lib.bench.timing import Samples, plateau, relation, verdict
from engine_lib.book import relation as book_relation
from engine_lib.book import takeaways


def noisy(center: float, spread: float, n: int = 9, seed: int = 0) -> Samples:
    rng = random.Random(seed)
    return Samples(tuple(center * (1 + rng.uniform(-spread, spread)) for _ in range(n)))


def test_samples_median_and_spread():
    s = Samples((1.0, 2.0, 3.0, 4.0, 100.0))
    assert s.median == 3.0
    assert s.low == 2.0 and s.high == 4.0  # quartiles: the outlier does not stretch the spread
    assert Samples((1.0, 5.0)).low == 1.0  # below four samples: min-max
    assert "3.0 (2.0-4.0)" == s.text()
    with pytest.raises(ValueError):
        Samples(())


def test_relation_says_within_noise_when_spreads_overlap():
    a, b = noisy(1.00, 0.10, seed=1), noisy(1.03, 0.10, seed=2)  # 3% apart, 10% noise
    assert verdict(a, b) == 0
    assert relation(a, b) == "within noise of"
    assert book_relation(a, b) == "within noise of"


@pytest.mark.parametrize("factor, word", [(0.5, "faster"), (2.0, "slower")])
def test_relation_decides_clear_differences(factor, word):
    a, b = noisy(1.0 * factor, 0.02, seed=3), noisy(1.0, 0.02, seed=4)
    text = relation(a, b)  # durations: lower is better
    assert text.endswith(f"{word} than") and text.startswith("2.0x")
    rates_a, rates_b = a.inverse(), b.inverse()  # the same as rates: higher is better
    assert relation(rates_a, rates_b).endswith(f"{word} than")


def test_paired_rounds_see_through_shared_drift():
    drift = [1.0, 1.3, 0.8, 1.5, 0.9, 1.2, 1.1]  # the machine's speed, round by round
    a = Samples.rates([10 * d * 1.04 for d in drift])  # always 4% faster than b in the same round
    b = Samples.rates([10 * d for d in drift])
    assert verdict(a, b) == 0  # unpaired, the drift hides it
    assert verdict(a, b, paired=True) == 1
    assert relation(a, b, paired=True) == "4.0% faster than"
    mixed = Samples.rates([10 * d * (1.04 if i % 2 else 0.96) for i, d in enumerate(drift)])
    assert relation(mixed, b, paired=True) == "within noise of"


def test_plateau_flags_timer_ticks():
    assert plateau([0.02398, 0.02399, 0.02399])  # chapter 03's 64..256 tokens on a busy host
    assert not plateau([0.010, 0.020, 0.040])
    assert not plateau([0.02398, 0.02399])  # two sizes are not a plateau
    assert timing.plateau_note([0.02398, 0.02399, 0.02399], "the step times").startswith("Warning")
    assert timing.plateau_note([1, 2, 3]) == ""


def test_measure_repeats_until_min_time_and_batches_short_calls():
    calls = []
    s = timing.measure(lambda: calls.append(1), min_total_s=0.02, min_repeats=5)
    assert len(s.values) >= 5 and len(calls) > 5 * 10  # a no-op is timed many calls per sample
    assert s.median < 1e-4
    slow = timing.measure(lambda: time.sleep(0.004), warmup=0, min_total_s=0.03, min_repeats=3)
    assert len(slow.values) >= 3 and slow.median >= 0.004


def test_clock_line_names_the_resolution():
    line = timing.clock_line()
    assert "perf_counter" in line and "ns" in line
    assert timing.clock_step() > 0


# ---------------------------------------------------------------------- takeaways under attack
def rates(center: float, seed: int) -> Samples:
    return Samples.rates(noisy(center, 0.01, n=7, seed=seed).values)


@pytest.mark.parametrize("int8, int4", [(5.0, 5.0), (15.0, 25.0), (25.0, 15.0), (10.0, 10.0), (20.0, 20.0)])
def test_quant_takeaway_follows_the_rates(int8, int4):
    r = {"half": rates(10.0, 0), "fused": rates(10.0, 1), "int8": rates(int8, 2), "int4": rates(int4, 3)}
    text = takeaways.quant_takeaway(r, {"half": 100, "int8": 55, "int4": 30}, "CPU", paired=False)
    for q, v in (("int8", int8), ("int4", int4)):
        expect = "faster than" if v > 10 else "slower than" if v < 10 else "within noise of"
        assert expect in text.split(f"{q} read")[1].split(";")[0]
    if max(int8, int4) <= 10:
        assert "Neither quantized rung beat half" in text and "fastest" not in text
    elif int8 == int4:
        assert "both beat half beyond the noise" in text and "fastest" not in text
    else:
        best = "int8" if int8 > int4 else "int4"
        assert f"fastest beyond noise was {best}" in text
    assert "buys the most speed" not in text


def record(fused: list[float], half: list[float], paired_ratio: float | None) -> dict:
    def sys(vals):
        return {"workloads": {"seed": {"decode_tok_s": sorted(vals)[len(vals) // 2], "decode_tok_s_runs": vals}}}

    rec = {"meta": {"device_name": "CPU (x86_64, 2 cores)", "git_commit": "abc1234"},
           "systems": {"fused": sys(fused), "half": sys(half)}}
    if paired_ratio is not None:
        rec["paired"] = {"rounds": 7, "ratio": paired_ratio}
    return rec


@pytest.mark.parametrize("live_fused, ratio, live_word, disagree", [
    ([13.0, 13.1, 12.9], 1.04, "slower than", True),   # the page of the issue: live slower, record faster
    ([23.0, 23.1, 22.9], 1.04, "faster than", False),
    ([19.0, 21.0, 20.0], 1.00, "within noise of", False),
    ([19.0, 21.0, 20.0], 1.04, "within noise of", False),  # undecided live: the record decides
    ([13.0, 13.1, 12.9], 0.90, "slower than", False),
])
def test_fusion_takeaway_explains_live_against_record(live_fused, ratio, live_word, disagree):
    live = record(live_fused, [19.5, 20.0, 20.5], None)
    text = takeaways.fusion_takeaway(live, record([16.3], [15.6], ratio))
    assert text.split("half")[0].endswith(f"{live_word} ")
    assert "commit abc1234" in text and "7 rounds" in text
    assert ("disagree" in text) == disagree
    assert ("could not separate" in text) == (live_word == "within noise of" and ratio != 1.0)


def test_fusion_takeaway_one_run_decides_nothing():
    text = takeaways.fusion_takeaway(record([13.0], [20.0], None), None)
    assert "cannot tell" in text and "slower" not in text


def test_ratio_growth_sentence_names_the_faster_growth():
    tiny = {128: 1.5, 8192: 340.0}  # x226
    real = {128: 20.0, 8192: 1120.0}  # x56
    text = takeaways.ratio_growth_sentence({"tiny": tiny, "real": real})
    assert "x227" in text or "x226" in text
    assert "faster on tiny than on real" in text
    swapped = takeaways.ratio_growth_sentence({"tiny": real, "real": tiny})
    assert "faster on real than on tiny" in swapped


@pytest.mark.parametrize("new_blocks, free_now, expect", [
    ([9, 10, 11], [5, 6, 7], "never been used"),  # FIFO: fresh blocks first, B's wait
    ([5, 6, 7], [9], "took the blocks B freed"),
    ([5, 9, 10], [6, 7], "took 1 of the 3 blocks"),
])
def test_block_reuse_caption_reads_the_allocator(new_blocks, free_now, expect):
    assert expect in takeaways.block_reuse_caption([5, 6, 7], new_blocks, free_now)


def test_number_word():
    assert takeaways.number_word(3) == "three" and takeaways.number_word(4) == "four"
    assert takeaways.number_word(12) == "12"


def test_figures_are_drawn_at_the_column_with_readable_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from engine_lib.book import COLUMN_IN, MIN_PT, fit_to_column
    from engine_lib.book.plots import plain_log_axis

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([1, 3, 30], [1, 2, 3])
    ax.set_title("small", fontsize=7)
    ax.set_xscale("log")
    plain_log_axis(ax.xaxis)
    fit_to_column(fig)
    fig.canvas.draw()
    assert fig.get_size_inches()[0] <= COLUMN_IN
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= MIN_PT
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and not any("times" in x or "^" in x or "×" in x for x in labels), labels
    plt.close(fig)


@pytest.mark.parametrize("b_factor, words", [(1.5, "1.5x faster than"), (1.0, "within noise of"),
                                             (0.8, "slower than")])
def test_bench_report_words_the_paired_rounds(b_factor, words):
    from engine_lib.bench.report import _paired_words

    drift = [1.0, 1.2, 0.9, 1.1, 1.05]
    wobble = [1.01, 0.99, 1.02, 0.98, 1.0] if b_factor == 1.0 else [1.0] * 5
    pr = {"decode_rounds": {"half": [10 * d for d in drift],
                            "int8": [10 * d * b_factor * w for d, w in zip(drift, wobble)]}}
    assert words in _paired_words(pr, "half", "int8")
    assert _paired_words({}, "half", "int8") == ""


def test_offline_model_names_and_titles_say_random_weights():
    import inspect
    from pathlib import Path

    from engine_lib import book

    choice = book.ModelChoice(Path("/cache/tiny-seed0"), "tiny-seed0 (random weights)", False, "cpu")
    assert choice.title == "tiny-seed0, random weights"
    assert book.ModelChoice(Path("/m"), "Qwen/Qwen2.5-1.5B-Instruct", True, "cuda").title == "Qwen/Qwen2.5-1.5B-Instruct"
    assert "(random weights, {SPEED_LAYERS} of 28 layers)" in inspect.getsource(book.pick_speed_model)


def test_gpu_record_note_until_a_record_exists(monkeypatch):
    from engine_lib import book

    monkeypatch.setattr(book, "committed_records", lambda kind="bench": [{"meta": {"device": "cpu"}}])
    assert "No GPU record" in book.gpu_record_note() and "scripts/gpu_check.sh" in book.gpu_record_note()
    gpu = {"meta": {"device": "cuda:0", "device_name": "Tesla T4", "git_commit": "abc1234"}}
    monkeypatch.setattr(book, "committed_records", lambda kind="bench": [gpu])
    assert "Tesla T4 at commit abc1234" in book.gpu_record_note()


def test_a_long_suptitle_wraps_inside_the_column():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine_lib.book import COLUMN_IN, fit_to_column

    fig, ax = plt.subplots(figsize=(8, 3))
    fig.suptitle("transformers baseline: transformers, float32, qwen2.5-1.5b-random-2l-seed0 "
                 "(random weights, 2 of 28 layers), CPU (x86_64, 2 cores)", fontsize=8)
    fit_to_column(fig)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    assert box.width <= COLUMN_IN * fig.dpi and "\n" in fig._suptitle.get_text()
    plt.close(fig)


def test_flat_run_sees_readings_equal_within_noise():
    tick = [Samples((98.0, 100.0, 104.0, 106.0)), Samples((100.0, 102.0, 106.0, 112.0)),
            Samples((99.0, 101.0, 105.0, 118.0)), Samples((146.1, 148.2, 149.4, 147.0))]
    assert timing.flat_run(tick) == 3
    note = timing.plateau_note(tick, "the sdpa timings", sizes=[64, 128, 256, 512])
    assert "3 smallest sizes (64 to 256)" in note
    growing = [Samples((1.0, 1.1, 1.05, 1.02)), Samples((2.0, 2.1, 2.05, 2.02)), Samples((4.0, 4.1, 4.2, 4.05))]
    assert timing.flat_run(growing) == 0 and timing.plateau_note(growing) == ""
