"""The loader reads HF-layout safetensors and fails clearly on every kind of bad checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_lib.errors import ModelNotFoundError, WeightLoadError
from engine_lib.model.loader import load_model, resolve_model_dir
from engine_lib.model.qwen2 import ModelOptions


def copy_ckpt(src, dst, tensors=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


def test_loads_casts_and_ties(tiny_dir):
    model = load_model(tiny_dir, torch.float16, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float16 and p.device.type == "cpu" for p in model.parameters())
    sd = load_file(str(tiny_dir / "model.safetensors"))
    assert "lm_head.weight" not in sd  # tied, like the real checkpoint
    torch.testing.assert_close(model.model.norm.weight, sd["model.norm.weight"].half())


def test_sharded_checkpoint_with_index(tiny_dir, tmp_path):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    dst = copy_ckpt(tiny_dir, tmp_path / "sharded")
    (dst / "model.safetensors").unlink()
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = load(tiny_dir), load(dst)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=0)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors.*missing"):
        load(dst)


def test_missing_tensor_names_it(tiny_dir, tmp_path):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load(copy_ckpt(tiny_dir, tmp_path / "m", sd))


def test_unexpected_tensor_names_it(tiny_dir, tmp_path):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    with pytest.raises(WeightLoadError, match="unexpected tensors in model.safetensors.*rotary_emb.inv_freq"):
        load(copy_ckpt(tiny_dir, tmp_path / "u", sd))


def test_misshapen_tensor_names_file_tensor_and_shapes(tiny_dir, tmp_path):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(WeightLoadError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' "
                                              r"has shape \(3, 128\), expected \(64, 128\)"):
        load(copy_ckpt(tiny_dir, tmp_path / "s", sd))


def test_truncated_file(tiny_dir, tmp_path):
    dst = copy_ckpt(tiny_dir, tmp_path / "t")
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load(dst)


def test_a_tensor_cut_short_is_named_when_read_straight_from_the_file(tiny_dir, tmp_path):
    """A header that promises more bytes than the file holds: the direct read (``take_into``) names the tensor,
    where the file's mapping would fault."""
    from engine_lib.model.loader import TensorReader, weight_files

    files = weight_files(tiny_dir)
    name = "model.norm.weight"
    reader = TensorReader(files, [name])
    path, dtype, shape, start, _ = reader.span(name)
    assert dtype == torch.bfloat16  # the tiny checkpoint is stored as the model runs: the direct path
    out = torch.empty(shape, dtype=dtype)
    reader.take_into(name, shape, out)
    torch.testing.assert_close(out, load_file(str(path))[name], rtol=0, atol=0)
    short = tmp_path / "short.safetensors"
    short.write_bytes(path.read_bytes()[:start + 2])  # the header whole, the tensor cut after one value
    reader = TensorReader({name: short}, [name])
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        reader.take_into(name, shape, torch.empty(shape, dtype=dtype))


def test_corrupt_header(tiny_dir, tmp_path):
    dst = copy_ckpt(tiny_dir, tmp_path / "c")
    (dst / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage-header!")
    with pytest.raises(WeightLoadError, match="model.safetensors: corrupt or truncated"):
        load(dst)


def test_missing_weights_and_pickles_are_refused(tiny_dir, tmp_path):
    dst = copy_ckpt(tiny_dir, tmp_path / "p")
    (dst / "model.safetensors").unlink()
    (dst / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightLoadError, match="pickle files are never loaded"):
        load(dst)


def test_model_not_found_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set and the model is not in the local cache"):
        resolve_model_dir("Qwen/Qwen2.5-1.5B-Instruct")
    with pytest.raises(ModelNotFoundError, match="no checkpoint folder"):
        resolve_model_dir(str(tmp_path / "nope"))


def fused(path):
    return load_model(path, torch.float32, torch.device("cpu"), ModelOptions(sdpa=True, fused=True))


def test_packed_projections_are_concatenated_while_loading(tiny_dir):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    model = fused(tiny_dir)
    attn, mlp = model.model.layers[2].self_attn, model.model.layers[2].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "gate_proj")  # packed when built, not after
    p = "model.layers.2."
    want = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).float()
    torch.testing.assert_close(attn.qkv_proj.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]).float())
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                                   sd[p + "mlp.up_proj.weight"]]).float())
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(ids), load(tiny_dir)(ids), rtol=0, atol=1e-5)


def test_packed_loading_names_the_missing_or_misshapen_part(tiny_dir, tmp_path):
    sd = load_file(str(tiny_dir / "model.safetensors"))
    del sd["model.layers.1.self_attn.v_proj.bias"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias.*missing"):
        fused(copy_ckpt(tiny_dir, tmp_path / "m", sd))
    sd = load_file(str(tiny_dir / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 128, dtype=torch.bfloat16)
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(7, 128\), "
                                              r"expected \(384, 128\)"):
        fused(copy_ckpt(tiny_dir, tmp_path / "s", sd))
