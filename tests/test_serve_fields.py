"""Every field the request models declare works (a test of its behaviour) or is refused with a 400
that names it: nothing is accepted and silently ignored. ``test_every_field_is_honoured_or_rejected``
holds each field to one of the two sets, and each set entry to a test in this module."""

import json
import sys

import httpx
import pytest
import torch

pytest.importorskip("fastapi")

from serve_helpers import NAME, error_of, tie_or_equal  # noqa: E402

from engine_lib.serve.protocol import ChatCompletionRequest, CompletionRequest, _Common, check_lengths  # noqa: E402
from engine_lib.serve.tools import render_chat  # noqa: E402

# field -> the test that shows it working
HONOURED = {
    "model": "test_model_is_optional_and_checked",
    "max_tokens": "test_max_tokens_and_max_completion_tokens",
    "max_completion_tokens": "test_max_tokens_and_max_completion_tokens",
    "temperature": "test_sampling_option_equals_engine_generate",
    "top_p": "test_sampling_option_equals_engine_generate",
    "top_k": "test_top_k_minus_one_is_off_and_bounds_are_checked",
    "min_p": "test_min_p_one_keeps_only_the_top_token",
    "repetition_penalty": "test_sampling_option_equals_engine_generate",
    "presence_penalty": "test_presence_and_frequency_penalties_follow_openai",
    "frequency_penalty": "test_presence_and_frequency_penalties_follow_openai",
    "logit_bias": "test_logit_bias_forces_a_token",
    "seed": "test_sampling_option_equals_engine_generate",
    "stop": "test_many_stop_strings_and_include_stop_str",
    "include_stop_str_in_output": "test_many_stop_strings_and_include_stop_str",
    "stop_token_ids": "test_stop_token_ids_and_min_tokens",
    "min_tokens": "test_stop_token_ids_and_min_tokens",
    "ignore_eos": "test_ignore_eos_keeps_going_past_eos",
    "stream": "test_stream_equals_whole_with_logprobs_and_usage",
    "stream_options": "test_stream_equals_whole_with_logprobs_and_usage",
    "n": "test_n_choices_use_seed_plus_index",
    "user": "test_user_and_parallel_tool_calls_are_accepted_no_ops",
    "parallel_tool_calls": "test_tools_tool_choice_and_response_format_are_honoured",
    "tools": "test_tools_tool_choice_and_response_format_are_honoured",
    "tool_choice": "test_tools_tool_choice_and_response_format_are_honoured",
    "response_format": "test_tools_tool_choice_and_response_format_are_honoured",
    "messages": "test_tool_call_history_messages_are_accepted",
    "logprobs": "test_chat_logprobs_shape_and_top_is_chosen",
    "top_logprobs": "test_chat_logprobs_shape_and_top_is_chosen",
    "prompt": "test_list_prompts_give_one_choice_each_in_order",
    "echo": "test_echo_gives_prompt_logprobs_for_loglikelihood",
}
# field -> the test that sends what is not supported and gets a 400 naming the field
REJECTED = {
    "best_of": "test_unsupported_values_are_a_400_naming_the_field",
    "suffix": "test_unsupported_values_are_a_400_naming_the_field",
}
UNSUPPORTED = [  # (route, field, value) for the rejected fields
    ("chat", "best_of", 2),
    ("completions", "suffix", "the end"),
]


def test_every_field_is_honoured_or_rejected():
    fields = set(_Common.model_fields) | set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    unaccounted = fields - set(HONOURED) - set(REJECTED)
    assert not unaccounted, f"request fields with no test of their behaviour and no 400: {sorted(unaccounted)}"
    assert not (set(HONOURED) | set(REJECTED)) - fields, "the sets name fields the models no longer have"
    module = sys.modules[__name__]
    missing = {t for t in [*HONOURED.values(), *REJECTED.values()] if not callable(getattr(module, t, None))}
    assert not missing, f"tests named in HONOURED/REJECTED that do not exist: {missing}"
    assert {f for _, f, _ in UNSUPPORTED} == set(REJECTED)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


PROMPT_TEXT = "the quick brown fox jumps"


def post(http, route, status=200, **body):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if route == "chat":
        body.setdefault("messages", [{"role": "user", "content": PROMPT_TEXT}])
    else:
        body.setdefault("prompt", PROMPT_TEXT)
    body.setdefault("model", NAME)
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def prompt_ids(engine, text=PROMPT_TEXT):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def greedy_ref(engine, ids, n, adjust=lambda logits, out: logits):
    """Greedy tokens from the engine's own full forward, with ``adjust`` applied to each step's logits."""
    out = []
    for _ in range(n):
        logits = adjust(engine.logits(ids + out)[-1].clone(), out)
        out.append(int(logits.argmax()))
    return out


def texts(out):
    return [c.get("text", c.get("message", {}).get("content")) for c in out["choices"]]


def test_model_is_optional_and_checked(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == NAME
    r = http.post("/v1/chat/completions", json={**body, "model": "other"})
    assert r.status_code == 404 and error_of(r)["param"] == "model"


def test_nulls_are_accepted_for_every_optional_field(http):
    for route, kind in (("chat", ChatCompletionRequest), ("completions", CompletionRequest)):
        required = {"messages", "prompt"}
        body = {name: None for name in kind.model_fields if name not in required}
        body["max_tokens"] = 3
        body["temperature"] = 0
        out = post(http, route, **body)
        assert out["usage"]["completion_tokens"] == 3


def test_max_tokens_and_max_completion_tokens(http):
    out = post(http, "chat", max_tokens=3, temperature=0)
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"
    out = post(http, "chat", max_tokens=3, max_completion_tokens=5, temperature=0)
    assert out["usage"]["completion_tokens"] == 5  # max_completion_tokens wins, as in vLLM
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 2**64}))
    assert err["param"] == "max_tokens"
    # no max_tokens: all the room the context (and the cache) leaves
    assert check_lengths(10, None, context=100, cache_tokens=1000) == 90
    assert check_lengths(10, None, context=100, cache_tokens=50) == 40


@pytest.mark.parametrize("option", [dict(temperature=1.3, seed=5), dict(temperature=0.9, top_p=0.5, seed=6),
                                    dict(temperature=0, repetition_penalty=1.5)])
def test_sampling_option_equals_engine_generate(engine, http, option):
    ids = prompt_ids(engine)
    out = post(http, "completions", prompt=ids, max_tokens=8, top_k=0, **option)
    options = dict(top_k=0, do_sample=option["temperature"] > 0,
                   **{k: v for k, v in option.items() if k != "temperature" or v > 0})
    want = engine.generate(ids, max_new_tokens=8, **options).token_ids
    params = engine.sampling(**options)
    [served] = texts(out)
    # up to a tie: the server reads a longer span of the cache (other last bits in its logits)
    assert tie_or_equal(engine, ids, want, served, params), (served, engine.tokenizer.decode(want))


def test_top_k_minus_one_is_off_and_bounds_are_checked(engine, http):
    ids = prompt_ids(engine)
    off = post(http, "completions", prompt=ids, max_tokens=8, temperature=1.0, seed=3, top_k=0)
    minus_one = post(http, "completions", prompt=ids, max_tokens=8, temperature=1.0, seed=3, top_k=-1)
    k1 = post(http, "completions", prompt=ids, max_tokens=8, temperature=1.0, seed=3, top_k=1)
    assert texts(off) == texts(minus_one)
    assert texts(k1) == texts(post(http, "completions", prompt=ids, max_tokens=8, temperature=0))  # top-1 = greedy
    for bad in (2**63, engine.config.vocab_size + 1, -2):
        r = http.post("/v1/completions", json={"prompt": "x", "top_k": bad})
        assert r.status_code == 400 and error_of(r)["param"] == "top_k", r.text
    r = http.post("/v1/completions", json={"prompt": "x", "seed": 2**64})
    assert r.status_code == 400 and error_of(r)["param"] == "seed"


def test_min_p_one_keeps_only_the_top_token(engine, http):
    ids = prompt_ids(engine)
    greedy = texts(post(http, "completions", prompt=ids, max_tokens=8, temperature=0))
    hot = dict(prompt=ids, max_tokens=8, temperature=2.0, top_k=0, top_p=1.0, seed=9)
    assert texts(post(http, "completions", min_p=1.0, **hot)) == greedy
    assert texts(post(http, "completions", **hot)) != greedy  # the random tiny model at T=2 wanders


def test_presence_and_frequency_penalties_follow_openai(engine, http):
    ids = prompt_ids(engine)
    for presence, frequency in ((2.0, 0.0), (0.0, 2.0), (-1.0, 1.5)):
        def adjust(logits, out, presence=presence, frequency=frequency):
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            return logits - presence * (counts > 0) - frequency * counts

        out = post(http, "completions", prompt=ids, max_tokens=10, temperature=0, logprobs=0,
                   presence_penalty=presence, frequency_penalty=frequency)
        want = greedy_ref(engine, ids, 10, adjust)
        assert out["choices"][0]["text"] == engine.tokenizer.decode(want), (presence, frequency)
    plain = greedy_ref(engine, ids, 10)
    assert engine.tokenizer.decode(plain) != out["choices"][0]["text"], "the penalty was meant to change the output"


def test_logit_bias_forces_a_token(engine, http):
    ids = prompt_ids(engine)
    token = prompt_ids(engine, " fox")[0]
    out = post(http, "completions", prompt=ids, max_tokens=4, temperature=0, logit_bias={str(token): 100})
    assert out["choices"][0]["text"] == engine.tokenizer.decode([token] * 4)
    for bad in ({"abc": 1}, {"-1": 1}, {str(token): 101}):
        r = http.post("/v1/completions", json={"prompt": "x", "logit_bias": bad})
        assert r.status_code == 400 and error_of(r)["param"] == "logit_bias", r.text


def test_many_stop_strings_and_include_stop_str(engine, http):
    ids = prompt_ids(engine)
    text = post(http, "completions", prompt=ids, max_tokens=24, temperature=0)["choices"][0]["text"]
    at = next(i for i in range(len(text) // 3, len(text) - 3) if text[i:i + 3].isascii() and text[i:i + 3].isalnum())
    stop = text[at:at + 3]
    stops = [f"never-{i}" for i in range(9)] + [stop]  # more than OpenAI's 4
    cut = post(http, "completions", prompt=ids, max_tokens=24, temperature=0, stop=stops)["choices"][0]
    kept = post(http, "completions", prompt=ids, max_tokens=24, temperature=0, stop=stops,
                include_stop_str_in_output=True)["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"
    assert cut["text"] == text[:text.find(stop)] and kept["text"] == text[:text.find(stop)] + stop
    r = http.post("/v1/completions", json={"prompt": "x", "stop": [str(i) for i in range(65)]})
    assert r.status_code == 400 and error_of(r)["param"] == "stop"


def test_stop_token_ids_and_min_tokens(engine, http):
    ids = prompt_ids(engine)
    first = greedy_ref(engine, ids, 1)[0]
    out = post(http, "completions", prompt=ids, max_tokens=6, temperature=0, stop_token_ids=[first])
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    out = post(http, "completions", prompt=ids, max_tokens=6, temperature=0, stop_token_ids=[first], min_tokens=3,
               logprobs=0)
    got = [engine.tokenizer.convert_tokens_to_ids(t) for t in out["choices"][0]["logprobs"]["tokens"]]
    assert out["usage"]["completion_tokens"] >= 3 and first not in got[:3]

    def masked(logits, out_so_far):
        if len(out_so_far) < 3:
            logits[first] = float("-inf")
        return logits

    want = greedy_ref(engine, ids, 6, masked)
    stop_at = next((i for i, t in enumerate(want) if t == first and i >= 3), len(want))
    assert out["choices"][0]["text"] == engine.tokenizer.decode(want[:stop_at])
    # stop strings do not stop it before min_tokens either
    text = post(http, "completions", prompt=ids, max_tokens=6, temperature=0)["choices"][0]["text"]
    stop = text.strip()[0]
    early = post(http, "completions", prompt=ids, max_tokens=6, temperature=0, stop=[stop])
    late = post(http, "completions", prompt=ids, max_tokens=6, temperature=0, stop=[stop], min_tokens=4)
    assert early["usage"]["completion_tokens"] < 4 <= late["usage"]["completion_tokens"]


def test_ignore_eos_keeps_going_past_eos(engine, http):
    eos = engine.defaults.stop_token_ids[0]
    forced = dict(prompt=prompt_ids(engine), max_tokens=4, temperature=0, logit_bias={str(eos): 100})
    out = post(http, "completions", **forced)
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    out = post(http, "completions", ignore_eos=True, **forced)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4


def test_stream_equals_whole_with_logprobs_and_usage(http):
    body = dict(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = post(http, "chat", **body)
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": NAME, "messages": [{"role": "user", "content": PROMPT_TEXT}], "stream": True,
                           "stream_options": {"include_usage": True}, **body}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert text == whole["choices"][0]["message"]["content"]
    # the second request finds the first one's prompt blocks cached (prefix caching) and computes only the rest of
    # its prompt, in sums of another shape: the same tokens, logprobs equal to float rounding (this test alone
    # shows it; after other requests the blocks may be gone)
    want = whole["choices"][0]["logprobs"]["content"]
    assert same_tokens(content) == same_tokens(want)
    assert logprob_values(content) == pytest.approx(logprob_values(want), rel=1e-5, abs=1e-5)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def same_tokens(entries: list[dict]) -> list:
    """Each entry's token and bytes, and its top alternatives' (no logprob values)."""
    return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]


def logprob_values(entries: list[dict]) -> list[float]:
    return [v for e in entries for v in [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]]



def streamed(http, route, **body):
    """The JSON chunks of a streamed request (``post``'s defaults), in order."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    key, value = ("messages", [{"role": "user", "content": PROMPT_TEXT}]) if route == "chat" else ("prompt", PROMPT_TEXT)
    with http.stream("POST", path, json={"model": NAME, key: value, "stream": True, **body}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http, route):
    """As vLLM: each chunk's usage counts the tokens generated so far, one logprob per token; the last
    choice chunk's (and the usage chunk's) is the whole answer's. Without include_usage it still works."""
    body = dict(max_tokens=6, temperature=0, logprobs=True if route == "chat" else 0)
    whole = post(http, route, **body)
    chunks = streamed(http, route, stream_options={"include_usage": True, "continuous_usage_stats": True}, **body)
    *with_choices, usage_only = chunks
    assert usage_only["choices"] == [] and usage_only["usage"] == whole["usage"]
    assert all("usage" in c for c in with_choices) and with_choices[-1]["usage"] == whole["usage"]
    seen = 0  # tokens streamed so far, counted by their logprobs
    for c in with_choices:
        lps = c["choices"][0]["logprobs"]
        seen += len(lps["content"] if route == "chat" else lps["tokens"]) if lps else 0
        assert c["usage"] == {"prompt_tokens": whole["usage"]["prompt_tokens"], "completion_tokens": seen,
                              "total_tokens": whole["usage"]["prompt_tokens"] + seen}
    alone = streamed(http, route, stream_options={"continuous_usage_stats": True}, **body)
    assert [c["usage"] for c in alone] == [c["usage"] for c in with_choices]  # no usage-only chunk


def test_continuous_usage_stats_count_every_choice_and_prompt(http):
    """Several prompts and choices: the usage so far is the request's, ending at the whole answer's."""
    body = dict(prompt=[PROMPT_TEXT, "a lazy dog"], n=2, max_tokens=5, temperature=0)
    whole = post(http, "completions", **body)
    chunks = streamed(http, "completions", stream_options={"continuous_usage_stats": True}, **body)
    done = [u["completion_tokens"] for u in (c["usage"] for c in chunks)]
    assert done == sorted(done) and chunks[-1]["usage"] == whole["usage"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {whole["usage"]["prompt_tokens"]}


def test_n_choices_use_seed_plus_index(engine, http):
    ids = prompt_ids(engine)
    sample = dict(prompt=ids, max_tokens=8, temperature=1.0, top_k=0)
    out = post(http, "completions", n=3, seed=11, **sample)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    alone = [texts(post(http, "completions", seed=11 + i, **sample))[0] for i in range(3)]
    assert texts(out) == alone and len(set(alone)) == 3
    assert out["usage"]["prompt_tokens"] == len(ids)  # the prompt counts once
    assert out["usage"]["completion_tokens"] == 24
    with http.stream("POST", "/v1/completions", json={"n": 2, "seed": 11, "stream": True, **sample}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                for i in range(2)]
    assert streamed == alone[:2]


def test_user_and_parallel_tool_calls_are_accepted_no_ops(http):
    plain = post(http, "chat", max_tokens=4, temperature=0)
    same = post(http, "chat", max_tokens=4, temperature=0, user="someone", parallel_tool_calls=False,
                tool_choice="none", response_format={"type": "text"}, best_of=1)
    assert texts(same) == texts(plain)


def test_tools_tool_choice_and_response_format_are_honoured(http):
    """Each in brief here; tests/test_serve_tools.py and tests/test_serve_grammar.py hold the details."""
    pick = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["n"],
        "additionalProperties": False}}}
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    # required + parallel_tool_calls false: exactly one call, to an offered function, with valid arguments
    out = post(http, "chat", max_tokens=40, temperature=1, seed=5, tools=[pick, other], tool_choice="required",
               parallel_tool_calls=False)["choices"][0]
    assert out["finish_reason"] == "tool_calls" and len(out["message"]["tool_calls"]) == 1
    call = out["message"]["tool_calls"][0]["function"]
    assert call["name"] in ("pick", "other") and isinstance(json.loads(call["arguments"]), dict)
    # a named choice: that function
    out = post(http, "chat", max_tokens=40, temperature=1, seed=6, tools=[pick, other],
               tool_choice={"type": "function", "function": {"name": "pick"}})["choices"][0]
    assert [c["function"]["name"] for c in out["message"]["tool_calls"]] == ["pick"]
    assert 1 <= json.loads(out["message"]["tool_calls"][0]["function"]["arguments"])["n"] <= 3
    # none: no tool section, the same prompt as without tools
    none = post(http, "chat", max_tokens=4, temperature=0, tools=[pick], tool_choice="none")
    assert none["usage"]["prompt_tokens"] == post(http, "chat", max_tokens=4, temperature=0)["usage"]["prompt_tokens"]
    assert post(http, "chat", max_tokens=4, temperature=0, tools=[pick])["usage"]["prompt_tokens"] > \
        none["usage"]["prompt_tokens"]  # auto: the tool section is in the prompt
    # response_format json_schema: the answer follows the schema
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = post(http, "chat", max_tokens=20, temperature=1, seed=7,
               response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert isinstance(json.loads(texts(out)[0])["ok"], bool)


def test_tool_call_history_messages_are_accepted(engine, http):
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = post(http, "chat", messages=messages, max_tokens=3, temperature=0)
    rendered = render_chat(engine.tokenizer, [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert out["usage"]["prompt_tokens"] == len(rendered)
    assert "sunny, 21 C" in engine.tokenizer.decode(rendered)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and "messages" in error_of(r)["param"]


def test_chat_logprobs_shape_and_top_is_chosen(http):
    out = post(http, "chat", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the chosen one is the most likely
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                      reverse=True)
    assert "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in content) == out["choices"][0]["message"]["content"]
    assert post(http, "chat", max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                "top_logprobs": 21})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"


def test_list_prompts_give_one_choice_each_in_order(engine, http):
    strings = ["one two", "three four five", "six"]
    out = post(http, "completions", prompt=strings, max_tokens=4, temperature=0)
    alone = [texts(post(http, "completions", prompt=s, max_tokens=4, temperature=0))[0] for s in strings]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and texts(out) == alone
    token_lists = [prompt_ids(engine, s) for s in strings]
    assert texts(post(http, "completions", prompt=token_lists, max_tokens=4, temperature=0)) == alone
    assert post(http, "completions", prompt=token_lists, max_tokens=4, temperature=0)["usage"]["prompt_tokens"] == \
        sum(map(len, token_lists))
    r = http.post("/v1/completions", json={"prompt": [[1, 2], [engine.config.vocab_size]]})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"


def test_echo_gives_prompt_logprobs_for_loglikelihood(engine, http):
    ids = prompt_ids(engine)
    out = post(http, "completions", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == engine.tokenizer.decode(ids) and out["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = engine.logits(ids).log_softmax(-1)
    want = [float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=2e-3)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # echo with a generated token too: the prompt's logprobs, then the new token's, text and offsets continuous
    gen = post(http, "completions", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)["choices"][0]
    assert gen["logprobs"]["token_logprobs"][:-1] == lp["token_logprobs"]
    assert gen["text"].startswith(choice["text"]) and len(gen["logprobs"]["tokens"]) == len(ids) + 1
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"


@pytest.mark.parametrize("route, field, value", UNSUPPORTED)
def test_unsupported_values_are_a_400_naming_the_field(http, route, field, value):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = {"messages": [{"role": "user", "content": "x"}]} if route == "chat" else {"prompt": "x"}
    r = http.post(path, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == field and field in err["message"], err
