"""The weights on 2 MiB pages (Linux transparent huge pages), for a CPU decode step that streams them all.

Defined in chapter 10 (fewer bytes, beside our CPU kernels); chapter 08's CPU records say whether it was on.
A decode step reads every weight
once, and memory is mapped in pages: with 4 KiB pages, streaming 841 MB of weights (the 4-layer
checkpoint of the 1.5B shape, bf16) touches 205,000 pages, far more than the TLB holds, so the core
walks the page table for every 4 KiB it reads. With 2 MiB pages it walks 512 times less often. Measured on
a 2-core Xeon held to AVX2, our bf16 matvec on the (151936, 1536) LM head: 23.2 GB/s on 4 KiB pages,
29.5 on 2 MiB (medians of 9, 3 rounds), (8960, 1536) 21.9 against 28.5.

PyTorch's allocator asks Linux for 2 MiB pages only when ``THP_MEM_ALLOC_ENABLE=1`` is set before torch is
imported, too late to rely on from a library; so the weights live in a region of their own. A 16-bit model is
read from the checkpoint straight into it (``Placer``: one copy, a packed projection concatenated in place);
anything else is copied there after loading (``move_to_huge_pages``), each parameter pointed at its copy. A saved
quantized model is not copied at all: its file is mapped (``mapped_file``), and the page cache's 2 MiB folios
are the huge pages. Getting 2 MiB pages can cost seconds: where memory is fragmented (a page cache full
of checkpoints) the kernel compacts it first, 1.5 to 4 s for 3 GB on a 2-core EPYC VM. So the first token does not
wait for them: the region is filled on ordinary pages and a background thread at the lowest priority asks the
kernel to collapse it onto 2 MiB pages, 32 MiB at a time (``madvise(MADV_COLLAPSE)``, Linux 6.1; the contents
and addresses stay the same, so the model runs throughout). An older kernel gets them the old way, by asking
(``MADV_HUGEPAGE``) before the region is first written. Where the OS cannot (not Linux, huge pages off) the
weights stay on ordinary pages and ``unavailable_reason`` says why. ``ENGINE_LIB_HUGE_PAGES=0`` turns it off,
``=now`` takes them before the first token (for comparisons).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
# glibc keeps a freed weight of a few MiB in its heap (the quantized layers' tensors are allocated among the
# loader's temporaries), where it still counts in this process's memory: malloc_trim returns it to the OS
TRIM_EVERY = 128 << 20
ENV = "ENGINE_LIB_HUGE_PAGES"
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_COLLAPSE = 25  # linux/mman.h (6.1); Python's mmap module names it from 3.13 only
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14): map a range's pages in one call, as MAP_POPULATE does a region's
COLLAPSE_STEP = 32 << 20  # one madvise call: short enough that the model's threads never wait long on it
# regions filled on ordinary pages, not yet collapsed: (their memory, weakly: a model let go of frees it; start, end)
_pending: list[tuple[weakref.ref, int, int]] = []
_collapser: threading.Thread | None = None
_regions: list[tuple[weakref.ref, int, int]] = []  # every region made here: (its memory, weakly; start, end)


def unavailable_reason() -> str | None:
    """None where weights can be put on 2 MiB pages here; otherwise why not."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are a Linux feature (this is {sys.platform})"
    try:
        mode = SETTING.read_text()
    except OSError:
        return f"this kernel has no transparent huge pages ({SETTING} is missing)"
    if "[never]" in mode:
        return f"transparent huge pages are off ({SETTING}: never)"
    return None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def cpu_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's contiguous CPU parameters and buffers, each once (a tied LM head is the embedding's own
    tensor). The small ones move too: a tensor the loader read from a safetensors file is a view of the file's
    mapping, and one left behind would keep every page of it that the copy read."""
    seen, out = set(), []
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and id(t) not in seen and t.device.type == "cpu" and t.is_contiguous() and t.nbytes:
                seen.add(id(t))
                out.append(t)
    return out


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the model's CPU tensors into one region on 2 MiB pages and point each at its copy (the parameter
    objects stay the same, so every module that holds one sees the move); tensors already in a region (read
    there by ``Placer`` or mapped from a saved model) stay. -> bytes moved (0 where ``unavailable_reason`` says why
    not). Pages of the checkpoint file that held a moved tensor are let go at once (``drop_file_pages``), so the
    weights are held about once throughout, then as anonymous memory instead of the file's."""
    tensors = [t for t in cpu_tensors(model) if not in_region(t)]
    if not tensors or unavailable_reason() is not None:
        return 0
    sizes = [_round_up(t.nbytes, 4096) for t in tensors]
    files = file_ranges()
    raw, at = region(sum(sizes)), 0
    freed = 0
    with torch.no_grad():
        for t, size in zip(tensors, sizes):
            copy = raw[at:at + t.nbytes].view(t.dtype).view(t.shape)
            copy.copy_(t)
            old = t.data_ptr()
            t.data = copy
            drop_file_pages(old, t.nbytes, files)
            at += size
            freed += size
            if freed >= TRIM_EVERY:  # hand the freed originals back as we go: the peak holds one copy, not two
                _libc().malloc_trim(0)
                freed = 0
    _libc().malloc_trim(0)
    return sum(sizes)


class Placer:
    """Room for tensors of known sizes in one region on 2 MiB pages, handed out in order, each slot's pages mapped
    only when it is handed out (``MADV_POPULATE_WRITE``, one call a slot): the loader reads each weight of a 16-bit
    model straight into its slot, so the region grows as the checkpoint's pages are let go, and no second copy of
    a packed projection is made on the heap first. Measured on a 2-core EPYC VM held to AVX2, the 28-layer fused
    rung's load (q/k/v and gate/up concatenated): peak RSS 5.55 GB when they were concatenated on the heap and then
    moved here, 3.46 GB read into its slots (one start each), where the weights take 3.4 GB."""

    def __init__(self, sizes: list[int]):
        self.raw, self.at = region(sum(_round_up(n, 4096) for n in sizes), populate=False), 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        t = self.raw[self.at:self.at + nbytes]
        self.at += _round_up(nbytes, 4096)
        if nbytes:
            _libc().madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(_round_up(nbytes, 4096)),
                            MADV_POPULATE_WRITE)  # an older kernel (EINVAL): each page faults in as it is written
        return t.view(dtype).view(shape)


def in_region(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is in a region made here (``region``)."""
    p = t.data_ptr()
    return any(start <= p < end and ref() is not None for ref, start, end in _regions)


def region(nbytes: int, populate: bool = True) -> torch.Tensor:
    """``nbytes`` of fresh anonymous memory (uint8), starting on a 2 MiB boundary: on 2 MiB pages where the OS
    gives them (``unavailable_reason`` is None), else on ordinary pages; ``populate``: its small pages mapped
    now, in one call. Every view keeps the memory alive."""
    ask_now = unavailable_reason() is None and not collapse_later()
    # small pages are mapped in one call (MAP_POPULATE), not one fault each: 1.5 GB 0.1 s sooner (2-core EPYC)
    flags = getattr(mmap, "MAP_POPULATE", 0) if populate and not ask_now else 0
    mem = mmap.mmap(-1, _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    raw = torch.frombuffer(mem, dtype=torch.uint8)
    at = (-raw.data_ptr()) % HUGE_PAGE
    _remember(mem, raw)
    if unavailable_reason() is None:
        if not ask_now:
            _pending.append((weakref.ref(mem), raw.data_ptr() + at, raw.data_ptr() + at + _round_up(nbytes, HUGE_PAGE)))
        else:
            mem.madvise(mmap.MADV_HUGEPAGE)  # before any page is written: each 2 MiB fault then takes a huge page
    return raw[at:at + nbytes]


def mapped_file(path: Path, start: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[start, start + nbytes)`` of a file this project wrote, mapped (copy on write: a stray write changes
    this process's copy, never the file) instead of read into fresh memory, as llama.cpp maps its GGUF. Linux keeps
    a file in its page cache in large folios where it can (written in large pieces, or read back through a mapping
    that asks for huge pages, as this one does) and maps each 2 MiB one with a single entry where the mapping starts
    on a 2 MiB boundary (it places large file mappings so): most of the weights are on huge pages from the first
    token, with no copy, no collapse and no fresh memory to fault in. Measured on a 2-core EPYC VM (Linux 6.18): a
    1 GiB file written in 64 MiB pieces was mapped whole on 2 MiB entries and summed from its first touch at
    33 GB/s; the 28-layer int8 model's file, read back from disk, 1.0 of its 1.44 GiB. Every view keeps the
    mapping alive; ``in_region`` counts it as a region."""
    with open(path, "rb") as f:
        mem = mmap.mmap(f.fileno(), start + nbytes, access=mmap.ACCESS_COPY)
    if unavailable_reason() is None:
        mem.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mem, dtype=torch.uint8)
    _remember(mem, raw)
    return raw[start:start + nbytes]


def _remember(mem: mmap.mmap, raw: torch.Tensor) -> None:
    """Count ``mem`` (viewed whole by ``raw``) as a region for ``in_region``, weakly; forget regions let go of."""
    _regions[:] = [r for r in _regions if r[0]() is not None] + [
        (weakref.ref(mem), raw.data_ptr(), raw.data_ptr() + raw.numel())]


def collapse_later() -> bool:
    """Whether regions are filled on ordinary pages and collapsed onto 2 MiB pages after the load
    (``collapse_pending``): where this kernel can collapse memory on request and ``ENGINE_LIB_HUGE_PAGES`` is not
    ``now``."""
    return os.environ.get(ENV, "1") != "now" and _can_collapse()


@functools.cache
def _can_collapse() -> bool:
    """One 2 MiB page of a scratch region collapsed on request: the kernel has MADV_COLLAPSE (Linux 6.1)."""
    if not sys.platform.startswith("linux"):
        return False
    mem = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        raw = torch.frombuffer(mem, dtype=torch.uint8)
        at = (-raw.data_ptr()) % HUGE_PAGE
        raw[at] = 1
        ok = _libc().madvise(ctypes.c_void_p(raw.data_ptr() + at), ctypes.c_size_t(HUGE_PAGE), MADV_COLLAPSE) == 0
        del raw
        return ok
    finally:
        mem.close()


def collapse_pending(wait: bool = False) -> None:
    """Start collapsing the regions filled since the last call onto 2 MiB pages, in one background thread at the
    lowest priority (``nice 19``: it takes the cores when the model leaves them, between steps and requests);
    ``wait`` does it here instead and returns when done. A range the kernel cannot collapse (no free memory to
    compact) stays on ordinary pages, as it was."""
    global _collapser
    ranges = list(_pending)
    _pending.clear()
    if not ranges:
        return
    if wait:
        _collapse(ranges, nice=False)
        return
    _collapser = threading.Thread(target=_collapse, args=(ranges, True), name="engine_lib-huge-pages", daemon=True)
    _collapser.start()


def wait_collapsed(timeout: float | None = None) -> bool:
    """Wait for the background collapse (if any) -> whether it has finished."""
    if _collapser is not None:
        _collapser.join(timeout)
        return not _collapser.is_alive()
    return True


def _collapse(ranges: list[tuple[weakref.ref, int, int]], nice: bool) -> None:
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except OSError:
            pass
    libc = _libc()
    for ref, start, end in ranges:
        for at in range(start, end, COLLAPSE_STEP):
            mem = ref()  # held while its range is collapsed; a region no model uses any more is skipped
            if mem is None:
                break
            size = ctypes.c_size_t(min(COLLAPSE_STEP, end - at))
            libc.madvise(ctypes.c_void_p(at), size, mmap.MADV_HUGEPAGE)  # and keep it so
            for _ in range(3):  # EAGAIN: a page was busy (just written, still on its way to the LRU): try again
                if libc.madvise(ctypes.c_void_p(at), size, MADV_COLLAPSE) == 0 or ctypes.get_errno() != errno.EAGAIN:
                    break  # done, or ENOMEM (no memory to compact into): this range stays as it is
            del mem


def file_ranges() -> list[tuple[int, int]]:
    """This process's mappings of files (/proc/self/maps, an inode other than 0): [start, end) addresses."""
    out = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and fields[4] != "0":
                start, end = fields[0].split("-")
                out.append((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return out


def drop_file_pages(ptr: int, nbytes: int, files: list[tuple[int, int]]) -> None:
    """Let go of the file pages that held a tensor the loader read from a checkpoint (a view of the file's
    mapping), now that the tensor has moved: without this every page the copy read stays in this process
    until the file is unmapped, after the last tensor, and a load holds the weights twice at its peak. Only
    pages of a file mapping: the OS reads them again from the file if anything still looks (the same
    bytes); anonymous memory is left alone (dropping it would zero it)."""
    page = mmap.PAGESIZE
    start, end = _round_up(ptr, page), (ptr + nbytes) // page * page
    if end <= start or not any(a <= start and end <= b for a, b in files):
        return
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # this process's C library, opened once for every tensor


def huge_page_bytes() -> int | None:
    """This process's memory on transparent huge pages now, in bytes: its own (``AnonHugePages`` of
    /proc/self/smaps_rollup) and a mapped file's (``FilePmdMapped``); None where the OS does not say."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
                      if line.startswith(("AnonHugePages:", "FilePmdMapped:")))
    except OSError:
        return None
    if not fields:
        return None
    return sum(int(v.split()[0]) for v in fields.values()) * 1024
