"""Chapters 05 and 12: the token loop that makes every cached generation's tokens, the engine's and the server's.

Every step, the scheduler decides which sequences run and how (``scheduler``: admission, blocks, preemption,
prefill chunks, how far a decode batch runs ahead), the runner executes each batch through its cache's
forward and decode step (``model_runner``), and the output processor turns its tokens into text, stops and
events (``output``); the engine core owns the three and the drafter, and its ``step()`` is schedule, run,
process (``engine_core``). The engine steps a core in the caller's thread over chapter 05's contiguous
cache (``local``); the server in a thread of its own over the paged cache (``serving``). ``sequence`` and
``sampler`` hold a request's state and its sampling, ``processors`` its logits adjustments, ``logprobs``
scores tokens, ``metrics`` counts what the loop does, ``result`` builds what a generation returns."""
