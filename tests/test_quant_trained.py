"""Quantization damage on the trained preset ``qwen2-stdlib-small`` (chapter 10), on held-out
Python it never trained on: int8 barely moves the perplexity, int4 round-to-nearest moves it
more, and GPTQ (calibrated on the training split) closes most of that gap in the same format;
top-1 agreement with the half rung is high for int8, lower for int4; the committed record agrees
with itself. The thresholds below were measured on this preset on a 2-core CPU; each comment
gives the measured value and the margin left."""

import math

import pytest

from engine_lib.bench.perplexity import text_ids
from engine_lib.bench.quant_check import (
    committed_quant_record,
    heldout_snippets,
    quant_accuracy,
    quant_perplexity,
    stdlib_calibration,
)
from engine_lib.model.checkpoints import HELDOUT_MANIFEST, HELDOUT_TEXT, STDLIB_SMALL, ensure_checkpoint
from engine_lib.model.tokenizer import load_tokenizer

SLICE = 2048  # held-out tokens scored (context 128, stride 64, as the chapter and the record)
CAL_TOKENS = 8192  # GPTQ calibration tokens from the training split (as the chapter and the record)

# On the first 2,048 held-out tokens (measured: half 315.35, int8 317.09, int4 RTN 420.49, GPTQ 338.82):
INT8_MAX_GAP = 0.02  # |int8 / half - 1|; measured 0.0055 (margin 3.6x). int4 RTN must exceed twice it: measured 0.333
GPTQ_MIN_CLOSED = 0.5  # share of RTN's gap GPTQ closes; measured 0.777 (the target: half of it)
# On 6 held-out snippets of 64 tokens (384 positions; measured: int8 95.1%, int4 RTN 58.9%, GPTQ 70.1%):
INT8_MIN_TOP1 = 0.90  # int8's top-1 agreement with half at every position; measured 0.951 (margin 5 points)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return ensure_checkpoint(STDLIB_SMALL, root=tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def tok(small_dir):
    return load_tokenizer(small_dir)


@pytest.fixture(scope="module")
def calibration(tok):
    import json

    held = {f["path"] for f in json.loads(HELDOUT_MANIFEST.read_text())["files"]}
    seqs, info = stdlib_calibration(tok, held, CAL_TOKENS, 128)
    assert info["tokens"] == CAL_TOKENS and not set(info["first_files"]) & held
    return seqs


@pytest.fixture(scope="module")
def qp(small_dir, tok, calibration):
    ids = text_ids(tok, HELDOUT_TEXT.read_text(encoding="utf-8"), SLICE)
    return quant_perplexity(small_dir, "cpu", ids, calibration, 128, 64)


def test_perplexity_gaps_on_a_heldout_slice(qp):
    """The chapter's perplexity table, on a shorter slice: int8 within INT8_MAX_GAP of half,
    round-to-nearest int4 further than GPTQ, and GPTQ closing at least GPTQ_MIN_CLOSED of
    round-to-nearest's gap."""
    ppl = {k: v["ppl"] for k, v in qp["rungs"].items()}
    assert qp["tokens"] == SLICE - 1 and qp["context"] == 128 and qp["dtype"] == "bfloat16"
    assert all(math.isfinite(p) and 1 < p < 151_936 for p in ppl.values()), ppl
    assert abs(ppl["int8"] / ppl["half"] - 1) < INT8_MAX_GAP, ppl
    assert ppl["int4"] - ppl["half"] > ppl["int4_gptq"] - ppl["half"], ppl
    assert ppl["int4"] / ppl["half"] - 1 > 2 * INT8_MAX_GAP, ppl  # int4 RTN damage is visible, unlike int8's
    closed = (ppl["int4"] - ppl["int4_gptq"]) / (ppl["int4"] - ppl["half"])
    assert qp["gap_closed"] == pytest.approx(closed)
    assert closed >= GPTQ_MIN_CLOSED, ppl
    assert qp["gptq"]["calibration_tokens"] == CAL_TOKENS and qp["gptq"]["seconds"] > 0
    errors = qp["gptq"]["summed_layer_error"]
    assert errors["gptq"] < errors["rtn"], errors  # what GPTQ minimises: the layers' output error


def test_top1_agreement_on_heldout_snippets(small_dir, tok, calibration):
    """The chapter's check, smaller: every rung computes its own dequantized weights (GPTQ's
    included), int8 agrees with half's top-1 at INT8_MIN_TOP1 of the positions or more, int4
    round-to-nearest less often than int8, and GPTQ more often than round-to-nearest."""
    prompts = heldout_snippets(tok, 6, 64)
    assert len(prompts) == 6 and all(len(p) == 64 for p in prompts) and prompts[0] != prompts[1]
    acc = quant_accuracy(small_dir, "cpu", ("int8", "int4", "int4_gptq"), prompts, 8, calibration=calibration)
    for mode in ("int8", "int4", "int4_gptq"):
        r = acc[mode]
        assert r["kernels"]["ok"] and len(r["kernels"]["decided"]) >= 3, (mode, r["kernels"])
        assert r["top1"]["positions"] == 6 * 64 and len(r["follow"]) == 6
    assert acc["int4_gptq"]["gptq"]["calibration_tokens"] == CAL_TOKENS
    top1 = {m: acc[m]["top1"]["share"] for m in ("int8", "int4", "int4_gptq")}
    assert top1["int8"] >= INT8_MIN_TOP1, top1
    assert top1["int4"] < top1["int8"], top1
    assert top1["int4_gptq"] > top1["int4"], top1  # measured 0.701 vs 0.589
    assert acc["int8"]["vs_half"]["max_dlogit"] < acc["int4"]["vs_half"]["max_dlogit"]
    with pytest.raises(ValueError, match="calibration"):
        quant_accuracy(small_dir, "cpu", ("int4_gptq",), prompts)


def test_committed_record_is_whole_heldout_text_and_consistent(tok):
    record = committed_quant_record(STDLIB_SMALL)
    assert record is not None and record["model"] == STDLIB_SMALL
    n = len(text_ids(tok, HELDOUT_TEXT.read_text(encoding="utf-8")))
    assert record["tokens"] == n - 1 and record["text"]["tokens"] == n  # all of it, every token but the first scored
    r = {k: v["ppl"] for k, v in record["rungs"].items()}
    assert record["gap_closed"] == pytest.approx((r["int4"] - r["int4_gptq"]) / (r["int4"] - r["half"]))
    assert record["gap_closed"] >= 0.5 and record["target_met"]
