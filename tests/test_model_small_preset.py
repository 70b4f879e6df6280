"""The trained preset ``qwen2-stdlib-small``: it loads in the engine, matches transformers on its
weights, has learned something of its corpus (held-out perplexity below a unigram model's), and the
script that trained it runs end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_lib import Engine, book
from engine_lib.bench.reference import load_hf_model
from engine_lib.model.checkpoints import (
    HELDOUT_MANIFEST,
    HELDOUT_TEXT,
    STDLIB_SMALL,
    STDLIB_SMALL_DIR,
    checkpoint_label,
    ensure_checkpoint,
    is_random_checkpoint,
    preset_config,
)
from engine_lib.model.loader import load_model
from engine_lib.model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "book" / "results" / "small-model.train.json"
SLICE_TOKENS = 2048  # the training record's held-out slice (--curve-eval-tokens)
FACTOR = 5.0  # held-out perplexity x FACTOR < the unigram model's (measured: 7.35 on all 47,151 held-out tokens, 5,680 steps)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return ensure_checkpoint(STDLIB_SMALL, root=tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def heldout_slice():
    text = HELDOUT_TEXT.read_text(encoding="utf-8")[:20_000]
    ids = load_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= SLICE_TOKENS
    return torch.tensor(ids[:SLICE_TOKENS])


def test_preset_is_a_labelled_trained_checkpoint(small_dir):
    assert sorted(p.name for p in small_dir.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]
    assert not is_random_checkpoint(small_dir)
    cfg = preset_config(STDLIB_SMALL)
    label = checkpoint_label(small_dir)
    assert "Python standard library" in label and f"{cfg.num_parameters():,} parameters" in label
    assert "not the real" in label
    assert (STDLIB_SMALL_DIR / "model.safetensors").stat().st_size < 21e6  # committed once: about 20 MB at most
    assert ensure_checkpoint(STDLIB_SMALL, root=small_dir.parent) == small_dir  # reused
    assert book.ModelChoice(small_dir, small_dir.name, False, "cpu").title.endswith("trained on the Python stdlib")
    assert "Python standard library" in Engine.from_pretrained(small_dir, device="cpu", stage="naive").label
    with pytest.raises(ValueError, match="trained checkpoint"):
        ensure_checkpoint(STDLIB_SMALL, layers=2)


def test_engine_matches_transformers(small_dir, heldout_slice):
    ids = heldout_slice[None, :96]
    ours = load_model(small_dir, torch.float32, torch.device("cpu"))(ids)
    with torch.no_grad():
        ref = load_hf_model(small_dir, torch.float32)(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_heldout_perplexity_below_unigram(small_dir, heldout_slice):
    """The first 2,048 held-out tokens, in windows of 128 as the training script scores them: the
    checkpoint reproduces the record's perplexity there, which is below the unigram model's (the
    training split's token frequencies, add-one smoothed) by at least FACTOR."""
    record = json.loads(RECORD.read_text())
    model = load_model(small_dir, torch.float32, torch.device("cpu"))
    ids = heldout_slice[:SLICE_TOKENS]
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(ids) - 1, 128):
            window = ids[a:a + 129]
            logits = model(window[None, :-1])[0].float()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += len(window) - 1
    ppl = math.exp(total / count)
    assert count == record["heldout_slice_evals"]["tokens"] - 1
    assert ppl == pytest.approx(record["bf16_rounding"]["bf16_ppl"], rel=1e-2)
    unigram = record["heldout_slice_evals"]["evals"][0]["unigram_ppl"]
    assert ppl * FACTOR < unigram, (ppl, unigram)
    summary = record["summary"]
    assert summary["heldout_ppl"] * FACTOR < summary["unigram_ppl"]
    assert summary["wall_seconds"] <= 15 * 60


def test_heldout_split_is_vendored_and_listed():
    manifest = json.loads(HELDOUT_MANIFEST.read_text())
    text = HELDOUT_TEXT.read_text(encoding="utf-8")
    assert 100_000 < len(text.encode()) < 300_000
    assert text.count(manifest["separator"]) == len(manifest["files"]) - 1
    record = json.loads(RECORD.read_text())["corpus"]
    assert record["heldout_files"] == [f["path"] for f in manifest["files"]]
    assert not {f["path"] for f in record["train"]} & set(record["heldout_files"])


def test_int4_takes_group_64_on_the_small_preset(small_dir):
    from engine_lib.model.qwen2 import ModelOptions
    from engine_lib.quant.linear import quantized_linears

    model = load_model(small_dir, torch.bfloat16, torch.device("cpu"), ModelOptions(quant="int4"))
    sizes = {name.rsplit(".", 1)[-1]: m.group_size for name, m in quantized_linears(model).items()}
    assert sizes["q_proj"] == 64 and sizes["down_proj"] == 128  # in_features 64 and 256


def test_training_script_runs_end_to_end(tmp_path):
    out, record = tmp_path / "ckpt", tmp_path / "train.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "scripts" / "train_small_model.py"), "--out", str(out), "--record", str(record),
           "--steps", "3", "--max-seconds", "60", "--batch", "2", "--seq-len", "32", "--max-corpus-bytes", "100000",
           "--eval-tokens", "300", "--curve-evals", "1", "--curve-eval-tokens", "100", "--log-every", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    rec = json.loads(record.read_text())
    assert rec["summary"]["steps"] == 3 and rec["summary"]["tokens_seen"] == 3 * 2 * 32
    assert [c["step"] for c in rec["loss_curve"]] == [1, 2, 3] and record.with_suffix(".png").is_file()
    assert rec["final_eval"]["heldout_tokens"] == 299
    model = load_model(out, torch.float32, torch.device("cpu"))
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 151936)


def test_compact_vocabulary_loss_is_the_full_models_cross_entropy():
    """Training on the used tokens only (``TrainingVocab``) minimises exactly what the exported
    full-vocabulary model (zero rows for the unused tokens) scores."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_small_model import EOS, TrainingVocab
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    vocab_size = EOS + 10
    torch.manual_seed(0)
    train_ids = torch.tensor([5, 9, 9, 17, 300, 5, 42, EOS, 17, 9])
    vocab = TrainingVocab(train_ids, vocab_size)
    assert vocab.ids.tolist() == [5, 9, 17, 42, 300, EOS]
    kw = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    compact = Qwen2ForCausalLM(HFConfig(vocab_size=len(vocab.ids), **kw)).eval()
    full = vocab.expand(compact, Qwen2ForCausalLM(HFConfig(vocab_size=vocab_size, **kw)).eval())
    x = train_ids[None]
    with torch.no_grad():
        ours = vocab.loss(compact(vocab.to_compact[x][:, :-1]).logits[0], vocab.to_compact[x][0, 1:])
        logits = full(x[:, :-1]).logits[0]
        ref = F.cross_entropy(logits, x[0, 1:])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    unused = torch.ones(vocab_size, dtype=torch.bool)
    unused[vocab.ids] = False
    assert logits[:, unused].abs().max() == 0  # zero rows: logit exactly 0


def test_checkpoint_rows_outside_the_training_vocabulary_are_zero():
    from safetensors.torch import load_file

    emb = load_file(str(STDLIB_SMALL_DIR / "model.safetensors"))["model.embed_tokens.weight"]
    used = json.loads(RECORD.read_text())["training"]["training_vocab"]["tokens_in_use"]
    assert int((emb != 0).any(dim=1).sum()) == used
