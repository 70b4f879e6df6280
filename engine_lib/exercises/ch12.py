"""Exercises of chapter 12 (serving many users): a block allocator, logical to physical slots, how many
requests a cache budget holds."""

from __future__ import annotations

from ..cache.blocks import BlockAllocator, blocks_for
from ..cache.paged import BLOCK_SIZE, RESERVED, PagedKVCache
from ..model.checkpoints import REAL_CONFIG, preset_config
from ..model.config import Qwen2Config
from ._grading import Mismatch, expect_equal, expect_tensor, grade

SOLUTIONS = "12_serving"
EXERCISES = [
    ("A block allocator", """\
Write a class `Allocator(num_blocks)` with `allocate(n) -> list[int]`, `free(blocks)` and a
`num_free` attribute or property. Blocks 0 and 1 are reserved (a zero block and a scratch block)
and are never handed out. An allocation that cannot be met raises an exception and takes
*nothing* (all or nothing), and no block is ever held by two sequences at once.

```python
check.ex12_1(Allocator)
```"""),
    ("From positions to slots", """\
A sequence's block table lists its blocks in order. Write `physical_slots(table, positions,
block_size)` for `table` (batch, max_blocks) and `positions` (batch, n), both `torch.long`, that
returns the physical slot of each logical position: the block that holds it, times the block
size, plus the offset inside the block.

```python
check.ex12_2(physical_slots)
```"""),
    ("How many requests fit?", """\
Write `max_requests(cfg, gib, bytes_per_element, tokens)` that returns how many requests of
`tokens` tokens each (prompt and reply) a paged cache of `gib` GiB holds at once, in blocks of 16
tokens, when 2 blocks are reserved and a request's last block may be partly empty. Compare with a
cache that reserves the model's whole context for every request.

```python
check.ex12_3(max_requests)
```"""),
]


def ex12_1(allocator_class) -> bool:
    def script(num_blocks, ops):
        def run():
            mine, ref = allocator_class(num_blocks), BlockAllocator(num_blocks, RESERVED)
            held_mine: list[list[int]] = []
            held_ref: list[list[int]] = []
            for step, (op, n) in enumerate(ops):
                where = f"step {step + 1} ({op} {n})"
                if op == "alloc":
                    try:
                        want = ref.allocate(n)
                    except Exception:
                        before = mine.num_free
                        try:
                            mine.allocate(n)
                        except Exception:
                            expect_equal(mine.num_free, before, f"num_free after the refused allocation at {where}")
                            continue
                        raise Mismatch(f"at {where} only {before} blocks are free, but allocate({n}) did not raise") from None
                    got = list(mine.allocate(n))
                    if len(got) != len(want):
                        raise Mismatch(f"at {where} you handed out {len(got)} blocks, expected {n}")
                    taken = {b for h in held_mine for b in h}
                    if set(got) & taken or len(set(got)) != len(got):
                        raise Mismatch(f"at {where} block(s) {sorted(set(got) & taken) or got} are already held")
                    if any(b < RESERVED or b >= num_blocks for b in got):
                        raise Mismatch(f"at {where} you handed out {got}: blocks 0 and 1 are reserved, and ids "
                                       f"stop at {num_blocks - 1}")
                    held_mine.append(got)
                    held_ref.append(want)
                else:
                    mine.free(held_mine.pop(n))
                    ref.free(held_ref.pop(n))
                expect_equal(mine.num_free, ref.num_free, f"num_free after {where}")
        return run
    cases = [("allocate and free", script(10, [("alloc", 3), ("alloc", 2), ("free", 0), ("alloc", 4)])),
             ("allocate(0) (edge)", script(5, [("alloc", 0), ("alloc", 3)])),
             ("running out: all or nothing", script(6, [("alloc", 3), ("alloc", 2), ("alloc", 1), ("free", 0),
                                                        ("alloc", 3)])),
             ("blocks come back and are reused", script(4, [("alloc", 2), ("free", 0), ("alloc", 2), ("free", 0),
                                                            ("alloc", 2)]))]
    return grade("Exercise 12.1", cases, hint="keep a list of free ids starting at 2; check len(free) >= n before "
                                              "popping any.")


def ex12_2(physical_slots) -> bool:
    import torch
    runs = [("block size 16, one row", BLOCK_SIZE, [[5, 2, 9]], [[0, 15, 16, 40]]),
            ("block size 4, two rows", 4, [[3, 7], [2, 4]], [[0, 3, 4, 7], [1, 5, 6, 2]]),
            ("a decode position at a block's first slot", 16, [[6, 3, 8]], [[32]])]

    def check(bs, table, pos):
        t, p = torch.tensor(table), torch.tensor(pos)
        cache = PagedKVCache(1, 1, 2, max(max(r) for r in table) + 1, torch.float32, "meta", block_size=bs)
        expect_tensor(physical_slots(t.clone(), p.clone(), bs), cache.slots(t, p), "your slots")
    cases = [(label, lambda b=b, t=t, p=p: check(b, t, p)) for label, b, t, p in runs]
    return grade("Exercise 12.2", cases, hint="table.gather(1, positions // block_size) * block_size + "
                                              "positions % block_size.")


def ex12_3(max_requests) -> bool:
    import torch
    real = Qwen2Config.from_json(REAL_CONFIG)
    runs = [("the real model, 1 GiB, bfloat16, 1,000 tokens", real, 1.0, torch.bfloat16, 1000),
            ("the tiny model, 0.0005 GiB, float32, 40 tokens", preset_config("tiny"), 0.0005, torch.float32, 40),
            ("requests of exactly 4 blocks (edge)", real, 0.5, torch.bfloat16, 64),
            ("the real model, 4 GiB, float32, 3,000 tokens", real, 4.0, torch.float32, 3000)]

    def check(cfg, gib, dtype, tokens):
        cache = PagedKVCache.from_budget(cfg, gib, dtype, "meta")
        want = cache.allocator.usable // blocks_for(tokens, cache.block_size)
        expect_equal(max_requests(cfg, gib, torch.tensor([], dtype=dtype).element_size(), tokens), want,
                     "your number of requests")
    cases = [(label, lambda c=c, g=g, d=d, t=t: check(c, g, d, t)) for label, c, g, d, t in runs]
    return grade("Exercise 12.3", cases, hint="blocks = GiB * 2**30 // (16 x KV bytes per token); usable = blocks "
                                              "- 2; per request ceil(tokens / 16).")

