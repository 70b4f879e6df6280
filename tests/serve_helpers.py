"""Shared by the server tests: a server on the tiny random checkpoint, on 127.0.0.1, and small HTTP helpers."""

import time

import httpx

from engine_lib.loop.metrics import parse
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


def tie_or_equal(engine, ids: list[int], want: list[int], served: str, params, rel: float = 1e-5) -> bool:
    """True when ``served`` (a served reply's text) is the text of ``want`` (``Engine.generate``'s tokens),
    or first leaves it at a token whose logit (after the repetition penalty) is within ``rel`` of the largest
    |logit| of ``want``'s token there: a tie that the last bits decide.

    The server reads a longer, masked span of the cache than ``Engine.generate`` does, so its fp32 logits
    can differ in their last bits. Greedy then breaks a tie the other way; sampling too, since the seeded
    noise goes to the candidates by rank (chapter 09), and two candidates that close can swap ranks."""
    import torch

    from engine_lib.sampling import apply_repetition_penalty

    tok = engine.tokenizer
    text = lambda toks: tok.decode(toks, skip_special_tokens=True).rstrip("\ufffd")  # noqa: E731 (no half chars)
    if served == text(want):
        return True
    i = next((k for k in range(len(want)) if not served.startswith(text(want[:k + 1]))), None)
    if i is None:
        return False  # the served text goes on past want's end
    logits = engine.logits(ids + want[:i])[-1:]  # (1, vocab) fp32: the scores of token i
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[0, ids + want[:i]] = True
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)[0]
    close = ((logits - logits[want[i]]).abs() <= rel * float(logits.abs().max())).nonzero().flatten().tolist()
    return any(served.startswith(text(want[:i] + [t])) for t in close if t != want[i])
