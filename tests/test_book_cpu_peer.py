"""Chapter 08's and the CPU appendix's CPU figures (book/cpu_peer.py): the tables and the advice come from the
full-depth record's own ratios, and the advice names llama.cpp when one of its files decodes faster than every
rung."""

import pytest
from depth_helpers import depth_record

from engine_lib.book.cpu_peer import (
    PAIR_HEADER,
    SYSTEM_HEADER,
    advice,
    best_pairs,
    caption,
    newest_per_machine,
    peer_chart,
    peer_rows,
    system_rows,
)


def test_rows_pair_each_rung_with_each_llama_cpp_file_of_its_width():
    rec = depth_record(int4_rate=40.0, q4_rate=35.0)
    rows = peer_rows(rec)
    assert [r[0] for r in rows] == ["int8 / Q8_0", "int4 / Q4_0", "int4 / Q4_K_M"]
    assert all(len(r) == len(PAIR_HEADER) for r in rows)
    assert rows[1][1] == "42.0 / 36.8" and rows[1][2].startswith("1.14x (") and rows[1][5] == "1.40 / 1.90"
    assert rows[1][3] == "350 / 440" and rows[1][4] == "1.26x" and rows[1][6] == "3.0 / 2.0"
    table = system_rows(rec)
    assert [r[0] for r in table][:2] == ["hf:bfloat16", "engine:int8"] and all(len(r) == len(SYSTEM_HEADER) for r in table)
    assert table[1][4] == "26.2" and table[1][6] == "12.0 / 2.52"
    assert "2 threads for every system" in caption(rec) and "x.depth.json" in caption(rec)


def test_a_width_leads_only_if_it_leads_every_file_of_its_width():
    rec = depth_record(int4_rate=40.0, q4_rate=35.0)  # int4: 1.14x Q4_0, 1.33x Q4_K_M
    assert [(v["rung"], v["peer"]) for v in best_pairs(rec)] == [("int8", "Q8_0"), ("int4", "Q4_0")]


def test_the_advice_names_the_faster_system():
    faster = advice(depth_record(int4_rate=40.0, q4_rate=35.0))
    assert faster[1].startswith("At 4 bits, the int4 rung decoded at 1.14x llama.cpp's Q4_0 (spread 1.03-1.26)")
    assert "its first token came 1.26x as fast, and it held 0.74x llama.cpp's peak memory." in faster[1]
    assert faster[-1].endswith("Without a GPU, on a CPU like this one, run the int4 rung.")
    slower = advice(depth_record(int4_rate=20.0, q4_rate=35.0))
    assert slower[-1].endswith("llama.cpp's Q4_0 is the faster choice (1.40x); of this engine's rungs, use int8.")


def test_each_kind_of_cpu_gets_its_newest_record():
    def at(cpu, stamp):
        rec = depth_record()
        rec["meta"] = {**rec["meta"], "cpu_model": cpu, "timestamp": stamp}
        return rec

    old, new, other = at("A", "2026-12-01"), at("A", "2026-12-02"), at("B", "2026-12-03")
    assert newest_per_machine([old, other, new]) == [other, new]


def test_the_sentences_under_each_table_are_displayed_in_place(monkeypatch):
    """Printed text is merged into one block per cell by the site (nb_merge_streams), which would put
    the first record's sentences under the second table: they are displayed, wrapped, instead."""
    display = pytest.importorskip("IPython.display")  # the book's environment has it (the lock)

    from engine_lib.book import WIDTH, say_here

    shown = []
    monkeypatch.setattr(display, "display", lambda obj: shown.append(obj))
    say_here(*advice(depth_record()))
    text = shown[0].data
    assert len(shown) == 1 and "run the int4 rung." in text.replace("\n", " ")
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_the_chart_draws_every_pair_from_the_record():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = depth_record(int4_rate=40.0, q4_rate=35.0)
    fig = peer_chart([rec])
    widths = [round(p.get_width(), 6) for p in fig.axes[0].patches]
    assert widths == [round(v["decode_x"], 6) for v in rec["ratios"]]
    plt.close(fig)
