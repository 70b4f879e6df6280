"""huge_pages: the weights moved onto 2 MiB pages keep their values, their parameter objects and their ties."""

import pytest
import torch

from engine_lib import huge_pages
from engine_lib.checkpoints import ensure_checkpoint
from engine_lib.loader import load_model

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
