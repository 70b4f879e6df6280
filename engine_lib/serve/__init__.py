"""Serving many users (chapter 12): an OpenAI-compatible HTTP server with continuous batching
over a paged KV cache. ``protocol`` (requests, validation, errors), ``paged_cache`` (blocks,
block tables, free list), ``batch_forward`` (one forward over the cache for many sequences),
``sampler`` and ``sequence`` (per-request state), ``scheduler`` (the loop that owns the model),
``processors`` (logit bias, penalties, min-p, min-tokens), ``logprobs``, ``responses`` (response JSON),
``metrics`` (Prometheus text), ``app`` (FastAPI routes), ``server`` (start it); the load test
is ``engine_lib.bench.loadtest``.
Needs the ``serve`` extra (fastapi, uvicorn, httpx, openai) for the HTTP parts only."""
