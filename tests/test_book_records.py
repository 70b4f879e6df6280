"""engine_lib.book.committed_records: each chapter reads only its own kind of record."""

import pytest


def test_committed_records_are_sorted_by_kind():
    """Chapter 08 reads bench records: a quantization or training record is not one."""
    from engine_lib import book

    bench = [r["file"] for r in book.committed_records("bench")]
    assert all(r.count(".") == 1 for r in bench), bench  # the CPU ladder is a full-depth record now (below)
    depth = [r["file"] for r in book.committed_records("depth")]
    assert depth and all(f.endswith(".depth.json") for f in depth) and not set(depth) & set(bench)
    assert [r["file"] for r in book.committed_records("quant")] == ["qwen2-stdlib-small.quant.json"]
    assert [r["file"] for r in book.committed_records("train")] == ["small-model.train.json"]
    with pytest.raises(ValueError, match="unknown record kind"):
        book.committed_records("quants")
