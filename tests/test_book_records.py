"""engine_lib.book.committed_records: each chapter reads only its own kind of record."""

import pytest


def test_committed_records_are_sorted_by_kind():
    """Chapter 08 reads bench records: a quantization or training record is not one."""
    from engine_lib import book

    bench = [r["file"] for r in book.committed_records("bench")]
    assert bench and all(r.count(".") == 1 for r in bench), bench
    assert [r["file"] for r in book.committed_records("quant")] == ["qwen2-stdlib-small.quant.json"]
    assert [r["file"] for r in book.committed_records("train")] == ["small-model.train.json"]
    with pytest.raises(ValueError, match="unknown record kind"):
        book.committed_records("quants")
