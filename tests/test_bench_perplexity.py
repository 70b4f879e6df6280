"""Perplexity (chapter 10): the sliding window scores every token once, equals transformers' loss
over the same windows on the same weights, equals a hand computation on one window, and the
``perplexity`` command reports it with its token count."""

import math
from pathlib import Path

import pytest
import torch

from engine_lib.bench.perplexity import perplexity, text_ids, windows
from engine_lib.cli import main

TEXT = Path(__file__).resolve().parents[1] / "engine_lib" / "model" / "loader.py"  # any text: the source of the loader


@pytest.fixture(scope="module")
def ids(engines):
    return text_ids(engines("kv_cache").tokenizer, TEXT.read_text(), 300)


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (10, 4, 4), (300, 128, 64), (5, 16, 8), (129, 128, 1)])
def test_windows_score_every_token_once(n, context, stride):
    scored = [j for _, end, first in windows(n, context, stride) for j in range(first, end)]
    spans = windows(n, context, stride)
    assert all(end - begin <= context and begin < first for begin, end, first in spans)
    if stride < context:
        assert scored == list(range(1, n))  # every token but the first, once, in order
    else:  # disjoint windows: each window's first token has no context in it
        assert scored == [j for j in range(1, n) if j % context]


def test_equals_transformers_loss_over_the_same_windows(engines, hf_tiny, ids):
    context, stride = 128, 64
    ours = perplexity(engines("kv_cache"), ids, context, stride)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for begin, end, first in windows(len(ids), context, stride):
            x = torch.tensor([ids[begin:end]])
            labels = x.clone()
            labels[0, :first - begin] = -100  # context only (transformers shifts the labels itself)
            n = end - first
            nll += hf_tiny(input_ids=x, labels=labels).loss.double().item() * n
            count += n
    assert ours.tokens == count == len(ids) - 1 and ours.windows == 4
    assert ours.ppl == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert ours.nll_sum == pytest.approx(nll, rel=1e-4)


def test_one_window_equals_the_hand_computation(engines, ids):
    engine = engines("kv_cache")
    x = ids[:100]
    logp = torch.log_softmax(engine.logits(torch.tensor(x)), dim=-1)
    nll = -sum(logp[j - 1, x[j]].item() for j in range(1, len(x)))
    r = perplexity(engine, x, context=128)
    assert (r.windows, r.tokens, r.text_tokens) == (1, 99, 100)
    assert r.ppl == pytest.approx(math.exp(nll / 99), rel=1e-5)
    assert r.settings["stage"] == "kv_cache" and r.settings["dtype"] == "float32" and r.settings["device"] == "cpu"


def test_bad_settings_are_refused(engines):
    with pytest.raises(ValueError, match="stride"):
        perplexity(engines("kv_cache"), [1, 2, 3], context=4, stride=8)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(engines("kv_cache"), [1], context=4)


def test_cli(tiny_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text())
    out = tmp_path / "ppl.json"
    rc = main(["perplexity", "--model", str(tiny_dir), "--text", str(text), "--device", "cpu", "--stage", "kv_cache",
               "--context", "64", "--stride", "32", "--max-tokens", "150", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "perplexity" in printed and "over 149 scored tokens of 150" in printed
    assert "context 64, stride 32" in printed and "stage kv_cache" in printed
    import json

    record = json.loads(out.read_text())
    assert record["tokens"] == 149 and record["settings"]["text"] == "text.txt" and record["ppl"] > 1
