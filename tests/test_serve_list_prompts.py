"""A list prompt larger than the server's queue is a 400 that names ``--max-queue``, not a 429: no
retry could ever make it fit. lm-eval sends ``batch_size`` prompts per request and retries a 429
(tests/test_serve_lm_eval.py); before, ``--max-queue 4`` and five prompts answered 429 "retry later"."""

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import NAME, error_of, metrics, start  # noqa: E402

QUEUE = 4


@pytest.fixture(scope="module")
def http(engines):
    srv = start(engines("kv_cache"), max_queue=QUEUE)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    srv.stop()


def body(prompts: int, n: int = 1) -> dict:
    return {"model": NAME, "prompt": [[17, 488, 220 + i] for i in range(prompts)], "max_tokens": 1, "n": n,
            "echo": True, "logprobs": 1, "temperature": 0}


@pytest.mark.parametrize("prompts, n", [(QUEUE + 1, 1), (3, 2)])
def test_more_sequences_than_the_queue_holds_is_a_400(http, prompts, n):
    r = http.post("/v1/completions", json=body(prompts, n))
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "prompt" and "--max-queue" in err["message"] and str(prompts * n) in err["message"]


def test_as_many_as_the_queue_holds_are_answered(http):
    r = http.post("/v1/completions", json=body(QUEUE))
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(QUEUE))
    counts = metrics(str(http.base_url))
    rejected = [v for key, v in counts.items() if key.startswith("engine_requests_total{") and '"rejected"' in key]
    assert rejected == [0]  # the 400s above are counted as invalid, never as a full queue
