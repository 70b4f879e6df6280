"""The OpenAI-compatible request bodies, their validation, and the error and response JSON.

Defined in chapter 12 (serving many users). Every refusal is an ``ApiError`` that becomes
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status, as OpenAI's API
(and vLLM, SGLang) answer, so a client's error handling works unchanged.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from ..sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20  # 1 MiB
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 256  # when a request names none (also capped by the context left)
Float = Annotated[float, Field(strict=True)]  # strict: "0.5" (a string) is refused, 1 (an int) is fine


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr | dict  # OpenAI sends a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result's call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other OpenAI fields are accepted and ignored
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)  # an extension, as in vLLM and SGLang
    repetition_penalty: Float | None = Field(None, gt=0)  # an extension, as in vLLM and SGLang
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice required allows one call (auto: not enforced)
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt]


def parse_body(raw: bytes, kind: type[_Common]) -> _Common:
    """Bytes -> a validated request, or a 400 that names the bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
        code = "missing_required_parameter" if errors and errors[0]["type"] == "missing" else "invalid_value"
        raise ApiError(400, f"invalid request: {detail}", code=code, param=first) from None


def sampling_for(req: _Common, defaults: SamplingParams) -> SamplingParams:
    """The checkpoint's defaults, overridden by what the request sets; temperature 0 is plain greedy."""
    options = {}
    if req.temperature is not None:
        options["temperature"] = req.temperature
        options["do_sample"] = req.temperature > 0
    for name in ("top_p", "top_k", "repetition_penalty", "seed"):
        if getattr(req, name) is not None:
            options[name] = getattr(req, name)
    return defaults.merged(**options)


def stop_strings(req: _Common) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop",
                       code="invalid_value")
    return tuple(s for s in stops if s)


def check_lengths(prompt_tokens: int, max_tokens: int | None, context: int, cache_tokens: int) -> int:
    """-> max_tokens to use; a 400 naming the numbers when the request cannot fit."""
    if prompt_tokens < 1:
        raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, context - prompt_tokens))
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                       code="invalid_value")
    total = prompt_tokens + max_tokens
    if total > context:
        raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                            f"{prompt_tokens} tokens and max_tokens is {max_tokens} ({total} in all)",
                       param="max_tokens", code="context_length_exceeded")
    if total > cache_tokens:
        raise ApiError(400, f"the prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens is "
                            f"more than the whole KV cache holds ({cache_tokens} tokens; raise --kv-cache-gib)",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


# ------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(chat: bool, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
              if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk_body(chat: bool, rid: str, model: str, text: str | None, finish: str | None = None,
               role: bool = False, use: dict | None = None, no_choices: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [] if no_choices else [choice]}
    if use is not None:
        body["usage"] = use
    return body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
