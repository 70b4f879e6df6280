"""One forward for a batch of sequences' new tokens, over either cache: prompt chunks, drafts to verify, or
one token each.

Defined in chapter 05 (the contiguous cache, as the token loop drives it) and chapter 12 (the paged
cache). Each row brings its new tokens, the logical position of the first one and its block table.
Rows with fewer new tokens are padded on the left, so every row's last token sits in the last column
(``last_only`` reads it); padding writes to a scratch slot no real query reads (the paged cache's
scratch block, the contiguous cache's last slot of the row). The model gets the same arguments as
ever (``positions``, ``cache_pos``, ``key_valid``, ``kv_len``): its mask is causal per row, and rows
of different lengths are masked instead of assumed equal. The padding costs attention only: the
position-wise work (norms, projections, MLP) runs on the real tokens (``real_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.contiguous import KVCache
from ..cache.paged import SCRATCH_BLOCK, ZERO_BLOCK, PagedKVCache


@dataclass(frozen=True)
class Row:
    tokens: list[int]  # the new tokens of this forward
    start: int  # logical position of the first one (tokens before it are in the cache)
    table: list[int]  # the sequence's block table, long enough for start + len(tokens)


@dataclass
class Ragged:
    """Rows laid out left-padded, on the host: ids, positions, which entries are real (batch, longest)."""

    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    news: list[int]  # new tokens per row
    kv_len: int  # slots the forward reads: the longest row's start + new tokens

    @classmethod
    def of(cls, rows: list[tuple[list[int], int]]) -> Ragged:
        """``rows``: (new tokens, start) per batch row; an empty row is all padding."""
        b, t = len(rows), max(len(tokens) for tokens, _ in rows)
        ids = torch.zeros(b, t, dtype=torch.long)
        positions = torch.zeros(b, t, dtype=torch.long)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for i, (tokens, start) in enumerate(rows):
            n = len(tokens)
            if n:
                ids[i, t - n:] = torch.tensor(tokens, dtype=torch.long)
                positions[i, t - n:] = torch.arange(start, start + n)
                valid[i, t - n:] = True
        news = [len(tokens) for tokens, _ in rows]
        return cls(ids, positions, valid, news, max(start + n for (_, start), n in zip(rows, news)))

    def uniform(self, starts: list[int]) -> bool:
        """Rows that start together and bring as many tokens need no mask: the fast path of a lone request
        (plain causal prefill, or one token that sees everything)."""
        return len(set(zip(starts, self.news))) == 1

    def real_tokens(self, all_positions: bool, device) -> torch.Tensor | None:
        """Ragged rows: the flat indices of the real tokens, so the projections and the MLP take only those
        (a one-token decode row beside a prompt chunk costs one token there, not the chunk's length)."""
        t = self.ids.shape[1]
        return self.valid.flatten().nonzero()[:, 0].to(device) if not all_positions and min(self.news) < t else None


@torch.inference_mode()
def paged_forward(model, cache: PagedKVCache, rows: list[Row], all_positions: bool = False) -> torch.Tensor:
    """-> logits of each row's last new token, (batch, vocab), in the model's dtype; with
    ``all_positions``, of every new token, (batch, tokens, vocab) (a prompt's logprobs need them).

    The server runs its prefill chunks through this (their shapes change with every prompt);
    its decode batches run the engine's fixed-shape step instead (``paged.py``).
    """
    device, b = cache.device, len(rows)
    lay = Ragged.of([(r.tokens, r.start) for r in rows])
    t, lengths = lay.ids.shape[1], [r.start + n for r, n in zip(rows, lay.news)]
    # as wide as the read span: our Triton attention (chapter 14) reads through the tables up to kv_len
    width = max(max(len(r.table) for r in rows), -(-lay.kv_len // cache.block_size))
    tables = torch.full((b, width), ZERO_BLOCK, dtype=torch.long)
    for i, r in enumerate(rows):
        tables[i, :len(r.table)] = torch.tensor(r.table, dtype=torch.long)
    write = cache.slots(tables, lay.positions)
    scratch = SCRATCH_BLOCK * cache.block_size + torch.arange(t) % cache.block_size
    write = torch.where(lay.valid, write, scratch)
    read = cache.slots(tables, torch.arange(lay.kv_len).expand(b, lay.kv_len), torch.tensor(lengths))
    key_valid = None if lay.uniform([r.start for r in rows]) else torch.ones(b, lay.kv_len, dtype=torch.bool,
                                                                             device=device)
    ids, positions = lay.ids.to(device), lay.positions.to(device)
    cache.prepare(write.to(device), read.to(device), tables.to(device))
    logits = model(ids, positions, cache.layers(), positions, key_valid, kv_len=lay.kv_len,
                   last_only=not all_positions, real_tokens=lay.real_tokens(all_positions, device))
    return logits if all_positions else logits[:, -1]


@torch.inference_mode()
def contiguous_forward(model, cache: KVCache, rows: list[Row], all_positions: bool = False) -> torch.Tensor:
    """The same over chapter 05's contiguous cache, where a sequence's block table is its row: the forward
    runs every row of the cache, so batch row i writes and reads cache row i with no copy. Rows that bring
    nothing this time take one token of padding, which writes to their scratch slot.

    -> the logits of ``rows``, in their order, as ``paged_forward`` gives them."""
    device, b, scratch = cache.device, cache.batch, cache.scratch_slot
    by_row = {r.table[0]: r for r in rows}
    lay = Ragged.of([(by_row[i].tokens, by_row[i].start) if i in by_row else ([0], 0) for i in range(b)])
    slots = torch.where(lay.valid, lay.positions, scratch)  # (batch, tokens)
    idle = [i for i in range(b) if i not in by_row]
    slots[idle] = scratch  # their one token counts as real to the projections: every row has a last token
    starts = [by_row[i].start if i in by_row else -1 for i in range(b)]
    key_valid = None if len(rows) == b and lay.uniform(starts) else torch.ones(b, lay.kv_len, dtype=torch.bool,
                                                                               device=device)
    ids, positions = lay.ids.to(device), lay.positions.to(device)
    logits = model(ids, positions, cache.layers(), slots.to(device), key_valid, kv_len=lay.kv_len,
                   last_only=not all_positions, real_tokens=lay.real_tokens(all_positions, device))
    order = torch.tensor([r.table[0] for r in rows], device=device)
    return logits.index_select(0, order) if all_positions else logits[:, -1].index_select(0, order)
