"""The HTTP server in-process on 127.0.0.1 (a free port): OpenAI's client, SSE streaming, every
error case with OpenAI's error JSON, auth, the queue limit, and a client that disconnects."""

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import NAME, error_of, metrics, start, wait_for  # noqa: E402

from engine_lib.loop.metrics import parse  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while servers batch many users at once".split()


def chat(content, max_tokens=12, **extra):
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def solo_text(engine, content, n):
    return engine.generate(content, max_new_tokens=n, do_sample=False).text


def test_openai_client_non_streaming_and_streaming(server, engine):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [NAME]
    want = solo_text(engine, "Hello there!", 12)
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello there!"}],
                                         max_tokens=12, temperature=0)
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(engine.encode("Hello there!")) and out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello there!"}],
                                                max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == want and usage.completion_tokens == 12
    comp = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    ids = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert comp.choices[0].text == engine.generate(ids, max_new_tokens=6, do_sample=False).text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)


def test_sse_stream_format_ends_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat("Stream!", 5, stream=True),
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5


def test_sixteen_concurrent_http_requests_equal_solo(server, engine):
    rng = random.Random(0)
    contents = [" ".join(rng.choices(WORDS, k=rng.randint(1, 50))) for _ in range(16)]
    lengths = [6 + (5 * i) % 11 for i in range(16)]
    want = [solo_text(engine, c, n) for c, n in zip(contents, lengths)]

    async def one(client, i):
        await asyncio.sleep(0.01 * (i % 5))  # arrivals spread out
        r = await client.post("/v1/chat/completions", json=chat(contents[i], lengths[i], stream=i % 2 == 0))
        assert r.status_code == 200, r.text
        if i % 2:
            return r.json()["choices"][0]["message"]["content"]
        text = ""
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    assert asyncio.run(main()) == want
    m = metrics(server.url)
    assert m["engine_kv_blocks_free"] == m["engine_kv_blocks_total"]


def test_tiny_kv_cache_queues_and_preempts_over_http(engine):
    contents = [" ".join(random.Random(i).choices(WORDS, k=12 + 3 * i)) for i in range(6)]
    # each request (a 3-4 block prompt, then 96 tokens) ends at 9-10 blocks, so any two requests that
    # run at the same time outgrow the 14 blocks and one of them is preempted
    want = [solo_text(engine, c, 96) for c in contents]
    per_block = 16 * 2 * engine.config.num_hidden_layers * engine.config.num_key_value_heads * engine.config.head_dim * 4
    with start(engine, kv_cache_gib=(2 + 14) * per_block / 2**30) as srv:  # 14 usable blocks

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
                rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(c, 96)) for c in contents))
            return [r.json()["choices"][0]["message"]["content"] for r in rs]

        got = asyncio.run(main())
        m = metrics(srv.url)
    assert got == want
    assert m["engine_kv_blocks_total"] == 14 and m["engine_kv_blocks_free"] == 14
    assert m["engine_preemptions_total"] > 0 and m['engine_requests_total{outcome="completed"}'] == 6


@pytest.mark.parametrize("body, status, code, needle", [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b"[1, 2]", 400, "invalid_json", "JSON object"),
    (json.dumps({"model": NAME, "max_tokens": 4}).encode(), 400, "missing_required_parameter", "messages"),
    (json.dumps({"model": NAME, "messages": "hi"}).encode(), 400, "invalid_value", "messages"),
    (json.dumps(chat("hi", max_tokens="many")).encode(), 400, "invalid_value", "max_tokens"),
    (json.dumps(chat("hi", temperature="hot")).encode(), 400, "invalid_value", "temperature"),
    (json.dumps({**chat("hi"), "model": "gpt-4o"}).encode(), 404, "model_not_found", "gpt-4o"),
    (json.dumps(chat("hi", max_tokens=0)).encode(), 400, "invalid_value", "max_tokens must be at least 1"),
    (json.dumps(chat("hi", max_tokens=-3)).encode(), 400, "invalid_value", "-3"),
    (json.dumps(chat("hi", n=17)).encode(), 400, "invalid_value", "n"),
])
def test_bad_requests_get_openai_error_json(server, body, status, code, needle):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["code"] == code and needle in err["message"], err


def test_context_overflow_names_both_numbers(server, engine):
    prompt_tokens = len(engine.encode("hi"))
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("hi", max_tokens=40000))
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "context_length_exceeded"
    assert str(prompt_tokens) in err["message"] and "40000" in err["message"], err["message"]


def test_body_over_one_mib_is_413(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat("x" * (1 << 20)))
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_unknown_route_is_openai_style_404(server):
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and error_of(r)


def test_api_key_guards_every_route_but_health(engine):
    with start(engine, api_key="s3cret") as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{srv.url}{path}").status_code == 401
            r = httpx.get(f"{srv.url}{path}", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
            assert httpx.get(f"{srv.url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat("hi", 2))
        assert r.status_code == 401
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(**chat("hi", 2)).usage.completion_tokens == 2


def test_full_queue_is_429_with_retry_after(engine):
    with start(engine, max_batch=1, max_queue=1) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            with client.stream("POST", "/v1/chat/completions", json=chat("busy", 4000, stream=True)) as first:
                wait_for(lambda: metrics(srv.url)["engine_requests_running"] == 1)
                with client.stream("POST", "/v1/chat/completions", json=chat("queued", 4000, stream=True)) as second:
                    wait_for(lambda: metrics(srv.url)["engine_requests_waiting"] == 1)
                    third = httpx.post(f"{srv.url}/v1/chat/completions", json=chat("one too many", 4))
                    assert third.status_code == 429 and third.headers["retry-after"].isdigit()
                    assert error_of(third)["type"] == "rate_limit_error"
                    assert first.status_code == 200 and second.status_code == 200
        m = {}
        wait_for(lambda: m.update(metrics(srv.url)) or m["engine_kv_blocks_free"] == m["engine_kv_blocks_total"])
        assert m['engine_requests_total{outcome="rejected"}'] == 1
        assert m['engine_requests_total{outcome="cancelled"}'] == 2


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    before = metrics(server.url)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat("keep talking", 3000, stream=True),
                      timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got == 4:
                during = metrics(server.url)
                assert during["engine_kv_blocks_free"] < during["engine_kv_blocks_total"]
                assert during["engine_requests_running"] == 1
                break  # leaving the loop closes the connection, mid-stream
    m = {}
    wait_for(lambda: m.update(metrics(server.url)) or (m["engine_kv_blocks_free"] == m["engine_kv_blocks_total"]
                                                       and m["engine_requests_running"] == 0))
    key = 'engine_requests_total{outcome="cancelled"}'
    assert m[key] == before[key] + 1
    assert m["engine_generation_tokens_total"] - before["engine_generation_tokens_total"] < 3000


def test_metrics_are_prometheus_text(server):
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("engine_requests_total", "engine_prompt_tokens_total", "engine_generation_tokens_total",
                 "engine_time_to_first_token_seconds_bucket", "engine_requests_running", "engine_requests_waiting",
                 "engine_kv_blocks_free"):
        assert name in text
    assert "# TYPE engine_time_to_first_token_seconds histogram" in text
    m = parse(text)
    assert m['engine_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["engine_time_to_first_token_seconds_count"]


def test_head_metrics_answers_like_get_with_no_body(server, engine):
    """Monitors probe with HEAD: the same status and headers as GET, no body; the key rules are GET's."""
    get, head = httpx.get(f"{server.url}/metrics"), httpx.head(f"{server.url}/metrics")
    assert head.status_code == 200 and head.content == b""
    assert set(head.headers) == set(get.headers) and head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) > 0
    with start(engine, api_key="k") as srv:
        assert httpx.head(f"{srv.url}/metrics").status_code == 401
        assert httpx.head(f"{srv.url}/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
    with start(engine, api_key="k", metrics_no_auth=True) as srv:
        assert httpx.head(f"{srv.url}/metrics").status_code == 200
