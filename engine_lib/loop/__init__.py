"""The token loop (chapter 12): every step, the scheduler decides which sequences run and how
(``scheduler``: admission, blocks, preemption, prefill chunks, how far a decode batch runs ahead),
the runner executes that batch through the engine core's forwards (``model_runner``: ``paged_forward``
for prompt chunks, the compiled ``decode_step`` over the paged cache for decode batches), and the
output processor turns its tokens into text and events (``output``). ``sequence`` and ``sampler``
hold a request's state and its sampling; ``processors`` its logits adjustments (logit bias, penalties,
min-p, min-tokens); ``logprobs`` scores tokens; ``prefix_cache`` shares cached blocks between requests;
``metrics`` counts what the loop does. The HTTP server (``engine_lib.serve``) is one client of it."""
