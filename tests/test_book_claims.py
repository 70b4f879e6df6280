"""The book's prose states a few numbers that the engine can check: the arithmetic intensity of
decode, where a prefill turns compute-bound, how many rungs the ladder has, and that a T4 has no
bfloat16. Each check below reads every markdown cell of chapters/ and solutions/ and fails on a
sentence that contradicts the config, the datasheet roofs or ``STAGES``.

The last tests feed the checks sentences the book used to print (issue 27), so each one is shown
able to fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine_lib.book.figures import ROOFS
from engine_lib.model.checkpoints import REAL_CONFIG
from engine_lib.model.config import Qwen2Config
from engine_lib.quant.formats import real_shape_bytes
from engine_lib.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}
NUMBER = r"(\d[\d,]*(?:\.\d+)?|" + "|".join(WORDS) + r")"


def number(text: str) -> float | None:
    text = text.lower().replace(",", "")
    if text in WORDS:
        return float(WORDS[text])
    try:
        return float(text)
    except ValueError:
        return None


def sentences(markdown: str) -> list[str]:
    """A cell's prose as sentences: code blocks dropped, list items and paragraphs split apart."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.DOTALL)
    parts = re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. |(?<=[.!?])\s+(?=[A-Z*`(\[$])", text)
    return [re.sub(r"\s+", " ", p).strip() for p in parts if p.strip()]


def book_sentences() -> list[tuple[str, str]]:
    out = []
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                out += [(f"{path.parent.name}/{path.name}", s) for s in sentences("".join(cell["source"]))]
    return out


# ----------------------------------------------------------------------------- the facts
REAL = Qwen2Config.from_json(REAL_CONFIG)
PARAMS = REAL.num_parameters()
FLOPS_PER_WEIGHT = 2  # one multiply and one add per weight per token
BYTES_PER_WEIGHT = {"32": 4.0, "16": 2.0, "int8": 1.0,
                    "int4": real_shape_bytes(REAL, "int4", torch.float16) / PARAMS}  # scales and zeros included
PRECISION = [("32", r"fp32|float32|32[- ]bit"), ("16", r"16[- ]bit|bf16|fp16|bfloat16|float16|half precision"),
             ("int8", r"int8"), ("int4", r"int4")]


def about(sentence: str, start: int) -> bool:
    return bool(re.search(r"(about|roughly|around|~|≈|some)\s*$", sentence[:start]))


def close(value: float, want: float, loose: bool) -> bool:
    return abs(value - want) <= (0.12 if loose else 0.01) * want


def batch_of(sentence: str) -> int:
    m = re.search(r"batch(?: size)?(?: of)? (\d+)", sentence)
    return int(m.group(1)) if m else 1


# ---------------------------------------------------------------------------- the checks
def intensity_problems(sentence: str) -> list[str]:
    """'N FLOPs per byte' must be 2 / bytes per weight (x batch) for the precision the sentence names,
    or a datasheet ridge where it speaks of a ridge; 'N FLOPs per weight' must be 2 (x batch)."""
    problems = []
    per_byte = re.compile(NUMBER + r"\s+FLOPs?\s*(?:/|per)\s*(?:weight\s+)?(?:B|byte)\b", re.I)
    for m in per_byte.finditer(sentence):
        value = number(m.group(1))
        if value is None:
            continue
        loose = about(sentence, m.start())
        if "ridge" in sentence.lower() and any(close(value, r.ridge, True) for r in ROOFS):
            continue
        named = [key for key, pattern in PRECISION if re.search(pattern, sentence, re.I)]
        wants = {key: FLOPS_PER_WEIGHT * PARAMS * batch_of(sentence) / (PARAMS * BYTES_PER_WEIGHT[key])
                 for key in (named or BYTES_PER_WEIGHT)}
        if not any(close(value, w, loose) for w in wants.values()):
            problems.append(f"{m.group(0)!r}: the config gives " + ", ".join(f"{w:.3g} ({k})" for k, w in wants.items()))
    per_weight = re.compile(NUMBER + r"\s+FLOPs?\s+per\s+weight\b(?!\s+byte)", re.I)
    for m in per_weight.finditer(sentence):
        value = number(m.group(1))
        want = FLOPS_PER_WEIGHT * batch_of(sentence)
        if value is not None and not close(value, want, about(sentence, m.start())):
            problems.append(f"{m.group(0)!r}: a weight costs {want} FLOPs per token")
    return problems


QUALIFIED = ("ridge", "until", "only once", "only past", "past the", "above it", "above the", "when does", "?",
             "not compute-bound", "never", "limited by")


def compute_bound_problems(sentence: str) -> list[str]:
    """'compute-bound' only where the sentence ties it to the ridge (or says until when), and a token
    count stated beside it must pass the ridge of the device named (16-bit weights: N tokens, N FLOP/B)."""
    low = sentence.lower()
    if not re.search(r"compute[- ]bound", low):
        return []
    counts = [number(c) for c in re.findall(r"(\d[\d,]*)[- ]tokens?\b", sentence)]
    negated = re.search(r"\b(not|never|below|until|do not|does not)\b", low)
    if counts and not negated:
        roofs = [r for r in ROOFS if r.name in sentence] or list(ROOFS)
        ridge = min(r.ridge for r in roofs)
        if max(counts) < ridge:
            return [f"{sentence[:120]!r}: {max(counts):.0f} tokens are below the ridge ({ridge:.0f} FLOP/B)"]
        return []
    if not any(q in low for q in QUALIFIED):
        return [f"{sentence[:120]!r}: 'compute-bound' without the ridge or a token count that passes it"]
    return []


def rung_count_problems(sentence: str) -> list[str]:
    """'our N rungs', 'all N rungs', 'N rungs of the ladder', 'a ladder of N rungs' must say len(STAGES)."""
    patterns = (r"\b(?:our|all|all of the|the ladder's)\s+" + NUMBER + r"\s+rungs\b",
                NUMBER + r"\s+rungs\s+(?:of the ladder|in all|in total)\b",
                r"ladder (?:of|has|with) " + NUMBER + r" rungs\b")
    problems = []
    for pattern in patterns:
        for m in re.finditer(pattern, sentence, re.I):
            value = number(m.group(1))
            if value is not None and value != len(STAGES):
                problems.append(f"{m.group(0)!r}: stages.py defines {len(STAGES)} rungs")
    return problems


def t4_bf16_problems(sentence: str) -> list[str]:
    """bfloat16 on a T4 only as something it lacks (chapter 06): sm75 has no native bf16."""
    if not re.search(r"\b(bf16|bfloat16)\s+on\s+(a|the)\s+T4\b", sentence):
        return []
    if re.search(r"\b(no|not|lacks?|without|emulat\w*|instead|cannot|can't|isn't|doesn't|unsupported|slow)\b",
                 sentence, re.I):
        return []
    return [f"{sentence[:120]!r}: a T4 (sm75) has no native bfloat16"]


CHECKS = (intensity_problems, compute_bound_problems, rung_count_problems, t4_bf16_problems)


def problems_in(text: str) -> list[str]:
    return [p for s in sentences(text) for check in CHECKS for p in check(s)]


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_book_states_these_numbers_as_the_engine_computes_them(check):
    assert NOTEBOOKS
    found = [f"{where}: {p}" for where, s in book_sentences() for p in check(s)]
    assert not found, "\n".join(found)


OLD = {  # sentences the book printed before issue 27, word for word
    intensity_problems: "a decode point (one token per step: about two FLOPs per weight byte in 16 bits, far "
                        "left of every ridge)",
    compute_bound_problems: "### Prefill is compute-bound, decode is bandwidth-bound",
    rung_count_problems: "It loads each system in turn (our four rungs, then `transformers` with "
                         "`use_cache=False` as in the original write-up)",
    t4_bf16_problems: "Then print it for the real model in bfloat16 on a T4 (`bandwidth=320e9`): how far is the "
                      "real model from it?",
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_each_check_fails_on_the_old_claim(check):
    assert check(sentences(OLD[check])[0]), f"{check.__name__} passed {OLD[check]!r}"
    assert problems_in(OLD[check])


def test_the_checks_pass_the_corrected_claims():
    fixed = ("Decode streams every weight once per token, about 1 FLOP per byte in 16 bits. "
             "A 2,048-token prefill on a T4 is compute-bound. "
             "A 65-token prompt stays bandwidth-bound until about 203 tokens, past the ridge. "
             f"The harness measures all {len(STAGES)} rungs. "
             "A T4 lacks bf16: bfloat16 on a T4 is emulated. "
             "At batch 8 in 16 bits a decode step does 8 FLOPs per byte. "
             "A decode step does about 2 FLOPs per weight per token.")
    assert problems_in(fixed) == []
    assert compute_bound_problems("A 65-token prompt is compute-bound on a T4.")


# ----------------------------------------------------------------------------- retired wordings (issue 51)
RETIRED = {  # a phrase the book used -> why it is wrong
    "memory-bound": "the book's one term for the bandwidth limit is 'bandwidth-bound'",
    "hard ceiling on tokens/s": "speculative decoding and batching make more than one token per weight read",
    "chapter 13's kernels": "the Triton kernels are chapter 14's",
    "read in an afternoon": "the engine is about 20k lines; chapter 15 counts them",
    "last rung of the ladder": "int8, int4 and triton come after fused",
    "runs every chapter with the real weights": "no chapter has been run on a T4",
    "dequantized inside the matmul": "where dequantization happens depends on the device and the rows",
}


def book_texts() -> dict[str, str]:
    """Every text a reader meets: the notebooks' cells, the site's pages and the rung descriptions."""
    out = {f"{p.parent.name}/{p.name}": "\n".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"])
           for p in NOTEBOOKS}
    out |= {f"book/{p.name}": p.read_text() for p in sorted((ROOT / "book").glob("*.md"))}
    out["engine_lib/stages.py"] = " ".join(s.summary for s in STAGES.values())
    return out


def retired_in(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text).lower()
    return [f"{phrase!r}: {why}" for phrase, why in RETIRED.items() if phrase in flat]


def test_no_retired_wording_is_left():
    found = [f"{where}: {p}" for where, text in book_texts().items() for p in retired_in(text)]
    assert not found, "\n".join(found)


def test_the_retired_check_can_fail():
    found = retired_in("Decode is memory-bound, which sets a hard\nceiling on tokens/s.")
    assert [p.split(":")[0] for p in found] == ["'memory-bound'", "'hard ceiling on tokens/s'"]
