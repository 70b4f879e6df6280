"""Serving many users (chapter 12): an OpenAI-compatible HTTP server over the engine's token loop
(``engine_lib.loop``: scheduler, runner, output processor, over the paged KV cache of the engine
core; the server runs no forward and makes no token of its own). ``protocol`` (requests, validation,
errors), ``responses`` (response JSON), ``tools`` and ``guided`` / ``grammar`` (tool calls and
constrained output), ``app`` (FastAPI routes), ``server`` (start it); the load test is
``engine_lib.bench.loadtest``. Needs the ``serve`` extra (fastapi, uvicorn, httpx, openai) for the HTTP
parts only."""
