"""What a chat request asks of its output: the prompt with its tools, a grammar, calls to parse.

Defined in chapter 13 (an API for agents and evaluators). This joins the request models (``protocol``) to
the Qwen2.5 tool format (``tools``) and to structured output (``grammar``), so the HTTP
handler makes one call and every refusal is a 400 that names its field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .grammar import GrammarError, GrammarMatcher, ll_tokenizer, response_format_grammar, tool_call_grammar
from .protocol import ApiError, ChatCompletionRequest, NamedToolChoice
from .tools import forced_function, render_chat, tool_names


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    grammar: str | None = None  # llguidance grammar the output must follow
    tool_names: set[str] = field(default_factory=set)  # empty: the output is not parsed for tool calls


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def plan_chat(req: ChatCompletionRequest, tokenizer) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    forced = forced_function(choice)
    if forced is not None and forced not in tool_names(tools):
        raise _bad(f"tool_choice names the function {forced!r}, which is not among the tools", "tool_choice")
    prompt_ids = render_chat(tokenizer, [m.for_template() for m in req.messages], tools, choice)
    grammar = None
    if choice == "required" or forced is not None:
        open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
        if not isinstance(open_id, int) or not isinstance(close_id, int) or open_id == close_id:
            raise _bad("this tokenizer has no <tool_call> tokens: tool_choice must be auto or none", "tool_choice")
        try:
            grammar = tool_call_grammar(tools, forced, open_id, close_id, several=req.parallel_tool_calls is not False)
        except GrammarError as exc:
            raise _bad(str(exc), "tools") from None
    try:
        rf = req.response_format.model_dump(by_alias=True) if req.response_format else None
        rf_grammar = response_format_grammar(rf)
    except GrammarError as exc:
        raise _bad(str(exc), "response_format") from None
    if grammar is not None and rf_grammar is not None:
        raise _bad("response_format cannot be combined with tool_choice 'required' or a named function "
                   "(the call's arguments already follow the function's schema)", "response_format")
    grammar = grammar or rf_grammar
    for name in ("ignore_eos", "min_tokens"):  # the grammar ends the answer with EOS; these would hold it back
        if grammar is not None and getattr(req, name):
            raise _bad(f"{name} cannot be combined with response_format or a forced tool choice", name)
    return ChatPlan(prompt_ids, grammar, tool_names(tools) if choice != "none" else set())


async def make_matcher(grammar: str, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarMatcher:
    """A matcher for one sequence, built off the event loop (the tokenizer's trie takes ~1 s the
    first time, once per server; a large grammar can take 100 ms)."""
    def build():
        return GrammarMatcher(ll_tokenizer(tokenizer, vocab_size, tuple(eos_ids)), grammar)

    try:
        return await asyncio.to_thread(build)
    except GrammarError as exc:
        raise _bad(str(exc), "response_format") from None
