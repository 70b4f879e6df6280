"""The response JSON: whole bodies, streamed chunks, usage, and logprobs in OpenAI's two shapes.

Defined in chapter 13 (an API for agents and evaluators). Chat puts logprobs in
``choices[i].logprobs.content = [{token, logprob, bytes, top_logprobs: [...]}]``; the legacy
completions API in ``{tokens, token_logprobs, top_logprobs, text_offset}``, where the first
echoed prompt token has logprob ``null`` (nothing comes before it) and ``text_offset`` counts
characters into the choice's ``text``. A streamed chunk carries the logprobs of its own tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from ..loop.logprobs import TokenLogprob

TextOf = Callable[[int], tuple[str, list[int]]]  # token id -> (text, bytes): logprobs.TokenText


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[TokenLogprob], text_of: TextOf) -> dict:
    def one(token: int, logprob: float) -> dict:
        text, raw = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(pairs: list[tuple[int, TokenLogprob | None]], text_of: TextOf, offset: int = 0) -> dict:
    """pairs: (token id, its logprob or None for the first prompt token); offset: where the first token's
    text starts in the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in pairs:
        text = text_of(token)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.logprob)
        top = {text_of(t)[0]: lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)  # the chosen token is always listed, as vLLM does
        out["top_logprobs"].append(top)
    return out


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_delta(index: int, text: str | None = None, finish: str | None = None, role: bool = False,
               logprobs: dict | None = None) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def body(chat: bool, rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


def chunk(chat: bool, rid: str, model: str, choices: list[dict], use: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
