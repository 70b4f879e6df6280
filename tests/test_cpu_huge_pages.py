"""huge_pages: the weights moved onto 2 MiB pages keep their values, their parameter objects and their ties."""

import pytest
import torch

from engine_lib.cpu import huge_pages
from engine_lib.model.checkpoints import ensure_checkpoint
from engine_lib.model.loader import load_model

needs_thp = pytest.mark.skipif(huge_pages.unavailable_reason() is not None,
                               reason=f"huge pages: {huge_pages.unavailable_reason()}")


def _model(monkeypatch, on: bool):
    monkeypatch.setenv(huge_pages.ENV, "1" if on else "0")
    return load_model(ensure_checkpoint("tiny"), torch.bfloat16, torch.device("cpu"))


@needs_thp
def test_moved_weights_give_the_same_logits_and_keep_the_tied_head(monkeypatch):
    plain, moved = _model(monkeypatch, False), _model(monkeypatch, True)
    assert moved.lm_head.weight is moved.model.embed_tokens.weight  # still one tensor, moved once
    ids = torch.tensor([[1, 20, 300, 4000]])
    with torch.inference_mode():
        assert torch.equal(plain(ids), moved(ids))
    for (name, a), (_, b) in zip(plain.named_parameters(), moved.named_parameters()):
        assert torch.equal(a, b), name


@needs_thp
def test_the_region_is_on_huge_pages_and_every_tensor_left_the_file(monkeypatch):
    """The copy is made after the region asked for 2 MiB pages, so the OS backs it with them (defrag
    permitting: at least half); no parameter still points into the checkpoint file's mapping."""
    model = _model(monkeypatch, False)
    monkeypatch.setenv(huge_pages.ENV, "1")
    before = huge_pages.huge_page_bytes()
    pointers = {p.data_ptr() for p in model.parameters()}
    moved = huge_pages.move_to_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert not pointers & {p.data_ptr() for p in model.parameters()}
    assert huge_pages.huge_page_bytes() - before >= moved // 2


def test_turned_off_it_moves_nothing_and_says_why(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.unavailable_reason() == f"{huge_pages.ENV}=0"
    model = torch.nn.Linear(8, 4)
    ptr = model.weight.data_ptr()
    assert huge_pages.move_to_huge_pages(model) == 0 and model.weight.data_ptr() == ptr


def _resident_kib(path) -> int:
    """KiB of ``path``'s pages resident in this process (its mappings in /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and len(line.split()) >= 5:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@needs_thp
def test_a_moved_tensor_lets_go_of_the_checkpoint_file_pages_it_was_read_from(tmp_path):
    """Without this the load's peak held the weights twice: every page of the file the copy read."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(2048, 2048), "norm": torch.ones(2048)}, str(path))  # 16 MiB, and a small one
    with safe_open(str(path), framework="pt") as f:
        layer = torch.nn.Linear(2048, 2048, bias=False)
        layer.weight.data = f.get_tensor("w")
        kept = f.get_tensor("norm")  # a tensor that stays: it keeps the file mapped, as a loader's other tensors do
    want = layer.weight.sum()  # reads every page of the file's mapping
    if _resident_kib(path) < 8 * 1024:
        pytest.skip("safetensors did not map the file here (a copy was read instead)")
    huge_pages.move_to_huge_pages(layer)
    assert _resident_kib(path) < 1024 and layer.weight.sum() == want and kept.sum() == 2048
