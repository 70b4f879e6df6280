"""Serving many users (chapter 12): an OpenAI-compatible HTTP server with continuous batching over
the engine's paged KV cache (``paged_cache``, ``paged_forward`` and ``paged_step`` are in the engine
core: the server runs no forward of its own). ``protocol`` (requests, validation, errors),
``scheduler`` (the loop that owns the model), ``model_runner`` (runs one scheduled batch), ``output``
(tokens to events), ``sampler`` and ``sequence`` (per-request state), ``processors`` (logit bias,
penalties, min-p, min-tokens), ``logprobs``, ``responses`` (response JSON), ``metrics`` (Prometheus
text), ``app`` (FastAPI routes), ``server`` (start it); the load test is ``engine_lib.bench.loadtest``.
Needs the ``serve`` extra (fastapi, uvicorn, httpx, openai) for the HTTP parts only."""
