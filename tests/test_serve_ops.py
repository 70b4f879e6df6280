"""Operating the server: the metrics move as requests complete (histograms, successes by finish
reason, the model_name label, the prefix-cache hook), an unexpected exception is OpenAI's error
JSON with a 500 and is counted, and /metrics can be left open to scrapers."""

import json

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import NAME, error_of, metrics, start  # noqa: E402

from engine_lib.loop.metrics import parse  # noqa: E402
from engine_lib.serve import app as app_module  # noqa: E402
from engine_lib.serve.server import BackgroundServer  # noqa: E402


def chat(content, max_tokens, **extra):
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def test_metrics_move_as_requests_complete(server, engine):
    before = metrics(server.url)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat("one", 5), timeout=60).status_code == 200
    first = engine.generate("two", max_new_tokens=1, do_sample=False).token_ids[0]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("two", 5, stop_token_ids=[first]), timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    after = metrics(server.url)

    def moved(key):
        return after[key] - before.get(key, 0)

    assert moved('engine_request_success_total{finished_reason="length"}') == 1
    assert moved('engine_request_success_total{finished_reason="stop"}') == 1
    for h in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "time_to_first_token_seconds"):
        assert moved(f"engine_{h}_count") == 2, h
        assert after[f'engine_{h}_bucket{{le="+Inf"}}'] == after[f"engine_{h}_count"], h
    assert moved("engine_request_generation_tokens_sum") == 5  # 5 + 0 tokens
    assert moved("engine_request_prompt_tokens_sum") == len(engine.encode("one")) + len(engine.encode("two"))
    assert moved("engine_inter_token_latency_seconds_count") == 4  # 5 tokens, 4 gaps; the stopped one has none
    assert moved("engine_e2e_request_latency_seconds_sum") > 0
    labelled = parse(httpx.get(f"{server.url}/metrics").text, keep_model=True)
    assert f'engine_requests_total{{model_name="{NAME}",outcome="completed"}}' in labelled
    assert all(f'model_name="{NAME}"' in key for key in labelled)


def test_prefix_cache_hook_renders_hits_and_queries(server):
    m = server.state.loop.metrics
    before = metrics(server.url)
    m.prefix_cache(hit_tokens=32, query_tokens=48)
    after = metrics(server.url)
    assert after["engine_prefix_cache_hits_total"] - before["engine_prefix_cache_hits_total"] == 32
    assert after["engine_prefix_cache_queries_total"] - before["engine_prefix_cache_queries_total"] == 48


def test_an_unexpected_exception_is_openai_json_and_counted(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "plan_chat", broken)  # a bug while the chat is turned into a prompt
    before = metrics(server.url)['engine_requests_total{outcome="error"}']
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("hi", 2), timeout=30)
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    err = error_of(r)
    assert err["type"] == "internal_error" and "RuntimeError" in err["message"]
    assert metrics(server.url)['engine_requests_total{outcome="error"}'] == before + 1


def test_huge_integers_are_a_400_not_a_500(server):
    for field, value in (("seed", 2**64), ("top_k", 2**63), ("max_tokens", 2**63), ("n", 2**70),
                         ("min_tokens", 2**64)):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("hi", 2) | {field: value}, timeout=30)
        assert r.status_code == 400 and error_of(r)["param"] == field, (field, r.text)


def test_metrics_can_be_open_while_the_rest_needs_the_key(engine):
    with start(engine, api_key="k", metrics_no_auth=True) as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    with start(engine, api_key="k") as srv:
        assert httpx.get(f"{srv.url}/metrics").status_code == 401


def test_a_stopped_server_lets_go_of_its_model_and_kv_cache(tiny_dir):
    """FastAPI keeps served endpoints (and their closures) alive for the process; stop() must still free
    the model and the KV cache, or a notebook that starts a few servers holds a model per server."""
    import gc
    import weakref

    from engine_lib.serve.server import ServerOptions, build_state

    state, engine = build_state(ServerOptions(model=str(tiny_dir), kv_cache_gib=0.01))
    srv = BackgroundServer(state)
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
    model, cache = weakref.ref(engine.model), weakref.ref(state.loop.cache)
    srv.stop()
    del srv, state, engine
    gc.collect()
    assert model() is None and cache() is None


def test_nan_and_infinite_numbers_are_a_400_naming_the_field(server):
    """Python's json reads NaN and Infinity: each is refused by name, never sampled with (nor a 500)."""
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        for value in (float("nan"), float("inf"), float("-inf")):
            body = json.dumps(chat("hi", 2) | {field: value})  # NaN, Infinity: what httpx's json= refuses to send
            r = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=30,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and error_of(r)["param"] == field, (field, value, r.text)


def test_an_engine_rule_on_an_option_is_a_400_naming_it():
    """A value the request model let through but the engine refuses is a 400 naming the option, not a 500."""
    from engine_lib.sampling import SamplingParams
    from engine_lib.serve.protocol import ApiError, CompletionRequest, sampling_for

    req = CompletionRequest.model_construct(prompt="x", repetition_penalty=float("inf"))  # skips the validation
    with pytest.raises(ApiError) as info:
        sampling_for(req, SamplingParams(), vocab_size=100)
    assert info.value.status == 400 and info.value.param == "repetition_penalty" and "inf" in info.value.message
