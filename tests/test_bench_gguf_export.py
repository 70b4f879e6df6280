"""The GGUF export (engine_lib/bench/gguf_export.py), read back with the gguf package's own reader: every
tensor at its shape and type, 16-bit values exact, Q8_0 and Q4_0 within one rounding step of
their block, the metadata llama.cpp needs; the K-quant blocks of engine_lib/bench/kquants.py (Q4_K,
Q6_K) decoded by the package within half a step of their sub-block, and a Q4_K_M file's mix of
them; and llama.cpp's logits on the file against the engine's on the same (dequantized) weights,
where node-llama-cpp is installed."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (requirements-lock.txt pins it)")

from engine_lib.bench.gguf_export import encode_tensor, ensure_gguf, fingerprint, gguf_names, tensor_qtype  # noqa: E402
from engine_lib.bench.kquants import ENCODERS  # noqa: E402
from engine_lib.bench.llamacpp import LlamaCppProcess, unavailable_reason  # noqa: E402
from engine_lib.bench.reference import margin_check  # noqa: E402
from engine_lib.model.checkpoints import preset_config, write_checkpoint  # noqa: E402
from engine_lib.model.config import Qwen2Config  # noqa: E402
from engine_lib.model.loader import _open, weight_files  # noqa: E402

TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
T = gguf.GGMLQuantizationType
# llama.cpp's use_more_bits(i, n) (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2), worked out by hand:
# the layers whose attn_v and ffn_down a Q4_K_M file keeps at Q6_K
MORE_BITS = {4: {2, 3}, 8: {0, 3, 6, 7}}
K_VOCAB = 1024  # the 256-wide checkpoint's vocabulary: the first tokens of Qwen2's


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


def read_checkpoint(model_dir) -> dict:
    """A checkpoint's tensors, float32, by GGUF name."""
    names = gguf_names(Qwen2Config.from_json(model_dir))
    out = {}
    for path in set(weight_files(model_dir).values()):
        with _open(path) as f:
            out.update({names[k]: f.get_tensor(k).float().numpy() for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def checkpoint(tiny_dir):
    """The tiny checkpoint's tensors, float32, by GGUF name."""
    return read_checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def k_dir(tmp_path_factory):
    """An 8-layer checkpoint 256 wide (tiny's rows, 128 and 384 weights, do not split into K-quant super-
    blocks) with MLP width ``intermediate``, made on first use. Its tokenizer keeps the first ``K_VOCAB``
    tokens of Qwen2's (and the merges among them), so its GGUF file is written and read in well under a second."""
    root, made = tmp_path_factory.mktemp("kquant"), {}

    def get(intermediate: int):
        if intermediate not in made:
            cfg = dataclasses.replace(preset_config("tiny"), hidden_size=256, intermediate_size=intermediate,
                                      num_hidden_layers=8, vocab_size=K_VOCAB, bos_token_id=None, eos_token_id=None)
            out = write_checkpoint(root / f"ffn{intermediate}", cfg)
            raw = json.loads((out / "tokenizer.json").read_text())
            vocab = {t: i for t, i in raw["model"]["vocab"].items() if i < K_VOCAB}
            raw["model"]["vocab"], raw["added_tokens"] = vocab, []
            raw["model"]["merges"] = [m for m in raw["model"]["merges"] if {m[0], m[1], m[0] + m[1]} <= vocab.keys()]
            (out / "tokenizer.json").write_text(json.dumps(raw))
            made[intermediate] = out
        return made[intermediate]

    return get


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def values(t) -> np.ndarray:
    """A GGUF tensor as float32 at the checkpoint's shape (rows, cols)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def n_layers(checkpoint: dict) -> int:
    return 1 + max(int(n.split(".")[1]) for n in checkpoint if n.startswith("blk."))


def expected_type(kind: str, name: str, shape: tuple, layers: int):
    """The GGML type a ``kind`` file holds ``name`` (of ``shape``) in. In Q4_K_M, as llama.cpp's quantize
    tool writes it: Q6_K for the embedding (the tied head) and for attn_v and ffn_down in ``MORE_BITS``,
    Q4_K for the other matrices, Q8_0 for a matrix whose rows do not split into 256-weight super-blocks."""
    if len(shape) == 1:
        return T.F32
    if kind != "Q4_K_M":
        return T[kind]
    if shape[-1] % 256:
        return T.Q8_0
    blk = name.split(".")
    six = name == "token_embd.weight" or (blk[2] in ("attn_v", "ffn_down") and int(blk[1]) in MORE_BITS[layers])
    return T.Q6_K if six else T.Q4_K


def error_bound(qtype, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The most a weight of ``ref`` (rows, cols) may be off at ``qtype``, and the bound nearly all keep, both
    at ref's shape, each with room for the fp16 super-block scales' rounding (``slack``, and fp16's
    smallest step ``ulp``: a scale below 6e-5 is subnormal, as Q6_K's d of a weight matrix often is).

    Q4_K: a sub-block of 32 spans [min(lo, 0), hi]. Its offset is rounded outward to a multiple of
    dmin = max(-min(lo, 0)) / 63, its step (hi - min(lo, 0)) / 15 grows by that rounding's dmin / 15 at
    most and is rounded up to a multiple of d = max(step) / 63 (its 6-bit scale): no weight falls outside
    its range, so each is off by at most half that step. Q6_K: a sub-block of 16 has step max|w| / 32
    (the extreme maps to -32), rounded up to a multiple of d = max(step) / 127 (its 8-bit scale): half a
    step, or a whole one where a weight of the other sign reaches +32 (the codes end at +31). Q8_0: half
    of max|w| / 127 over its block of 32, plus the fp16 scale's rounding times the largest code (its codes
    are found with the unrounded scale; the K-quants' with the rounded one)."""
    slack, ulp = 1 + 2**-8, 2.0**-24
    if qtype == T.Q8_0:
        x = ref.reshape(-1, 1, 32)
        worst = typical = 0.5 * np.abs(x).max(-1, keepdims=True) / 127 * (1 + 127 * 2**-10)
    elif qtype == T.Q4_K:
        x = ref.reshape(-1, 8, 32)
        lo = np.minimum(x.min(-1, keepdims=True), 0)
        dmin = -lo.min(-2, keepdims=True) / 63 * slack + ulp
        s = (x.max(-1, keepdims=True) - lo + dmin) / 15
        worst = typical = 0.5 * (s + s.max(-2, keepdims=True) / 63 * slack + ulp)
    else:
        assert qtype == T.Q6_K, qtype
        x = ref.reshape(-1, 16, 16)
        s = np.abs(x).max(-1, keepdims=True) / 32
        d = s.max(-2, keepdims=True) / 127
        typical = 0.5 * (s + d * slack + ulp)
        worst = 2 * typical
    tiny = 1e-6 * np.abs(x).max(axis=(-2, -1), keepdims=True)  # float32 arithmetic
    return [np.broadcast_to(b + tiny, x.shape).reshape(ref.shape) for b in (worst, typical)]


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
        assert t.tensor_type == expected_type(kind, name, ref.shape, n_layers(checkpoint)), name
    assert files(kind)["tensor_bytes"] == sum(int(t.n_bytes) for t in got.values())


def encoded(kind: str, checkpoint: dict) -> dict:
    """Every tensor through the writer's encoder, decoded again, without a file: name -> (type, values)."""
    layers, out = n_layers(checkpoint), {}
    for name, ref in checkpoint.items():
        data, t = encode_tensor(torch.from_numpy(ref), tensor_qtype(kind, name, layers))
        assert t == expected_type(kind, name, ref.shape, layers), name
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


def awkward_rows(seed: int = 0) -> np.ndarray:
    """(8, 512) float32, two super-blocks a row: weight-like normal rows, and super-blocks that are constant
    (positive: Q4_K's min clamps to 0; negative: its offset alone holds it), zero, all positive, with one
    outlier of either sign, 1e-4 as large (scales far into fp16's subnormals), or one sub-block 100x louder."""
    x = np.random.default_rng(seed).standard_normal((8, 512)).astype(np.float32) * 0.02
    x[1, :256], x[1, 256:], x[2, :256] = 0.375, -0.0625, 0.0
    x[3, 100], x[4, 300] = 3.0, -3.0
    x[5, :256] = np.abs(x[5, :256])
    x[6] *= 1e-4
    x[7, :32] *= 100
    return x


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_decode_within_half_a_step(kind):
    """Encoded here, decoded by the gguf package: each weight within half a step of its sub-block (the
    step rounded up to a multiple of the super-block's scale; ``error_bound``), constant super-blocks to
    the fp16 scale's rounding, zeros exactly. A wrong bit layout moves weights by order 1 of their range."""
    x = awkward_rows()
    data = ENCODERS[kind](x)
    back = gguf.quants.dequantize(data, T[kind])
    assert back.shape == x.shape
    err = np.abs(back - x)
    worst, typical = error_bound(T[kind], x)
    assert (err <= worst).all(), (kind, np.unravel_index(np.argmax(err - worst), err.shape))
    assert (err <= typical).mean() > 0.99, kind
    assert err.max() > 0, kind  # really quantized
    np.testing.assert_allclose(back[1], x[1], rtol=2**-8, err_msg="constant super-blocks")
    assert (back[2, :256] == 0).all()


def test_k_quant_blocks_are_ggmls_size():
    """144 bytes a super-block for Q4_K, 210 for Q6_K, as ggml (and the package's table) has them; a row
    that does not split into super-blocks is refused, not padded."""
    x = awkward_rows()
    assert gguf.GGML_QUANT_SIZES[T.Q4_K] == (256, 144) and gguf.GGML_QUANT_SIZES[T.Q6_K] == (256, 210)
    for kind, size in (("Q4_K", 144), ("Q6_K", 210)):
        data = ENCODERS[kind](x)
        assert data.dtype == np.uint8 and data.shape == (8, 2 * size), kind
        np.testing.assert_array_equal(ENCODERS[kind](x[:, 256:]), data[:, size:], err_msg=kind)  # blocks alone
        with pytest.raises(ValueError, match="multiple of 256"):
            ENCODERS[kind](x[:, :384])


@pytest.mark.parametrize("intermediate", [512, 384])
def test_a_q4_k_m_file_mixes_types_as_llama_cpp_does(k_dir, intermediate):
    """8 layers, 256 wide: Q6_K for the tied embedding and for attn_v and ffn_down of layers 0, 3, 6, 7,
    Q4_K for the other matrices, float32 vectors; with an MLP 384 wide, ffn_down's rows (384 weights) do
    not split into super-blocks and fall back to Q8_0. Every value within its type's bound."""
    model_dir = k_dir(intermediate)
    info = ensure_gguf(model_dir, "Q4_K_M", out_dir=model_dir.parent / "gguf")
    reader = gguf.GGUFReader(info["path"])
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    ref, got = read_checkpoint(model_dir), tensors(reader)
    assert set(got) == set(ref)
    types = {name: t.tensor_type for name, t in got.items()}
    assert types == {name: expected_type("Q4_K_M", name, r.shape, 8) for name, r in ref.items()}
    mlp = ("ffn_down",) if intermediate % 256 == 0 else ()
    assert sorted(n for n, t in types.items() if t == T.Q6_K) == sorted(
        ["token_embd.weight"] + [f"blk.{i}.{m}.weight" for i in (0, 3, 6, 7) for m in ("attn_v", *mlp)])
    assert [n for n, t in types.items() if t == T.Q8_0] == \
        ([] if mlp else [f"blk.{i}.ffn_down.weight" for i in range(8)])
    assert sum(t == T.Q4_K for t in types.values()) > 40
    for name, t in got.items():
        err = np.abs(values(t).reshape(ref[name].shape) - ref[name])
        assert (err <= (0 if t.tensor_type == T.F32 else error_bound(t.tensor_type, ref[name])[0])).all(), name
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in got.values())


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
def dequantized_checkpoint(kind: str, model_dir, out):
    """The file's weights (encoded as the writer encodes them, decoded to float32) as a Hugging Face-
    layout checkpoint, so the engine runs exactly the numbers llama.cpp runs and only the arithmetic
    differs."""
    from safetensors.torch import save_file

    back = {g: h for h, g in gguf_names(Qwen2Config.from_json(model_dir)).items()}
    out.mkdir()
    save_file({back[n]: torch.from_numpy(v.copy()) for n, (_, v) in encoded(kind, read_checkpoint(model_dir)).items()},
              str(out / "model.safetensors"))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


# llama.cpp's CPU matmuls round the activations before the dot products: to fp16 for F16 weights (to
# bf16, 8 bits of mantissa, for BF16), to Q8_0 blocks for the quantized types (to Q8_K, 256 a block, for
# the K-quants); the engine here runs the same weights in float32. The bound is on max |d log-probability|
# over the tokens the engine gives p > 1e-9, over the logits' standard deviation (0.23 on the tiny
# checkpoint, 0.33 on the 256-wide one). Measured there (1 thread, 3 prompts, 16 positions): F16 0.0069,
# BF16 0.036, Q8_0 0.11, Q4_0 0.12, Q4_K_M 0.12, in step with each rounding (F16 : BF16 : Q8_0 about
# 1 : 8 : 16). A wrong layout is off by order 1: against the original (unquantized) weights, the Q4_0 file
# is 2.0 off and the Q4_K_M one 1.5.
LOGPROB_TOLERANCE = {"F16": 0.02, "BF16": 0.08, "Q8_0": 0.25, "Q4_0": 0.25, "Q4_K_M": 0.25}


@pytest.mark.parametrize("kind", TYPES)
def test_llama_cpp_matches_the_engine_on_the_converted_file(files, k_dir, tiny_dir, prompts, tmp_path, kind):
    """llama.cpp (node-llama-cpp) gives next-token probabilities, not logits: compared as log-probabilities
    (logits less their log-sum-exp), through its decode path (one token per evaluation, every position
    of 16-token prompts) and its prefill path (each seed prompt in one batch, the last position). Q4_K_M
    on the 256-wide checkpoint (its prompts' ids taken modulo its vocabulary), so that llama.cpp decodes
    our Q4_K and Q6_K blocks: tiny's rows would make every matrix the Q8_0 fallback."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp peer unavailable: {reason}")
    from engine_lib import Engine

    if kind == "Q4_K_M":
        model_dir = k_dir(512)
        path = ensure_gguf(model_dir, kind, out_dir=model_dir.parent / "gguf")["path"]
        prompts = [[i % K_VOCAB for i in ids] for ids in prompts]
    else:
        model_dir, path = tiny_dir, files(kind)["path"]
    engine = Engine.from_pretrained(dequantized_checkpoint(kind, model_dir, tmp_path / "deq"), device="cpu",
                                    dtype=torch.float32, stage="kv_cache")
    vocab = engine.config.vocab_size
    worst, scale, ours, theirs = {"decode": 0.0, "prefill": 0.0}, [], [], []
    with LlamaCppProcess(path, threads=1, n_ctx=256) as llama:  # values, not speed
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
    rel = {p: w / min(scale) for p, w in worst.items()}
    assert max(rel.values()) < LOGPROB_TOLERANCE[kind], f"{kind}: max |d logprob| / std(logits) {rel}"
    top1 = margin_check(theirs, ours)
    assert top1.ok, f"{kind}: {top1}"  # every prompt whose top-1 is decided agrees
