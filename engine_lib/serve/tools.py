"""Tool calls the Qwen2.5 way: the chat template's tool section in, ``<tool_call>`` blocks out.

Defined in chapter 13 (an API for agents and evaluators). Qwen2.5-Instruct was trained to answer a tool
request with one or more blocks

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

so the server does two things. In: the request's ``tools`` go through the chat template's
``# Tools`` section, and earlier assistant ``tool_calls`` and ``tool`` results are rendered
as the template expects. Out: the text is cut into plain content and OpenAI ``tool_calls``.

``tool_choice`` is honoured like this:

- ``none``: the template gets no tools, so the prompt has no tool section at all;
- ``auto`` (the default with tools): the tool section is there; the model decides;
- ``required`` and a named function: the tool section is there, and a grammar (see
  ``grammar.tool_call_grammar``) masks every token that would leave
  ``<tool_call>{"name": <fn>, "arguments": <its schema>}</tool_call>``.

A block that is not a valid call (bad JSON, no closing tag, a function that was not
offered) is given back as plain content: the client sees what the model wrote, never a 500.
One parser, ``ToolCallStream``, serves both the streamed and the whole response, so they
cannot disagree.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


# ---------------------------------------------------------------------------------- rendering
def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or []}


def template_message(message: dict) -> dict:
    """An OpenAI message -> what Qwen2.5's template reads: text content ('' for null), and each
    tool call's ``arguments`` as an object (OpenAI sends a JSON string; the template writes it
    with ``tojson``, which would quote it a second time)."""
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p["text"] if isinstance(p, dict) else p.text for p in content)
    out = {"role": message["role"], "content": content or ""}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = []
        for call in calls:
            fn = call["function"]
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass  # written as the string it is
            out["tool_calls"].append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                tool_choice: str | dict | None = None) -> list[int]:
    """Token ids of the conversation under the chat template, ready for the assistant's reply.

    ``tools`` are OpenAI tool objects ({"type": "function", "function": {...}}); with
    ``tool_choice="none"`` they are left out of the prompt.
    """
    rendered = [template_message(m) for m in messages]
    offered = tools if tools and tool_choice != "none" else None
    out = tokenizer.apply_chat_template(rendered, tools=offered, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def forced_function(tool_choice: str | dict | None) -> str | None:
    """The function a named ``tool_choice`` forces ({"type": "function", "function": {"name": ...}})."""
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


# ----------------------------------------------------------------------------------- parsing
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(block: str, names: set[str]) -> dict | None:
    """The JSON between the tags -> {"name", "arguments" (a JSON string)}, or None if it is not a call."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": data["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that could still grow into ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStream:
    """Incremental parser: text pieces in, OpenAI delta pieces out.

    ``feed(text)`` and ``finish()`` return a list of deltas, each either
    ``{"content": str}`` or ``{"tool_calls": [{"index", ...}]}`` in OpenAI's streaming shape:
    a call's first delta carries its id, type and name (``arguments: ""``), the next one its
    arguments. Content streams as it comes, except a tail that may be the start of
    ``<tool_call>``; a block is held until ``</tool_call>`` closes it, then given out as a
    call, or as content if it is not a valid one.
    """

    def __init__(self, names: set[str]):
        self.names = names
        self.buffer = ""  # text not yet given out
        self.in_call = False
        self.calls: list[dict] = []  # every call given out: {"id", "type", "function": {...}}
        self.blank = ""  # whitespace after a call: the newline between blocks is not content

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _held_prefix(self.buffer, OPEN)
                    self._content(out, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                self._content(out, self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start:], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return out  # the block is still being written
            block = self.buffer[:end + len(CLOSE)]
            self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False
            call = parse_call(block[len(OPEN):-len(CLOSE)], self.names)
            if call is None:
                self._content(out, block)
            else:
                out.extend(self._call(call))

    def finish(self) -> list[dict]:
        """The end of the output: whatever is held (an unclosed block too) is content."""
        out: list[dict] = []
        self._content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _content(self, out: list[dict], text: str) -> None:
        if self.calls and not (self.blank + text).strip():
            self.blank += text  # given out only if real text follows
            return
        text, self.blank = self.blank + text, ""
        if not text:
            return
        if out and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + text}
        else:
            out.append({"content": text})

    def _call(self, call: dict) -> list[dict]:
        index, cid = len(self.calls), new_call_id()
        self.blank = ""
        self.calls.append({"id": cid, "type": "function", "function": dict(call)})
        head = {"index": index, "id": cid, "type": "function", "function": {"name": call["name"], "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call["arguments"]}}]}]


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A whole output -> (content or None, tool_calls): what a non-streamed response carries.

    Content is the text around the valid blocks (and any invalid block, as written), stripped of
    the newlines the template puts between blocks; None when nothing but calls is left.
    """
    parser = ToolCallStream(names)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    if parser.calls:
        content = content.strip()
    return (content or None) if parser.calls else content, parser.calls
