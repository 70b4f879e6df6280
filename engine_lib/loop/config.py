"""How a token loop is set up: ``SchedulerConfig``, stated once, checked once.

Defined in chapter 12 (serving many users); the server's command line (``serve.server``) and the engine's
local loop (``local``) both make one. Its defaults are the server's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OptionValueError
from ..step.decode import MAX_AHEAD

# what a server can draft with (a draft model needs a cache of its own): chapter 11's lookups
SPECULATIVE_METHODS = (None, "prompt_lookup", "suffix")
DECODE_STEPS_GPU = 8  # vLLM's multi-step scheduling used 8 too; Engine.generate reads every 16


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences admitted at once (prefilling or decoding)
    max_queue: int = 256  # requests waiting for admission before new ones are refused
    prefill_chunk: int = 256  # prompt tokens pushed through the model per step, over all sequences
    # a request's tokens do not depend on which others share its batch: decode rows read a fixed
    # span of slots and a lone row is padded to ``min_rows`` (see step.drivers.PagedSteps)
    batch_invariant: bool = False
    min_rows: int = 2
    prefix_caching: bool = True  # share cached full blocks of equal prefixes (cache/prefix.py)
    # decode steps a batch may run before the host reads its tokens (see steps_ahead); None: 8 on a GPU,
    # where each read is a sync the device idles through, and 1 on a CPU, where a read costs nothing
    decode_steps: int | None = None
    # speculative decoding (chapter 11) in the loop: "prompt_lookup" drafts for each greedy row from its own
    # context, "suffix" from it and from the replies of earlier requests, and one forward verifies the draft (see
    # engine_core); None: off. An engine passes its drafter.
    speculative: str | None = None
    speculative_tokens: int = 4  # the most tokens a row drafts per step; each row adapts below it
    speculate_sampled: bool = False  # sampled rows draft too (the engine's); a server keeps seeded replies fixed

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "min_rows", "decode_steps", "speculative_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise OptionValueError(name, value, "a whole number >= 1")
        if self.decode_steps is not None and self.decode_steps > MAX_AHEAD:
            raise OptionValueError("decode_steps", self.decode_steps, f"at most {MAX_AHEAD} (a decode batch keeps "
                                   "that many picks for the host to read)")
        if self.speculative not in SPECULATIVE_METHODS:
            raise OptionValueError("speculative", self.speculative, "one of " + ", ".join(map(repr, SPECULATIVE_METHODS)))

    def steps_for(self, device) -> int:
        """``decode_steps`` on this device (its default where None)."""
        return self.decode_steps or (DECODE_STEPS_GPU if torch.device(device).type == "cuda" else 1)
