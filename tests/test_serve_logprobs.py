"""Logprobs you can trust: the server's values are the engine's own full forward, log-softmaxed
(the raw distribution, before temperature and penalties), for generated tokens (chat and
completions, whole and streamed) and for echoed prompt tokens; at temperature 0 the top one is the
chosen token. On the tiny random checkpoint, in fp32 and in bf16 (half-precision tolerance)."""

import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from serve_helpers import NAME, start  # noqa: E402

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2}  # bf16 keeps 8 bits of mantissa: ~0.4% per logit


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request, engines):
    engine = engines("kv_cache", dtype=request.param)
    srv = start(engine)
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield engine, client, TOLERANCE[request.param]
    srv.stop()


def reference(engine, ids: list[int]) -> torch.Tensor:
    return engine.logits(ids).log_softmax(dim=-1)


def test_generated_token_logprobs_equal_the_engine_forward(setup):
    engine, http, tol = setup
    ids = engine.tokenizer.encode("servers batch many users at once", add_special_tokens=False)
    out = http.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 8, "temperature": 0,
                                             "logprobs": 5}).json()
    lp = out["choices"][0]["logprobs"]
    got_ids = [engine.tokenizer.convert_tokens_to_ids(t) for t in _pieces(engine, lp["tokens"])]
    ref = reference(engine, ids + got_ids)
    for i, token in enumerate(got_ids):
        row = ref[len(ids) - 1 + i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[token]), abs=tol)
        assert int(row.argmax()) == token  # temperature 0: the chosen token is the most likely one
        best = max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get)
        assert best == lp["tokens"][i]
        top5 = row.topk(5).values.tolist()
        assert sorted(lp["top_logprobs"][i].values(), reverse=True)[:5] == pytest.approx(top5, abs=tol)


def test_sampled_logprobs_are_of_the_raw_distribution(setup):
    """With temperature and a penalty the token is drawn from a changed distribution; the logprob
    reported is still the model's own (vLLM's default)."""
    engine, http, tol = setup
    out = http.post("/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "a lazy dog"}], "max_tokens": 6, "temperature": 1.7,
        "seed": 4, "frequency_penalty": 1.0, "logprobs": True}).json()
    content = out["choices"][0]["logprobs"]["content"]
    got_ids = [engine.tokenizer.convert_tokens_to_ids(_piece(bytes(e["bytes"]))) for e in content]
    ids = engine.encode("a lazy dog")
    ref = reference(engine, ids + got_ids)
    want = [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(got_ids)]
    assert [e["logprob"] for e in content] == pytest.approx(want, abs=tol)


def test_chat_stream_logprobs_equal_whole_and_the_engine(setup):
    engine, http, tol = setup
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-6)
    prompt = engine.encode("Hello there")
    tokens = engine.generate(prompt, max_new_tokens=6, do_sample=False).token_ids
    ref = reference(engine, prompt + tokens)
    assert [e["logprob"] for e in whole] == pytest.approx(
        [float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)], abs=tol)


def test_echoed_prompt_logprobs_equal_the_engine_forward(setup):
    engine, http, tol = setup
    ids = engine.tokenizer.encode("the quick brown fox jumps over a lazy dog " * 3, add_special_tokens=False)
    out = http.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                             "logprobs": 2}).json()
    lp = out["choices"][0]["logprobs"]
    ref = reference(engine, ids)
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                     abs=tol)
    with http.stream("POST", "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True,
                                                      "logprobs": 2, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)


def _piece(raw: bytes) -> str:
    """A token's bytes -> the tokenizer's byte-level piece (what convert_tokens_to_ids reads)."""
    from engine_lib.loop.logprobs import _byte_of_char

    char_of = {b: c for c, b in _byte_of_char().items()}
    return "".join(char_of[b] for b in raw)


def _pieces(engine, tokens: list[str]) -> list[str]:
    """Token texts (whole characters here: greedy on this prompt) -> byte-level pieces."""
    return [_piece(t.encode()) for t in tokens]


def test_prompt_logprobs_over_chunked_prefill_equal_one_chunk(engines):
    """A prompt prefilled in chunks of 8 gets every position's logprob, as one chunk does."""
    engine = engines("kv_cache")
    ids = engine.tokenizer.encode("servers batch many users at once while the dog sleeps " * 3,
                                  add_special_tokens=False)
    body = {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    got = []
    for chunk in (8, 256):
        with start(engine, prefill_chunk=chunk) as srv:
            got.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0])
    assert len(ids) > 24 and len(got[0]["logprobs"]["tokens"]) == len(ids) + 2
    assert got[0]["text"] == got[1]["text"]
    assert got[0]["logprobs"]["token_logprobs"][1:] == pytest.approx(got[1]["logprobs"]["token_logprobs"][1:],
                                                                      abs=1e-3)


def test_openai_client_reads_logprobs_n_and_echo(engines):
    """OpenAI's own client parses what we send: chat logprobs, n choices, echoed list prompts."""
    openai = pytest.importorskip("openai")
    engine = engines("kv_cache")
    with start(engine) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                             temperature=0, logprobs=True, top_logprobs=2, n=2)
        assert [c.index for c in out.choices] == [0, 1]
        assert out.choices[0].message.content == out.choices[1].message.content  # greedy: the same twice
        content = out.choices[0].logprobs.content
        assert len(content) == 4 and all(e.top_logprobs[0].token == e.token for e in content)
        prompts = [engine.tokenizer.encode(s, add_special_tokens=False) for s in ("one two three", "four five")]
        comp = client.completions.create(model=NAME, prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
        assert [len(c.logprobs.tokens) for c in comp.choices] == [len(p) + 1 for p in prompts]
        assert all(c.logprobs.token_logprobs[0] is None for c in comp.choices)
