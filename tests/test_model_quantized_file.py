"""The quantized model saved beside the checkpoint (engine_lib/model/quantized_file.py): written on the first
start, read back on the next with the same logits and kernels, and never used when it is stale or corrupt."""

import shutil
import sys
import warnings

import pytest
import torch

from engine_lib.model import loader, quantized_file
from engine_lib.model.loader import load_model
from engine_lib.model.paths import derived_dir
from engine_lib.quant.embedding import QuantEmbedding
from engine_lib.quant.linear import quantized_linears
from engine_lib.stages import get_stage

CPU, BF16 = torch.device("cpu"), torch.bfloat16
IDS = torch.tensor([[1, 5, 9, 42, 7, 3]])


@pytest.fixture
def ckpt(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(quantized_file.ENV, "1")
    return shutil.copytree(tiny_dir, tmp_path / "tiny")


def load(path, quant):
    return load_model(path, BF16, CPU, get_stage(quant).model_options(BF16))


def logits(model):
    with torch.inference_mode():
        return model(IDS)


def count_fills(monkeypatch) -> list:
    calls = []
    real = loader.fill

    def fill(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "fill", fill)
    return calls


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_second_start_maps_the_saved_model_with_the_same_logits(ckpt, monkeypatch, quant):
    fills = count_fills(monkeypatch)
    first = load(ckpt, quant)
    path = quantized_file.saved_path(ckpt, quant, BF16)
    assert fills == [1] and path.is_file() and path.parent.name == "tiny.engine_lib"
    second = load(ckpt, quant)
    assert fills == [1]  # the checkpoint was not read again
    torch.testing.assert_close(logits(second), logits(first), rtol=0, atol=0)
    kernels = {n: m.kernel for n, m in quantized_linears(first).items()}
    assert {n: m.kernel for n, m in quantized_linears(second).items()} == kernels
    assert isinstance(second.model.embed_tokens, QuantEmbedding) and second.model.embed_tokens.head is second.lm_head
    meta = quantized_file.read(path, quantized_file.signature(ckpt, [ckpt / "model.safetensors"], quant, BF16))[1]
    assert meta["quant"] == quant and meta["format"] == quantized_file.FORMAT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_later_start_maps_the_file_instead_of_reading_it(ckpt, monkeypatch):
    load(ckpt, "int8")
    path = quantized_file.saved_path(ckpt, "int8", BF16)
    model = load(ckpt, "int8")
    maps = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(str(path))]
    spans = [tuple(int(a, 16) for a in fields[0].split("-")) for fields in maps]
    weights = list(model.parameters())
    assert spans and all(any(a <= w.data_ptr() < b for a, b in spans) for w in weights)
    before = path.read_bytes()
    with torch.no_grad():
        weights[0].view(-1)[0] += 1  # copy on write: this process's page changes, never the file
    assert path.read_bytes() == before


def rebuilt(ckpt, monkeypatch, match: str) -> torch.Tensor:
    """Load int8 expecting the saved file to be refused with a warning matching ``match`` and the model rebuilt."""
    fills = count_fills(monkeypatch)
    with pytest.warns(RuntimeWarning, match=match):
        model = load(ckpt, "int8")
    assert fills == [1]
    with warnings.catch_warnings():  # and the rebuilt file is good again
        warnings.simplefilter("error")
        again = load(ckpt, "int8")
    assert fills == [1]
    torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=0)
    return logits(model)


def test_a_changed_checkpoint_makes_the_file_stale(ckpt, monkeypatch):
    load(ckpt, "int8")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ckpt / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] * 2
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    fresh = rebuilt(ckpt, monkeypatch, "stale: its source differ")
    monkeypatch.setenv(quantized_file.ENV, "0")
    torch.testing.assert_close(fresh, logits(load(ckpt, "int8")), rtol=0, atol=0)  # the new weights, not the old


def test_another_format_version_makes_the_file_stale_and_is_rebuilt_quietly(ckpt, monkeypatch):
    good = logits(load(ckpt, "int8"))
    monkeypatch.setattr(quantized_file, "FORMAT", "engine_lib quantized model 999")
    fills = count_fills(monkeypatch)
    with warnings.catch_warnings():  # an upgrade's older file is expected: no warning in a reader's output
        warnings.simplefilter("error")
        torch.testing.assert_close(logits(load(ckpt, "int8")), good, rtol=0, atol=0)
        assert fills == [1]
        path = quantized_file.saved_path(ckpt, "int8", BF16)
        sig = quantized_file.signature(ckpt, [ckpt / "model.safetensors"], "int8", BF16)
        assert quantized_file.read(path, sig)[1]["format"] == "engine_lib quantized model 999"
        load(ckpt, "int8")
    assert fills == [1]  # the rebuilt file is used


def test_another_format_and_a_changed_checkpoint_still_warn(ckpt, monkeypatch):
    load(ckpt, "int8")
    monkeypatch.setattr(quantized_file, "FORMAT", "engine_lib quantized model 999")
    monkeypatch.setattr(quantized_file, "checkpoint_hash", lambda *a: "another checkpoint")
    rebuilt(ckpt, monkeypatch, "stale: its format, source differ")


@pytest.mark.parametrize("damage, match", [
    ("flip", "does not match its checksum"),
    ("truncate", "corrupt: the header's tensors end"),
    ("header", "corrupt: "),
    ("shift", "not on a 4096-byte page"),
])
def test_a_corrupt_file_is_never_used(ckpt, monkeypatch, damage, match):
    good = logits(load(ckpt, "int8"))
    path = quantized_file.saved_path(ckpt, "int8", BF16)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40  # one bit of one weight
    elif damage == "truncate":
        data = data[:-1000]
    elif damage == "shift":  # a valid header 8 bytes longer: the tensors no longer start on a page
        n = int.from_bytes(data[:8], "little")
        data[:8] = (n + 8).to_bytes(8, "little")
        data[8 + n:8 + n] = b" " * 8
    else:
        data[8:20] = b"not json !!!"
    path.write_bytes(bytes(data))
    torch.testing.assert_close(rebuilt(ckpt, monkeypatch, match), good, rtol=0, atol=0)


def test_off_writes_nothing(ckpt, monkeypatch):
    monkeypatch.setenv(quantized_file.ENV, "0")
    load(ckpt, "int8")
    assert not quantized_file.saved_path(ckpt, "int8", BF16).parent.exists()


def test_a_read_only_checkpoint_saves_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_LIB_CACHE", str(tmp_path / "cache"))
    snap = tmp_path / "hub" / "snapshots" / "abc123"
    assert derived_dir(snap, "engine_lib") == tmp_path / "cache" / "engine_lib" / "abc123"
    assert derived_dir(tmp_path / "ckpt", "gguf") == tmp_path / "ckpt.gguf"
