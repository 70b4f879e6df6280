"""Blocks of cache slots and the free list that hands them out, for both caches the token loop drives.

Defined in chapter 12 (serving many users). A sequence owns a list of blocks (its *block table*): logical
position ``p`` lives in slot ``p % block_size`` of block ``table[p // block_size]``. The paged cache
(``paged``) cuts every layer's pool into blocks of 16 slots, and a sequence takes a new one as it grows.
Chapter 05's contiguous cache (``contiguous``) is the same thing with one block per sequence: a whole row,
handed out at admission and never outgrown. The scheduler asks both the same questions.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """No free block: the scheduler queues or preempts; nothing is written."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    """A free list of block ids; allocation is all-or-nothing. The first ``reserved`` ids are never
    handed out (the paged cache's zero and scratch blocks)."""

    def __init__(self, num_blocks: int, reserved: int):
        if num_blocks <= reserved:
            raise ValueError(f"a cache needs more than {reserved} blocks, got {num_blocks}")
        self.num_blocks, self.reserved = num_blocks, reserved
        self.free_ids: deque[int] = deque(range(reserved, num_blocks))

    @property
    def usable(self) -> int:
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise OutOfBlocks(f"{n} blocks asked for, {len(self.free_ids)} free")
        return [self.free_ids.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self.free_ids.extend(blocks)

    # what prefix caching adds (prefix.PrefixCachingAllocator); without it, nothing is shared
    def acquire(self, tokens: list[int], n: int, reserve: int = 0, share: bool = True) -> tuple[list[int], int]:
        """``n`` fresh blocks for a new sequence, leaving ``reserve`` free -> (blocks, 0 cached tokens)."""
        if n + reserve > self.num_free:
            raise OutOfBlocks(f"{n} blocks needed (+{reserve} kept), {self.num_free} free")
        return self.allocate(n), 0

    def reuse(self, blocks: list[int], tokens: list[int], computed: int) -> int:
        return computed

    def seal(self, blocks: list[int], tokens: list[int], computed: int) -> None:
        pass
