"""The GGUF export (engine_lib/bench/gguf_export.py), read back with the gguf package's own reader: every
tensor at its shape and type, 16-bit values exact, Q8_0 and Q4_0 within one rounding step of
their block, the metadata llama.cpp needs; and llama.cpp's logits on the file against the engine's
on the same (dequantized) weights, where node-llama-cpp is installed."""

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (requirements-lock.txt pins it)")

from engine_lib.bench.gguf_export import ensure_gguf, fingerprint, gguf_names  # noqa: E402
from engine_lib.bench.llamacpp import LlamaCppProcess, unavailable_reason  # noqa: E402
from engine_lib.bench.reference import margin_check  # noqa: E402
from engine_lib.model.config import Qwen2Config  # noqa: E402
from engine_lib.model.loader import _open, weight_files  # noqa: E402

TYPES = ("F16", "BF16", "Q8_0", "Q4_0")
T = gguf.GGMLQuantizationType


# written and read back whole: the reader parses the 151,936-token vocabulary for ~15 s per file; BF16
# and Q4_0 go through the same writer, checked through its encoder (and, where llama.cpp is installed,
# as files that it runs)
READ = ("F16", "Q8_0")


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """Each width's file, converted on first use (the vocabulary makes each about 5 s)."""
    out, made = tmp_path_factory.mktemp("gguf"), {}

    def get(kind: str) -> dict:
        if kind not in made:
            made[kind] = ensure_gguf(tiny_dir, kind, out_dir=out)
        return made[kind]

    return get


@pytest.fixture(scope="module")
def readers(files):
    return {t: gguf.GGUFReader(files(t)["path"]) for t in READ}


@pytest.fixture(scope="module")
def checkpoint(tiny_dir):
    """The tiny checkpoint's tensors, float32, by GGUF name."""
    names = gguf_names(Qwen2Config.from_json(tiny_dir))
    out = {}
    for path in set(weight_files(tiny_dir).values()):
        with _open(path) as f:
            out.update({names[k]: f.get_tensor(k).float().numpy() for k in f.keys()})
    return out


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def values(t) -> np.ndarray:
    """A GGUF tensor as float32 at the checkpoint's shape (rows, cols)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def test_names_cover_every_checkpoint_tensor(tiny_dir):
    names = gguf_names(Qwen2Config.from_json(tiny_dir))
    assert set(names) == set(weight_files(tiny_dir))  # nothing left behind, nothing made up
    assert len(set(names.values())) == len(names)
    assert "output.weight" not in names.values()  # tied: llama.cpp reuses token_embd as the head


@pytest.mark.parametrize("kind", READ)
def test_every_tensor_is_present_at_its_shape_and_type(files, readers, checkpoint, kind):
    got = tensors(readers[kind])
    assert set(got) == set(checkpoint)
    for name, t in got.items():
        ref = checkpoint[name]
        assert tuple(int(n) for n in reversed(t.shape)) == ref.shape, name  # GGUF lists dims innermost first
        assert t.tensor_type == (T.F32 if ref.ndim == 1 else T[kind]), name
    assert files(kind)["tensor_bytes"] == sum(int(t.n_bytes) for t in got.values())


def encoded(kind: str, checkpoint: dict) -> dict:
    """Every tensor through the writer's encoder, decoded again, without a file: name -> (type, values)."""
    from engine_lib.bench.gguf_export import encode_tensor

    out = {}
    for name, ref in checkpoint.items():
        data, t = encode_tensor(torch.from_numpy(ref), T[kind])
        assert t == (T.F32 if ref.ndim == 1 else T[kind]), name
        out[name] = (t, gguf.quants.dequantize(data, t).astype(np.float32).reshape(ref.shape))
    return out


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_16_bit_values_are_the_checkpoints(readers, checkpoint, kind):
    """The tiny checkpoint is bf16: F16 holds its values to fp16 rounding, BF16 exactly."""
    got = {n: values(t) for n, t in tensors(readers[kind]).items()} if kind in READ else \
        {n: v for n, (_, v) in encoded(kind, checkpoint).items()}
    for name, ref in checkpoint.items():
        want = ref if ref.ndim == 1 or kind == "BF16" else ref.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("kind, levels", [("Q8_0", 127), ("Q4_0", 8)])
def test_quantized_values_are_within_one_step_of_their_block(readers, checkpoint, kind, levels):
    """A block of 32 weights shares one fp16 scale d = max|w| / levels: each weight is off by at most
    half a step (Q4_0's 16 levels are -8..7, so the block's opposite extreme can be off by a whole
    step), plus the scale's own fp16 rounding; and the error is really there (the file is quantized)."""
    slack = 1 + levels * 2**-10  # the fp16 scale, rounded, times the largest integer
    got = {n: values(t) for n, t in tensors(readers[kind]).items()} if kind in READ else \
        {n: v for n, (_, v) in encoded(kind, checkpoint).items()}
    for name, ref in checkpoint.items():
        if ref.ndim == 1:
            continue
        err = np.abs(got[name] - ref).reshape(ref.shape[0], -1, 32)  # (rows, blocks, 32)
        step = np.abs(ref).reshape(err.shape).max(-1, keepdims=True) / levels
        bound = (0.5 if kind == "Q8_0" else 1.0) * step * slack + 1e-12
        assert (err <= bound).all(), (name, float((err - bound).max()))
        assert (err <= 0.5 * step * slack + 1e-12).mean() > 0.99, name  # nearly all: within half a step
        assert err.max() > 0, name


def test_metadata_llama_cpp_needs(readers, tiny_dir):
    cfg = Qwen2Config.from_json(tiny_dir)
    reader = readers["Q8_0"]
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "qwen2"
    expected = {"qwen2.context_length": cfg.max_position_embeddings, "qwen2.embedding_length": cfg.hidden_size,
                "qwen2.block_count": cfg.num_hidden_layers, "qwen2.feed_forward_length": cfg.intermediate_size,
                "qwen2.attention.head_count": cfg.num_attention_heads,
                "qwen2.attention.head_count_kv": cfg.num_key_value_heads,
                "qwen2.attention.key_length": cfg.head_dim, "qwen2.attention.value_length": cfg.head_dim}
    assert {k: meta[k] for k in expected} == expected
    assert meta["qwen2.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert meta["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == cfg.vocab_size  # padded to the embedding's rows
    raw = json.loads((tiny_dir / "tokenizer.json").read_text())
    for text, i in list(raw["model"]["vocab"].items())[:2000]:
        assert tokens[i] == text and types[i] == gguf.TokenType.NORMAL
    assert tokens[151645] == "<|im_end|>" and types[151645] == gguf.TokenType.CONTROL
    assert types[-1] == gguf.TokenType.UNUSED
    assert len(meta["tokenizer.ggml.merges"]) == len(raw["model"]["merges"])
    assert meta["tokenizer.ggml.eos_token_id"] == 151645
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_the_cached_file_is_reused_and_keyed_on_the_checkpoint(files, tiny_dir, tmp_path):
    first = files("Q8_0")
    again = ensure_gguf(tiny_dir, "Q8_0", out_dir=first["path"].rsplit("/", 1)[0])
    assert again["convert_s"] == 0.0 and again["made_s"] == first["made_s"] > 0
    copy = tmp_path / "ckpt"
    copy.mkdir()
    shutil.copy(tiny_dir / "config.json", copy / "config.json")
    (copy / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    before = fingerprint(copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["rope_theta"] = 10000.0
    (copy / "config.json").write_text(json.dumps(raw))
    assert fingerprint(copy) != before  # a changed checkpoint is converted again


# ------------------------------------------------------------------------- llama.cpp on the file
def dequantized_checkpoint(kind: str, checkpoint: dict, tiny_dir, out):
    """The file's weights (encoded as the writer encodes them, decoded to float32) as a Hugging Face-
    layout checkpoint, so the engine runs exactly the numbers llama.cpp runs and only the arithmetic
    differs."""
    from safetensors.torch import save_file

    back = {g: h for h, g in gguf_names(Qwen2Config.from_json(tiny_dir)).items()}
    out.mkdir()
    save_file({back[n]: torch.from_numpy(v.copy()) for n, (_, v) in encoded(kind, checkpoint).items()},
              str(out / "model.safetensors"))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    return out


# llama.cpp's CPU matmuls round the activations before the dot products: to fp16 for F16 weights (to
# bf16, 8 bits of mantissa, for BF16), to Q8_0 blocks for the quantized types; the engine here runs the
# same weights in float32. The bound is on max |d log-probability| over the tokens the engine gives
# p > 1e-9, over the logits' standard deviation (0.23 on the tiny checkpoint). Measured there (1 thread,
# 3 prompts, 16 positions): F16 0.0069, BF16 0.036, Q8_0 0.11, Q4_0 0.12, in step with each rounding
# (F16 : BF16 : Q8_0 about 1 : 8 : 16). A wrong layout is off by order 1: the Q4_0 file against the
# original (unquantized) weights is 2.0.
LOGPROB_TOLERANCE = {"F16": 0.02, "BF16": 0.08, "Q8_0": 0.25, "Q4_0": 0.25}


@pytest.mark.parametrize("kind", TYPES)
def test_llama_cpp_matches_the_engine_on_the_converted_file(files, checkpoint, tiny_dir, prompts, tmp_path, kind):
    """llama.cpp (node-llama-cpp) gives next-token probabilities, not logits: compared as log-probabilities
    (logits less their log-sum-exp), through its decode path (one token per evaluation, every position
    of 16-token prompts) and its prefill path (each seed prompt in one batch, the last position)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp peer unavailable: {reason}")
    from engine_lib import Engine

    engine = Engine.from_pretrained(dequantized_checkpoint(kind, checkpoint, tiny_dir, tmp_path / "deq"), device="cpu",
                                    dtype=torch.float32, stage="kv_cache")
    vocab = engine.config.vocab_size
    worst, scale, ours, theirs = {"decode": 0.0, "prefill": 0.0}, [], [], []
    with LlamaCppProcess(files(kind)["path"], threads=1, n_ctx=256) as llama:  # values, not speed
        for i, ids in enumerate(prompts):
            logits = engine.logits(ids).double()  # (seq, vocab)
            scale.append(float(logits.std()))
            ref = torch.log_softmax(logits, -1).numpy()
            keep = ref > np.log(1e-9)  # the tokens that carry the mass; float32 underflows far below
            if i < 2:
                got = llama.logprobs(ids[:16], vocab, steps=True)  # (16, vocab)
                worst["decode"] = max(worst["decode"], float(np.abs(got - ref[:16])[keep[:16]].max()))
            last = llama.logprobs(ids, vocab, steps=False)[0]  # (vocab,)
            worst["prefill"] = max(worst["prefill"], float(np.abs(last - ref[-1])[keep[-1]].max()))
            ours.append(torch.from_numpy(ref[-1]))
            theirs.append(torch.from_numpy(last.astype(np.float64)))
    rel = {path: w / min(scale) for path, w in worst.items()}
    assert max(rel.values()) < LOGPROB_TOLERANCE[kind], f"{kind}: max |d logprob| / std(logits) {rel}"
    top1 = margin_check(theirs, ours)
    assert top1.ok, f"{kind}: {top1}"  # every prompt whose top-1 is decided agrees
