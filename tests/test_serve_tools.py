"""Tool calls: the Qwen2.5 chat template's tool section, and the ``<tool_call>`` parser on
recorded strings (whole and streamed in every split), malformed output as plain content."""

import json

import pytest

from engine_lib.model.tokenizer import load_tokenizer
from engine_lib.serve.tools import ToolCallStream, parse_tool_calls, render_chat, template_message

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}

# written as Qwen2.5-Instruct writes them (its template's own format, newline-separated blocks)
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO = (ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
TEXT_THEN_CALL = "Let me look that up.\n" + ONE
UNICODE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}\n</tool_call>'
BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'
UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
ARGS_AS_STRING = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_tools_go_through_the_template_tool_section(tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    text = text_of(tok, render_chat(tok, msgs, [WEATHER, TIME]))
    assert "# Tools" in text and "<tools>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice none: no tool section at all, the same prompt as without tools
    assert render_chat(tok, msgs, [WEATHER], "none") == render_chat(tok, msgs)
    assert "# Tools" not in text_of(tok, render_chat(tok, msgs, [WEATHER], "none"))


def test_assistant_tool_calls_and_tool_results_render_as_qwen_expects(tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    text = text_of(tok, render_chat(tok, msgs, [WEATHER]))
    # arguments (a JSON string from the client) are written as an object, not quoted twice
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>") in text
    assert template_message({"role": "assistant", "content": None})["content"] == ""


@pytest.mark.parametrize("text, content, calls", [
    (ONE, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (TWO, None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]),
    (TEXT_THEN_CALL, "Let me look that up.", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (UNICODE, None, [("get_weather", {"city": "Zürich 東京"})]),
    (ARGS_AS_STRING, None, [("get_weather", {"city": "Oslo"})]),
    ("The weather is fine.", "The weather is fine.", []),
    (BAD_JSON, BAD_JSON, []),
    (UNKNOWN, UNKNOWN, []),
    (UNCLOSED, UNCLOSED, []),
    ("a < b and <tool", "a < b and <tool", []),  # a tag's first letters at the end stay text
    (ONE + "\n" + BAD_JSON, BAD_JSON, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
])
def test_parser_on_recorded_strings(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def collect(deltas):
    """Streamed deltas -> (content, calls), put together as an OpenAI client does."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            if "id" in tc:
                assert tc["type"] == "function" and tc["id"].startswith("call_") and "id" not in slot
                slot["id"] = tc["id"]
                assert slot["arguments"] == "", "the name comes before the arguments"
            slot["name"] += tc["function"].get("name", "")
            slot["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", [ONE, TWO, TEXT_THEN_CALL, UNICODE, BAD_JSON, UNCLOSED,
                                  ONE + "\n" + BAD_JSON, "plain <tool_ text"])
def test_streamed_in_every_split_equals_whole(text):
    want_content, want_calls = parse_tool_calls(text, NAMES)
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
    for size in (1, 2, 3, 7, len(text)):
        parser = ToolCallStream(NAMES)
        deltas = []
        for i in range(0, len(text), size):
            deltas += parser.feed(text[i:i + size])
        deltas += parser.finish()
        content, calls = collect(deltas)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
        assert (content.strip() if calls else content) == (want_content or "")
        if calls and want_content is None:
            assert "<tool_call>" not in content


def test_content_streams_before_a_call_and_a_tag_prefix_is_held():
    parser = ToolCallStream(NAMES)
    assert parser.feed("Checking") == [{"content": "Checking"}]
    assert parser.feed(" now\n<tool") == [{"content": " now\n"}]  # "<tool" may become the tag
    assert parser.feed("_call>\n{\"name\": \"get_time\", ") == []  # inside a block: held
    out = parser.feed('"arguments": {}}\n</tool_call>')
    assert out[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    assert out[1]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{}"}}
    assert parser.finish() == []


# ------------------------------------------------------------------------ the whole HTTP path
NAME = "tiny-tools"


@pytest.fixture(scope="module")
def server(engines):
    from serve_helpers import start

    srv = start(engines("kv_cache"), served_model_name=NAME, kv_cache_gib=0.02)
    yield srv
    srv.stop()


@pytest.fixture
def scripted(monkeypatch, tok):
    """Make every row emit ``text`` then <|im_end|>, whatever the logits: a forced model output."""
    import torch

    from engine_lib.loop.sampler import RowSampler

    def use(text):
        script = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]

        def pick(self, logits):
            i = self.__dict__.setdefault("_step", 0)
            self._step = i + 1
            return torch.tensor(script[min(i, len(script) - 1)])

        monkeypatch.setattr(RowSampler, "pick", pick)
        monkeypatch.setattr(RowSampler, "plain_greedy", property(lambda self: False))
    return use


def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def ask(server, stream=False, **extra):
    extra.setdefault("tools", [WEATHER, TIME])
    return client(server).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60, temperature=0,
        stream=stream, **extra)


def test_forced_tool_call_comes_back_as_tool_calls(server, scripted):
    scripted(TEXT_THEN_CALL)
    out = ask(server).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Let me look that up."
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_forced_tool_calls_stream_as_deltas(server, scripted):
    scripted(TWO)
    deltas, finish = [], None
    for chunk in ask(server, stream=True):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.model_dump(exclude_none=True))
            finish = chunk.choices[0].finish_reason or finish
    content, calls = collect([{k: v for k, v in d.items() if k != "role"} for d in deltas])
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]


@pytest.mark.parametrize("text", [BAD_JSON, UNKNOWN])
def test_malformed_output_is_plain_content(server, scripted, text):
    scripted(text)
    out = ask(server).choices[0]
    assert out.finish_reason == "stop" and out.message.content == text and not out.message.tool_calls
    scripted(text)
    pieces = [c.choices[0].delta.content or "" for c in ask(server, stream=True) if c.choices]
    assert "".join(pieces) == text


def test_tool_choice_none_leaves_the_text_alone(server, scripted):
    scripted(ONE)
    out = ask(server, tool_choice="none").choices[0]
    assert out.message.content == ONE and not out.message.tool_calls and out.finish_reason == "stop"


def test_tool_history_is_accepted(server):
    import httpx

    body = {"model": NAME, "max_tokens": 3, "temperature": 0, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_required_and_named_choice_force_a_valid_call_from_a_random_model(server, choice):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                      "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
    time_fn = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    for seed in range(3):
        out = client(server).chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Weather?"}], tools=[weather, time_fn],
            tool_choice=choice, max_tokens=60, temperature=1, seed=seed).choices[0]
        assert out.finish_reason == "tool_calls", out
        for call in out.message.tool_calls:
            args = json.loads(call.function.arguments)
            if isinstance(choice, dict) or call.function.name == "get_weather":
                assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo")
                assert 1 <= args["days"] <= 7
            else:
                assert call.function.name == "get_time" and args == {}


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}],
      "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"tool_choice": "required", "min_tokens": 5}, "min_tokens"),
])
def test_bad_tool_requests_are_400s_that_name_the_field(server, extra, param):
    import httpx

    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "tools": [WEATHER], **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
