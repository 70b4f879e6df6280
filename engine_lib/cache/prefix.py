"""Automatic prefix caching: full KV blocks found again by the tokens that led to them.

Defined in chapter 13 (an API for agents and evaluators). A chat server's requests share their system
prompt, and a preempted sequence shares its own past. A block's keys and values depend on
its tokens *and on every token before them*, so a full block is keyed by a hash chained over
the prefix: ``key(i) = H(key(i - 1), tokens of block i)``. Equal tokens under a different
prefix give a different key, and a lookup walks a prompt's full blocks in order, stopping at
the first miss.

Blocks are reference counted. A block nobody holds any more keeps its keys and values and
stays findable; it is only evicted, least recently released first, when a fresh block is
needed and the free list is empty. Only full blocks are ever keyed, and a sequence never
writes into a block it found (see ``PrefixCachingAllocator.acquire``), so a shared block is
read-only. A block is keyed once its tokens are computed (``seal``, after a prefill chunk or a
decode step); requests admitted together with one prompt (``n > 1``) find the first one's blocks
before each prefill chunk (``reuse``): a prompt whose first block matches a planned chunk runs in
the next forward (``Scheduler._prefills``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .blocks import BlockAllocator, OutOfBlocks
from .paged import RESERVED


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    """The chained key of one full block: 16 bytes of BLAKE2b over the parent's key and the token
    ids (a collision would silently reuse wrong keys/values, so not Python's 64-bit ``hash``)."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCachingAllocator(BlockAllocator):
    """The free list plus reference counts and a table from chained key to block."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, RESERVED)
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # block -> holders; absent: on the free list or evictable
        self.key_of: dict[int, bytes] = {}  # full, computed block -> its chained key
        self.by_key: dict[bytes, int] = {}  # chained key -> the one block that answers for it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest release first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never used or cached but held by nobody."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        return len(self.by_key)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"{n} blocks asked for, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.free_ids:
                block = self.free_ids.popleft()
            else:  # evict the least recently released cached block: its key goes with it
                block, _ = self.evictable.popitem(last=False)
                del self.by_key[self.key_of.pop(block)]
            self.refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unheld blocks stay cached if keyed, else go free.
        A chain is released tail first, so its tail is evicted first and its head, which more
        requests share (a system prompt), stays findable longest."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            del self.refs[block]
            key = self.key_of.get(block)
            if key is not None and self.by_key.get(key) == block:
                self.evictable[block] = None  # most recently released: evicted last
            else:
                self.key_of.pop(block, None)  # a duplicate of a block cached elsewhere
                self.free_ids.append(block)

    def _take(self, block: int) -> None:
        self.evictable.pop(block, None)
        self.refs[block] = self.refs.get(block, 0) + 1

    def lookup(self, tokens: list[int]) -> list[int]:
        """Cached blocks for ``tokens``' full blocks, in order, up to the first miss (no reference taken). The
        block holding the last token is never matched: that token is computed again, for its logits."""
        bs, out, parent = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            key = block_key(parent, tokens[i * bs:(i + 1) * bs])
            block = self.by_key.get(key)
            if block is None:
                break
            out.append(block)
            parent = key
        return out

    def acquire(self, tokens: list[int], n: int, reserve: int = 0, share: bool = True) -> tuple[list[int], int]:
        """``n`` blocks for a sequence of ``tokens`` (all or nothing, leaving ``reserve`` free):
        the cached blocks of its longest cached prefix (unless not ``share``), then fresh ones.
        -> (blocks, cached tokens)."""
        hits = self.lookup(tokens) if share else []
        fresh = n - len(hits)
        cost = fresh + sum(1 for b in hits if b in self.evictable)  # taking an unheld block uses it up
        if cost + reserve > self.num_free:
            raise OutOfBlocks(f"{cost} blocks needed (+{reserve} kept), {self.num_free} free")
        for block in hits:
            self._take(block)
        return hits + self.allocate(fresh), len(hits) * self.block_size

    def reuse(self, blocks: list[int], tokens: list[int], computed: int) -> int:
        """Before computing from ``computed`` on: swap the sequence's next fresh, unwritten blocks
        for cached ones found since it was admitted (a sibling with the same prompt got there first).
        Edits ``blocks`` in place; -> the new ``computed``."""
        bs = self.block_size
        if computed % bs:
            return computed
        i = computed // bs
        parent = self.key_of.get(blocks[i - 1]) if i else None
        if i and parent is None:
            return computed
        while (i + 1) * bs <= len(tokens) - 1:
            key = block_key(parent, tokens[i * bs:(i + 1) * bs])
            hit = self.by_key.get(key)
            if hit is None or hit == blocks[i]:
                break
            self._take(hit)
            self.free([blocks[i]])  # ours was never written
            blocks[i] = hit
            parent, i = key, i + 1
        return i * bs

    def seal(self, blocks: list[int], tokens: list[int], computed: int) -> None:
        """Key every block whose ``block_size`` tokens are now computed (after a prefill chunk or a
        decode step), so later requests can find it. Keys are chained, so blocks are keyed in order."""
        bs = self.block_size
        full = first = computed // bs
        while first > 0 and blocks[first - 1] not in self.key_of:
            first -= 1
        parent = self.key_of[blocks[first - 1]] if first else None
        for i in range(first, full):
            key = block_key(parent, tokens[i * bs:(i + 1) * bs])
            self.key_of[blocks[i]] = key
            self.by_key.setdefault(key, blocks[i])  # equal blocks computed twice: the first answers
            parent = key
