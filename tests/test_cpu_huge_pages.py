"""huge_pages: the weights moved onto 2 MiB pages keep their values, their parameter objects and their ties."""

import pytest
import torch

from engine_lib.cpu import huge_pages
from engine_lib.model.checkpoints import ensure_checkpoint
from engine_lib.model.loader import load_model

needs_thp = pytest.mark.skipif(huge_pages.unavailable_reason() is not None,
                               reason=f"huge pages: {huge_pages.unavailable_reason()}")


def _huge_bytes_at(ptr: int) -> int:
    """Bytes on 2 MiB pages in the mapping that holds address ``ptr`` (/proc/self/smaps): this region's own, not
    the whole process's, which other tests' models (collapsing, or being freed) move."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and len(line.split()) >= 5:  # a mapping's header line
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= ptr < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


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
@pytest.mark.parametrize("when", ["1", "now"])
def test_the_region_is_on_huge_pages_and_every_tensor_left_the_file(monkeypatch, when):
    """The OS backs the region with 2 MiB pages (defrag permitting: at least half), collapsed after the copy where
    the kernel can (the default) or asked for before it (``now``); no parameter still points into the checkpoint
    file's mapping, and the values survive the collapse."""
    model = _model(monkeypatch, False)
    want = {name: p.clone() for name, p in model.named_parameters()}
    monkeypatch.setenv(huge_pages.ENV, when)
    pointers = {p.data_ptr() for p in model.parameters()}
    moved = huge_pages.move_to_huge_pages(model)
    huge_pages.collapse_pending(wait=True)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert not pointers & {p.data_ptr() for p in model.parameters()}
    assert _huge_bytes_at(model.lm_head.weight.data_ptr()) >= moved // 2
    assert all(torch.equal(p, want[name]) for name, p in model.named_parameters())


@pytest.mark.skipif(not huge_pages._can_collapse(), reason="this kernel cannot collapse memory on request")
def test_by_default_the_first_token_does_not_wait_for_huge_pages(monkeypatch):
    """The region is filled on 4 KiB pages (no compaction before the first token) and collapsed by a background
    thread that the loader starts; the model reads the same values before, during and after."""
    monkeypatch.setenv(huge_pages.ENV, "1")
    data = huge_pages.region(64 << 20)
    data.copy_(torch.arange(data.numel(), dtype=torch.int64).to(torch.uint8))
    assert _huge_bytes_at(data.data_ptr()) == 0  # not asked for yet
    huge_pages.collapse_pending()
    total = int(data.sum())
    assert huge_pages.wait_collapsed(timeout=60)
    assert _huge_bytes_at(data.data_ptr()) >= 32 << 20
    assert int(data.sum()) == total == 127.5 * data.numel()


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


@needs_thp
def test_a_16_bit_model_is_read_straight_into_its_region(monkeypatch):
    """A bf16 model on a CPU is filled in its region (``Placer``): every parameter is there after the load, with
    the values a load that leaves them in the file gives, and nothing is left for ``move_to_huge_pages`` to copy."""
    plain, placed = _model(monkeypatch, False), _model(monkeypatch, True)
    assert all(huge_pages.in_region(p) for p in placed.parameters())
    assert not any(huge_pages.in_region(p) for p in plain.parameters())
    assert huge_pages.move_to_huge_pages(placed) == 0
    for (name, a), (_, b) in zip(plain.named_parameters(), placed.named_parameters()):
        assert torch.equal(a, b), name


@needs_thp
def test_placer_hands_out_page_aligned_slots_in_order(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    placer = huge_pages.Placer([10, 3 * 4096, 2])
    a, b, c = placer.empty((5,), torch.bfloat16), placer.empty((4096, 3), torch.uint8), placer.empty((1,), torch.bfloat16)
    assert b.data_ptr() - a.data_ptr() == 4096 and c.data_ptr() - b.data_ptr() == 3 * 4096
    assert all(huge_pages.in_region(t) for t in (a, b, c)) and not huge_pages.in_region(torch.zeros(4))


def test_a_mapped_file_is_a_region_whose_writes_stay_in_this_process(tmp_path):
    path = tmp_path / "weights.bin"
    data = torch.arange(1 << 20, dtype=torch.int32)
    path.write_bytes(b"h" * 4096 + data.numpy().tobytes())  # written in one piece
    t = huge_pages.mapped_file(path, 4096, data.nbytes).view(torch.int32)
    torch.testing.assert_close(t, data, rtol=0, atol=0)
    assert huge_pages.in_region(t) and t.data_ptr() % 4096 == 0
    t[0] = -1  # copy on write
    assert path.read_bytes()[4096:4100] == bytes(4) and t[0] == -1


def test_huge_page_bytes_counts_the_process_own_and_its_mapped_files(monkeypatch):
    rollup = "Rss: 900 kB\nAnonHugePages:  2048 kB\nShmemPmdMapped: 4096 kB\nFilePmdMapped:  6144 kB\n"
    monkeypatch.setattr(huge_pages, "Path", lambda p: type("P", (), {"read_text": lambda self: rollup})())
    assert huge_pages.huge_page_bytes() == (2048 + 6144) * 1024
    rollup = "Rss: 900 kB\n"
    assert huge_pages.huge_page_bytes() is None
