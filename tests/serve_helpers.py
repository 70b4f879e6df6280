"""Shared by the server tests: a server on the tiny random checkpoint, on 127.0.0.1, and small HTTP helpers."""

import time

import httpx

from engine_lib.serve.metrics import parse
from engine_lib.serve.server import BackgroundServer, ServerOptions, build_state

NAME = "tiny-test"


def start(engine, **options) -> BackgroundServer:
    """A server on ``engine`` (no load); ``options`` are ``ServerOptions`` fields (name, KV cache size, ...)."""
    options = {"served_model_name": NAME, "kv_cache_gib": 0.02, **options}
    opts = ServerOptions(model="unused", **options)
    state, _ = build_state(opts, engine=engine)
    return BackgroundServer(state)


def metrics(url: str, **headers) -> dict:
    return parse(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text)


def wait_for(check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def error_of(response):
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]
