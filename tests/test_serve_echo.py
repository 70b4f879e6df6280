"""Completions' ``echo`` on a one-token prompt, the one prompt with no prefill (it goes straight to
decode): the prompt token is still echoed with its ``null`` logprob, whole and streamed, and
``max_tokens: 0`` still generates nothing. Found while checking what lm-evaluation-harness needs
(tests/test_serve_lm_eval.py); before the fix the answer to
``{"prompt": [151645], "max_tokens": 0, "echo": true, "logprobs": 1}`` was
``text "<|im_end|>悱", tokens ["悱"], token_logprobs [-10.98]`` with one completion token."""

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import NAME, start  # noqa: E402


@pytest.fixture(scope="module")
def http(engines):
    srv = start(engines("kv_cache"))
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    srv.stop()


def whole(http, body: dict) -> tuple[str, dict, int]:
    out = http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    return choice["text"], choice["logprobs"], out["usage"]["completion_tokens"]


def streamed(http, body: dict) -> tuple[str, dict, int]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        text += c["choices"][0]["text"]
        for key in lps:
            lps[key] += c["choices"][0]["logprobs"][key]
    return text, lps, chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("read", [whole, streamed])
@pytest.mark.parametrize("prompt, echo", [([151645], "<|im_end|>"), ("Hi", "Hi")], ids=["ids", "text"])
@pytest.mark.parametrize("max_tokens", [0, 2])
def test_a_one_token_prompt_is_echoed_with_its_logprob(http, read, prompt, echo, max_tokens):
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "temperature": 0}
    text, lps, generated = read(http, body)
    assert generated == max_tokens
    assert text.startswith(echo) and lps["tokens"][0] == echo
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["text_offset"]) == 1 + max_tokens
    assert all(isinstance(v, float) for v in lps["token_logprobs"][1:])
    assert lps["text_offset"][:2] == [0, len(echo)][: 1 + min(max_tokens, 1)]
