"""The server's decode batches run the engine's own ``decode_step``, over the paged cache.

Defined in chapter 12 (serving many users). A decode batch is padded to a *bucket* (a batch
size from ``BATCH_BUCKETS``) and reads a fixed span of positions (its *read span*, a multiple of
``SPAN_BUCKET``), so one ``PagedDecodeState`` per (bucket, read span) holds every buffer the step
reads: the newest tokens, their positions and the block tables. The step computes its physical
slots from those on the device (``prepare``), so it is the same fixed-shape function as the
engine's step: compiled once, captured as a CUDA graph per bucket on a GPU, and replayed with
only the host's copies of tokens, positions and tables in between.

Padding rows are harmless by construction: their block table is all scratch block, so they
write only there and read only there, and no real row's table ever holds the scratch block.
"""

from __future__ import annotations

import torch

from ..cache.paged import SCRATCH_BLOCK, ZERO_BLOCK, PagedKVCache
from .decode import StepBuffers

# nano-vllm's and vLLM's choice: small sizes one by one, then steps of 16
BATCH_BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))
SPAN_BUCKET = 256  # read spans are rounded up to a multiple of this


def batch_bucket(rows: int, smallest: int = 1) -> int:
    """The bucket a decode batch of ``rows`` is padded to (at least ``smallest``)."""
    need = max(rows, smallest)
    for b in BATCH_BUCKETS:
        if b >= need:
            return b
    raise ValueError(f"{rows} rows exceed the largest decode bucket ({BATCH_BUCKETS[-1]})")


def span_bucket(longest: int, max_read_span: int) -> int:
    """The read span for rows whose longest needs ``longest`` positions: a multiple of ``SPAN_BUCKET``,
    at most ``max_read_span`` (the context, ``max_model_len``, rounded up to whole blocks)."""
    return min(-(-longest // SPAN_BUCKET) * SPAN_BUCKET, max_read_span)


class PagedDecodeState(StepBuffers):
    """The fixed buffers of one (bucket, read span) decode batch over the paged cache.

    It answers what ``decode_step`` asks of a state (``prepare``, ``kv``, ``advance``, the
    sampling buffers), and what the paged layers ask of a slot source (``write_slots``,
    ``read_slots``, ``tables``, ``read_span``).
    """

    def __init__(self, cache: PagedKVCache, batch: int, read_span: int, vocab_size: int):
        bs, device = cache.block_size, cache.device
        if read_span % bs:
            raise ValueError(f"read span {read_span} is not a whole number of {bs}-token blocks")
        super().__init__(batch, vocab_size, device)
        long = dict(dtype=torch.long, device=device)
        self.read_span, self.block_size = read_span, bs
        self.cache_pos = self.positions  # the model's mask compares logical positions
        self.tables = torch.full((batch, read_span // bs), SCRATCH_BLOCK, **long)  # (batch, blocks)
        self.key_valid = torch.ones(batch, read_span, dtype=torch.bool, device=device)  # no padding slots
        self.span_positions = torch.arange(read_span, **long)  # (read_span,) the logical positions read
        self.write_slots = torch.zeros(batch, **long)  # (batch,) computed by prepare
        self.read_slots = torch.zeros(batch * read_span, **long)  # (batch * read_span,)
        self.kv = cache.layers(self)
        self.pool = cache.pools  # (slots, kv_heads[, head_dim]) each: the cache's whole pool of blocks (and scales)
        self.padded = False

    def load(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """Copy this step's rows into the buffers; rows past ``len(tokens)`` become padding.

        Real rows read zeros past their blocks (masked anyway), never the scratch block; padding
        rows hold nothing but the scratch block. One host tensor, three copies."""
        width = self.tables.shape[1]
        rows = [[tok, pos, 0, *t[:width], *[ZERO_BLOCK] * (width - len(t[:width]))]
                for tok, pos, t in zip(tokens, positions, tables)]
        rows += [[0, 0, 0, *[SCRATCH_BLOCK] * width]] * (self.batch - len(rows))
        host = torch.tensor(rows)  # (batch, 3 + blocks): token, position, picks so far (none), block table
        self.set_order(list(range(len(tokens))))
        self.token.copy_(host[:, :1])
        self.positions.copy_(host[:, 1:2])
        self.ahead.copy_(host[:, 2:3])
        self.tables.copy_(host[:, 3:])
        self.bad.zero_()

    def prepare(self) -> None:
        """Each row's physical slots, computed from its block table on the device (inside the step)."""
        bs, span = self.block_size, self.span_positions
        pos = self.positions  # (batch, 1)
        self.write_slots.copy_((self.tables.gather(1, pos // bs) * bs + pos % bs)[:, 0])
        slots = self.tables[:, span // bs] * bs + span % bs  # (batch, read_span)
        # past the newest token: the zero block, never a stale (maybe non-finite) value of a freed block
        self.read_slots.copy_(torch.where(span <= pos, slots, ZERO_BLOCK * bs).flatten())

    def advance(self, token: torch.Tensor) -> None:
        """Keep the picked tokens (batch,) and move every row on by one position, on the device: a step that
        runs ahead of the host (``load`` not called) decodes the token the last one picked, and its slots follow
        from the tables. The host reads ``picked`` when it plans the next batch."""
        self.record(token)
        self.positions += 1

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """Batch (from 2 on), read span and the cache's pool of slots stay symbolic in the compiled step: one
        compile serves every bucket, and every cache (an engine sizes its own to each call's rows)."""
        per_row = [*self.row_buffers(), self.tables, self.key_valid, self.write_slots]
        dims = [(t, 0) for t in per_row if self.batch > 1]
        return dims + [(self.tables, 1), (self.key_valid, 1), (self.span_positions, 0), (self.read_slots, 0),
                       *[(t, 0) for t in self.pool]]
