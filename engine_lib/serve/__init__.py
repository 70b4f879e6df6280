"""Chapters 12 and 13: an OpenAI-compatible HTTP server over the token loop (``engine_lib.loop``).

The server runs no forward and makes no token of its own. ``protocol`` (requests, validation, errors),
``responses`` (response JSON), ``tools`` and ``guided`` / ``grammar`` (tool calls and constrained output),
``app`` (FastAPI routes), ``server`` (start it); the load test is ``engine_lib.bench.loadtest``. Needs the
``serve`` extra (fastapi, uvicorn, httpx, openai) for the HTTP parts only."""
