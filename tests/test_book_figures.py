"""The book's figures: drawn from the config or a record, never typed in, and no wider than the page."""

import dataclasses
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import same_color  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from engine_lib.book.figures import (  # noqa: E402
    decoder_diagram,
    gqa_diagram,
    kv_cache_diagram,
    prefill_decode_timeline,
    roofline_plot,
    roofline_points,
)
from engine_lib.model.checkpoints import preset_config  # noqa: E402

RECORD = Path(__file__).resolve().parent / "data/ladder-4l-cpu.json"  # a 4-layer ladder record, kept for its layout
REAL = preset_config("qwen2.5-1.5b-random")


@pytest.fixture
def close():
    """Collects figures and closes them after the test, pass or fail."""
    figs = []
    yield lambda fig: figs.append(fig) or fig
    for fig in figs:
        plt.close(fig)


def texts(fig) -> str:
    """Every string drawn on the figure (titles, labels, annotations, legend), one per line, with wrapped lines
    joined and thousands separators removed."""
    return "\n".join(" ".join(t.get_text().split()) for t in fig.findobj(Text)).replace(",", "")


def record() -> dict:
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("build", [
    lambda: decoder_diagram(REAL),
    lambda: prefill_decode_timeline(39, 0.45, 0.16, 32, "CPU, float32"),
    lambda: kv_cache_diagram(REAL),
    lambda: kv_cache_diagram(REAL, max_len=32, filled=0),
    lambda: gqa_diagram(REAL),
    lambda: roofline_plot([record()]),
])
def test_figures_fit_the_page(build, close):
    fig = close(build())
    assert isinstance(fig, Figure)
    assert fig.get_figwidth() <= 8
    fig.canvas.draw()  # lays out every text: a bad format string or artist fails here
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 10  # drawn at the column, shown unscaled


def test_decoder_diagram_reads_its_shapes_from_the_config(close):
    t = texts(close(decoder_diagram(REAL)))
    for s in ("(seq 1536)", "1536 → 8960", "8960 → 1536", "151936 × 1536", "(seq 151936)", "× 28 layers",
              "q: 12 heads × 128", "k v: 2 heads × 128", "same matrix (tied)"):
        assert s in t, s
    small = close(decoder_diagram(dataclasses.replace(REAL, num_hidden_layers=4, intermediate_size=4096)))
    t4 = texts(small)
    assert "× 4 layers" in t4 and "× 28" not in t4
    assert "1536 → 4096" in t4 and "8960" not in t4
    untied = texts(close(decoder_diagram(dataclasses.replace(REAL, tie_word_embeddings=False))))
    assert "same matrix" not in untied and "not tied" in untied


def test_kv_cache_diagram_computes_the_per_token_size(close):
    # 2 (K, V) × 28 layers × 2 kv heads × 128 × 2 bytes = 28,672 bytes = 28 KiB
    assert 2 * 28 * 2 * 128 * 2 == 28 * 1024
    t = texts(close(kv_cache_diagram(REAL, max_len=16, filled=9)))
    assert "= 28 KiB per token in bf16" in t
    assert "slot = filled = 9" in t and "layer 27" in t and "max_len=16" in t
    fp32 = texts(close(kv_cache_diagram(dataclasses.replace(REAL, num_hidden_layers=4), bytes_per_element=4)))
    assert "= 8 KiB per token in fp32" in fp32  # 2 × 4 × 2 × 128 × 4 bytes and "layer 3" in fp32 and "layer 27" not in fp32


def test_kv_cache_diagram_shades_written_slots_and_rejects_a_full_cache(close):
    fig = close(kv_cache_diagram(REAL, max_len=8, filled=3))
    cells = fig.axes[0].patches
    orange = [p for p in cells if same_color(p.get_facecolor()[:3], "tab:orange")]
    # 3 layers drawn (0, 1, 27) × K and V × 2 kv heads: one next slot each, max_len cells each
    assert len(cells) == 3 * 2 * 2 * 8 and len(orange) == 3 * 2 * 2
    first = min(c.get_x() for c in cells)  # slot 0 of the K grids
    assert any(p.get_x() - first == pytest.approx(3) for p in orange)  # slot = filled
    assert not any(p.get_x() - first == pytest.approx(s) for p in orange for s in (2, 4))
    with pytest.raises(ValueError, match="filled"):
        kv_cache_diagram(REAL, max_len=8, filled=8)


def test_gqa_diagram_groups_query_heads(close):
    fig = close(gqa_diagram(REAL))
    t = texts(fig)
    assert "6 query heads share one K/V head: the cache is 6x smaller" in t
    assert {f"q{i}" for i in range(12)} == {s for s in t.split("\n") if s.startswith("q")}
    assert "K/V head 1" in t and "K/V head 2" not in t
    tiny = texts(close(gqa_diagram(preset_config("tiny"))))
    assert "2 query heads share one K/V head" in tiny and "q3" in tiny and "q4" not in tiny


def test_timeline_draws_prefill_and_elides_long_decodes(close):
    fig = close(prefill_decode_timeline(2000, 0.5, 0.02, 100, "H200 bf16 qwen2.5-1.5b"))
    t = texts(fig)
    assert "prefill: 2000 positions in one forward" in t and "decode: one position per forward" in t
    assert "H200 bf16 qwen2.5-1.5b" in t
    assert "75 more steps" in t  # 99 decode steps, 24 drawn
    assert "done at 2480 ms" in t  # 500 + 99 × 20
    bars = [len(c.get_paths()) for c in fig.axes[0].collections]
    assert bars == [1, 24]
    short = close(prefill_decode_timeline(35, 0.1, 0.01, 5, "x"))
    assert [len(c.get_paths()) for c in short.axes[0].collections] == [1, 4]
    assert "more steps" not in texts(short)


def synthetic_record() -> dict:
    P = 10**9
    return {"meta": {"model": "synthetic", "num_parameters": P, "device_name": "Test GPU", "real_weights": True,
                     "device": "cuda"},
            "systems": {
                "a": {"kind": "engine", "dtype": "bfloat16", "weight_bytes": 2 * P, "workloads": {
                    "seed": {"ttft_ms": 50.0, "decode_tok_s": 10.0, "prompt_tokens": [40]},
                    "long": {"ttft_ms": 500.0, "decode_tok_s": 9.0, "prompt_tokens": [1000]}}},
                "b": {"kind": "engine", "dtype": "float32", "weight_bytes": 4 * P, "workloads": {
                    "seed": {"ttft_ms": 20.0, "decode_tok_s": 5.0, "prompt_tokens": [30, 40, 90]},
                    "long": {"error": "OutOfMemoryError: ..."}}},
                "c": {"kind": "engine", "dtype": "bfloat16", "weight_bytes": 2 * P, "workloads": {
                    "seed": {"error": "RuntimeError: ..."},
                    "long": {"ttft_ms": 250.0, "decode_tok_s": math.nan, "prompt_tokens": [500]}}},
                "hf_generate_bfloat16": {"kind": "hf", "dtype": "bfloat16", "weight_bytes": 2 * P, "workloads": {
                    "seed": {"ttft_ms": 1.0, "decode_tok_s": 1.0, "prompt_tokens": [40]}}}}}


def test_roofline_points_by_hand():
    pts = {(p["rung"], p["phase"]): p for p in roofline_points(synthetic_record())}
    # no hf point, no decode for c (seed errored)
    assert set(pts) == {("a", "decode"), ("a", "prefill"), ("b", "decode"), ("b", "prefill"), ("c", "prefill")}
    expect = {  # (FLOP/byte, FLOP/s), with FLOPs per token = 2 × 1e9
        ("a", "decode"): (2e9 / 2e9, 2e9 * 10),
        ("a", "prefill"): (2e9 * 1000 / 2e9, 2e9 * 1000 / 0.5),  # long workload
        ("b", "decode"): (2e9 / 4e9, 2e9 * 5),
        ("b", "prefill"): (2e9 * 40 / 4e9, 2e9 * 40 / 0.02),  # long errored: seed, its median prompt (40)
        ("c", "prefill"): (2e9 * 500 / 2e9, 2e9 * 500 / 0.25),
    }
    for key, (intensity, flops) in expect.items():
        assert pts[key]["intensity"] == pytest.approx(intensity, rel=1e-12), key
        assert pts[key]["flops_per_s"] == pytest.approx(flops, rel=1e-12), key
    assert pts["b", "decode"]["dtype"] == "float32" and pts["a", "prefill"]["device_name"] == "Test GPU"
    assert all(p["real_weights"] is True for p in pts.values())


def test_roofline_plot_on_the_committed_record(close):
    rec = record()
    fig = close(roofline_plot([rec, synthetic_record()], title="two records"))
    t = texts(fig)
    assert "T4 ridge: ~203 FLOP/B" in t and "H200 ridge: ~206 FLOP/B" in t  # 65e12 / 320e9, 989e12 / 4.8e12
    assert "CPU (x86_64 2 cores)" in t and "Test GPU" in t and "two records" in t
    bw = rec["copy_bandwidth_bytes_s"] / 1e9  # the CPU record carries one; the synthetic one does not
    assert f"measured copy bandwidth {bw:,.1f} GB/s" in t
    drawn = {(x, y) for line in fig.axes[0].lines for x, y in zip(line.get_xdata(), line.get_ydata())}
    pts = roofline_points(rec) + roofline_points(synthetic_record())
    engines = [s for s in rec["systems"].values() if s["kind"] == "engine"]
    assert len(pts) == 2 * len(engines) + 5  # a decode and a prefill point per rung of the CPU record
    for p in pts:
        assert (p["intensity"], p["flops_per_s"]) in drawn


# ------------------------------------------------------------------------------------ chapter 14
def _kernel_record(device="cuda", interpreter=False, speedup=2.5, int8_share=0.9):
    roof = 4.3e12
    rows = [dict(kernel="decode_attention", shape="batch 1, context 4096", baseline="SDPA over the buffer + mask "
                 "(fused rung's step)", bytes=10**8, ours_us=10.0, baseline_us=10.0 * speedup, speedup=speedup,
                 gbps=1e4),
            dict(kernel="int8_matvec", shape="gate_up 17920 x 1536, rows 1", baseline="the int8 rung's compiled matmul",
                 bytes=10**8, ours_us=10.0, baseline_us=12.0, speedup=1.2, gbps=int8_share * roof / 1e9)]
    return {"meta": {"device": device, "device_name": "NVIDIA H200", "dtype": "bfloat16", "interpreter": interpreter,
                     "copy_bandwidth_bytes_s": roof}, "rows": rows}


def test_split_kv_diagram_counts_the_programs_from_its_arguments():
    from engine_lib.book.kernel_figures import split_kv_diagram

    fig = split_kv_diagram(300, 64, batch=2, kv_heads=2, groups=6)
    texts = " ".join(t.get_text() for t in fig.findobj(Text))
    assert "5 chunks of 64" in texts and "20 programs" in texts and "256-299" in texts
    assert fig.get_size_inches()[0] <= 8
    plt.close(fig)


@pytest.mark.parametrize("speedup,share,words", [(2.5, 0.9, ["2.50x, met", "90%, met"]),
                                                 (1.5, 0.5, ["1.50x, NOT met", "50%, NOT met"])])
def test_kernel_targets_follow_the_record(speedup, share, words):
    from engine_lib.book.kernel_figures import kernel_targets

    text = "\n".join(kernel_targets(_kernel_record(speedup=speedup, int8_share=share)))
    assert all(w in text for w in words), text


def test_kernel_targets_never_judge_interpreter_timings():
    from engine_lib.book.kernel_figures import kernel_bandwidth_plot, kernel_targets

    lines = kernel_targets(_kernel_record(device="cpu", interpreter=True))
    assert all("met" not in line for line in lines) and sum("no record measured it" in line for line in lines) == 2
    fig = kernel_bandwidth_plot(_kernel_record())
    assert fig.get_size_inches()[0] <= 8
    plt.close(fig)


# ------------------------------------------------------------------------------------ chapter 12
def test_shared_prefix_tables_come_from_the_prefix_caching_allocator():
    from engine_lib.book.serving_figures import shared_prefix_tables

    tables, cached, shared = shared_prefix_tables(40, [12, 30, 7])
    # 40 shared tokens = 2 full blocks of 16 (+ 8 tokens in a block each request owns)
    assert list(tables) == ["A", "B", "C"] and cached == {"A": 0, "B": 32, "C": 32}
    assert len(shared) == 2 and all(t[:2] == shared for t in tables.values())
    assert [len(t) for t in tables.values()] == [4, 5, 3]  # ceil(52 / 16), ceil(70 / 16), ceil(47 / 16)
    own = [b for t in tables.values() for b in t[2:]]
    assert len(own) == len(set(own)) and not set(own) & set(shared)
    # a system prompt shorter than a block shares nothing; one of exactly 2 blocks is shared whole
    assert shared_prefix_tables(10, [5, 5])[2] == []
    tables, cached, shared = shared_prefix_tables(32, [3, 4], block_size=16)
    assert len(shared) == 2 and cached == {"A": 0, "B": 32}


def test_shared_prefix_diagram_labels_what_it_draws(close):
    from engine_lib.book.serving_figures import shared_prefix_diagram

    fig = close(shared_prefix_diagram(40, (12, 30, 7)))
    t = texts(fig)
    assert "A: 52 tok" in t and "B: 70 tok" in t and "C: 47 tok" in t and "32 cached" in t
    assert "2 blocks held by 3 requests" in t and "2 full block(s) are shared" in t
    assert t.count("shared") >= 3  # the title and the two shared blocks of the pool
    assert fig.get_figwidth() <= 8
    fig.canvas.draw()
    assert min(t.get_fontsize() for t in fig.findobj(Text) if t.get_text()) >= 10
