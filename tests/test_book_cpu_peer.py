"""Chapter 08's CPU section (book/cpu_peer.py): the table and the advice come from the record's own
peer ratios, and the advice names llama.cpp when one of its files decodes faster than every rung."""

import pytest

from engine_lib.bench.llamacpp import peer_ratios
from engine_lib.book.cpu_peer import advice, caption, newest_per_machine, peer_records, peer_rows


def record(int4_rate: float, q4_rate: float) -> dict:
    def rung(stage, dtype, tok_s, ttft):
        return {"kind": "engine", "stage": stage, "dtype": dtype,
                "workloads": {"seed": {"decode_tok_s": tok_s, "ttft_ms": ttft}}}

    def peer(kind, tok_s, ttft):
        return {"kind": "peer", "peer": kind, "stage": None, "dtype": kind, "threads": 2,
                "workloads": {"seed": {"decode_tok_s": tok_s, "ttft_ms": ttft}}}

    rec = {"file": "x.json", "meta": {"model": "m", "real_weights": False, "device_name": "CPU (x86_64, 2 cores)",
                                      "timestamp": "2026-12-02T06:00:00Z"},
           "systems": {"half": rung("half", "bfloat16", 20.0, 100.0), "llama.cpp_BF16": peer("BF16", 25.0, 80.0),
                       "int4": rung("int4", "bfloat16", int4_rate, 110.0), "llama.cpp_Q4_0": peer("Q4_0", q4_rate, 50.0),
                       "kv_cache": rung("kv_cache", "float32", 8.0, 300.0)}}
    rec["peer_ratios"] = peer_ratios(rec)
    return rec


def test_rows_pair_each_rung_with_llama_cpp_at_its_width():
    rec = record(80.0, 100.0)
    rows = peer_rows(rec)
    assert [(r[0], r[1], r[2]) for r in rows] == [("16", "half (bfloat16)", "BF16"), ("4", "int4 (bfloat16)", "Q4_0")]
    assert rows[0][3] == "20.0 / 25.0" and rows[0][4].startswith("0.80x") and rows[0][6] == "0.80x"
    assert "2 threads for both" in caption(rec) and "x.json" in caption(rec)


def test_the_advice_names_the_faster_system():
    slower = advice(record(80.0, 100.0))
    assert slower[0].startswith("At 16 bits, the half rung decoded") and "(0.80x)" in slower[0]
    assert "llama.cpp's Q4_0 is the faster choice (1.25x the int4 rung); of this engine's rungs, use int4." in slower[-1]
    faster = advice(record(120.0, 100.0))
    assert faster[-1].endswith("Without a GPU, run the int4 rung: on this CPU it is the fastest of all.")


def test_a_slower_first_token_is_said_as_time_taken():
    rec = record(80.0, 100.0)  # half's first token 100 ms against 80, int4's 110 against 50
    assert advice(rec)[0].endswith("and its first token took 1.25x as long as llama.cpp's.")
    rec["systems"]["half"]["workloads"]["seed"]["ttft_ms"] = 40.0
    rec["peer_ratios"] = peer_ratios(rec)
    assert advice(rec)[0].endswith("and its first token came 2.00x as fast.")


def test_only_records_with_a_peer_are_read_newest_first():
    a, b = record(1.0, 2.0), record(1.0, 2.0)
    b["meta"] = {**b["meta"], "timestamp": "2026-12-03T00:00:00Z"}
    assert peer_records([a, {"meta": {"timestamp": "z"}}, b]) == [b, a]


def test_each_kind_of_cpu_gets_its_newest_record():
    def at(device, stamp):
        rec = record(80.0, 100.0)
        rec["meta"] = {**rec["meta"], "device_name": device, "timestamp": stamp}
        return rec

    avx2_old, avx2_new = at("CPU (x86_64, AVX2, 2 cores)", "2026-12-01"), at("CPU (x86_64, AVX2, 2 cores)", "2026-12-02")
    amx = at("CPU (x86_64, AVX512 + AMX, 2 cores)", "2026-12-03")
    assert newest_per_machine([avx2_old, amx, avx2_new, {"meta": {}}]) == [amx, avx2_new]
    # two hosts held to the same instructions are two machines where the records name their CPUs
    other_host = at("CPU (x86_64, AVX2, 2 cores)", "2026-12-04")
    other_host["meta"].update(cpu_model="Intel(R) Xeon(R) Processor", huge_pages="the engine's weights on 2 MiB pages")
    assert newest_per_machine([avx2_old, amx, avx2_new, other_host]) == [other_host, amx, avx2_new]
    assert "(Intel(R) Xeon(R) Processor; the engine's weights on 2 MiB pages)" in caption({**other_host, "file": "x.json"})
    assert "(CPU model not recorded)" in caption({**avx2_new, "file": "x.json"})


def test_the_sentences_under_each_table_are_displayed_in_place(monkeypatch):
    """Printed text is merged into one block per cell by the site (nb_merge_streams), which would put
    the first record's sentences under the second table: they are displayed, wrapped, instead."""
    display = pytest.importorskip("IPython.display")  # the book's environment has it (the lock)

    from engine_lib.book import WIDTH, say_here

    shown = []
    monkeypatch.setattr(display, "display", lambda obj: shown.append(obj))
    say_here(*advice(record(80.0, 100.0)))
    text = shown[0].data
    assert len(shown) == 1 and "of this engine's rungs, use\nint4." in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_a_lead_within_noise_is_called_a_tie():
    rec = record(105.0, 100.0)
    for v in rec["peer_ratios"].values():
        if v["rung"] == "int4":
            v["decode_x_range"] = (0.96, 1.12)
    assert advice(rec)[-1].endswith("Without a GPU, run the int4 rung or llama.cpp's Q4_0: they decoded within noise "
                                    "of each other (1.05x, spread 0.96-1.12), faster than the rest.")


def test_the_chart_draws_each_records_best_pair_per_width_from_its_readings():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine_lib.book.cpu_peer import best_pairs, peer_chart

    recs = [record(80.0, 100.0), record(120.0, 60.0)]
    fig = peer_chart(recs)
    widths = [round(p.get_width(), 6) for p in fig.axes[0].patches]
    want = []
    for rec in recs:
        pairs = best_pairs(rec)
        assert [v["bits"] for v in pairs] == sorted((v["bits"] for v in pairs), reverse=True)
        want += [round(v["decode_x"], 6) for v in pairs]
    assert widths == want and 0.8 in widths and 2.0 in widths  # int4 80/100, then 120/60
    plt.close(fig)
