"""One forward for a batch of sequences over the paged cache: prefill chunks or decode tokens.

Defined in chapter 12 (serving many users). Each row brings its new tokens, the logical
position of the first one and its block table. Rows with fewer new tokens are padded on
the left, so every row's last token sits in the last column (``last_only`` reads it);
padding writes to the scratch block and sees only its row's slot 0, so it never touches a
real slot. The model gets the same arguments as ever (``positions``, ``cache_pos``,
``key_valid``, ``kv_len``), with logical positions: its mask is causal per row, and rows of
different lengths are masked instead of assumed equal. The padding costs attention only: the
position-wise work (norms, projections, MLP) runs on the real tokens (``real_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.paged import SCRATCH_BLOCK, ZERO_BLOCK, PagedKVCache


@dataclass(frozen=True)
class Row:
    tokens: list[int]  # the new tokens of this forward
    start: int  # logical position of the first one (tokens before it are in the cache)
    table: list[int]  # the sequence's block table, long enough for start + len(tokens)


@torch.inference_mode()
def paged_forward(model, cache: PagedKVCache, rows: list[Row], all_positions: bool = False) -> torch.Tensor:
    """-> logits of each row's last new token, (batch, vocab), in the model's dtype; with
    ``all_positions``, of every new token, (batch, tokens, vocab) (a prompt's logprobs need them).

    The server runs its prefill chunks through this (their shapes change with every prompt);
    its decode batches run the engine's fixed-shape step instead (``paged_step.py``).
    """
    device = cache.device
    real = b = len(rows)
    t = max(len(r.tokens) for r in rows)
    news = [len(r.tokens) for r in rows]
    lengths = [r.start + n for r, n in zip(rows, news)]
    kv_len = max(lengths)
    ids = torch.zeros(b, t, dtype=torch.long)
    positions = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    # as wide as the read span: our Triton attention (chapter 14) reads through the tables up to kv_len
    width = max(max(len(r.table) for r in rows), -(-kv_len // cache.block_size))
    tables = torch.full((b, width), ZERO_BLOCK, dtype=torch.long)
    for i, (r, n) in enumerate(zip(rows, news)):
        ids[i, t - n:] = torch.tensor(r.tokens[:n], dtype=torch.long)
        positions[i, t - n:] = torch.arange(r.start, r.start + n)
        valid[i, t - n:] = True
        tables[i, :len(r.table)] = torch.tensor(r.table, dtype=torch.long)
    write = cache.slots(tables, positions)
    scratch = SCRATCH_BLOCK * cache.block_size + torch.arange(t) % cache.block_size
    write = torch.where(valid, write, scratch)
    read = cache.slots(tables, torch.arange(kv_len).expand(b, kv_len), torch.tensor(lengths))
    # rows that start together and bring as many tokens need no mask: the same fast path as
    # a lone request (plain causal prefill, or one token that sees everything)
    uniform = len({(r.start, n) for r, n in zip(rows, news)}) == 1 and kv_len == max(lengths)
    key_valid = None if uniform else torch.ones(b, kv_len, dtype=torch.bool, device=device)
    ids, positions = ids.to(device), positions.to(device)
    cache.prepare(write.to(device), read.to(device), tables.to(device))
    # ragged rows: the projections and the MLP take the real tokens only (a one-token decode row beside
    # a prompt chunk costs one token there, not the chunk's length); attention keeps the padded layout
    real_tokens = valid.flatten().nonzero()[:, 0].to(device) if not all_positions and min(news) < t else None
    logits = model(ids, positions, cache.layers(), positions, key_valid, kv_len=kv_len, last_only=not all_positions,
                   real_tokens=real_tokens)
    return logits[:real] if all_positions else logits[:real, -1]
