"""The OpenAI-compatible request bodies, their validation, and how a request becomes sampling settings.

Defined in chapter 12 (serving many users). Every field a request model declares either works
or is refused with a 400 that names it (``unsupported``): nothing is accepted and silently
ignored (``tests/test_serve_fields.py`` enumerates the fields and holds each to a test).
``null`` is accepted for every optional field and means "the default". Every refusal is an
``ApiError`` that becomes ``{"error": {"message", "type", "param", "code"}}`` with its HTTP
status, as OpenAI's API (and vLLM, SGLang) answer, so a client's error handling works unchanged.
The response bodies are in ``responses``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from ..errors import OptionValueError
from ..sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20  # 1 MiB
MAX_STOP_STRINGS = 64  # vLLM has no limit; each one is searched in the text after every token
MAX_N = 16  # choices per prompt
MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # OpenAI's limits
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# strict: "0.5" (a string) is refused, 1 (an int) is fine; NaN and Infinity (Python's json reads them) are refused
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]  # larger ints are a 400, not a 500 later


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A message; an assistant's may carry ``tool_calls`` instead of content, a ``tool`` one answers a call."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

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
        """The dict a chat template reads (tool calls with their arguments as JSON text, as OpenAI sends them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema
    strict: StrictBool | None = None  # the arguments follow the schema only under tool_choice required/named


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
    strict: StrictBool | None = None  # always strict here: the grammar allows nothing else


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = False  # a last chunk, with no choices, carries the request's usage
    # every chunk carries the usage so far, as in vLLM (which needs include_usage too; here either works)
    continuous_usage_stats: StrictBool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does; declared ones all work
    model: StrictStr | None = None  # None: the served model
    max_tokens: Int64 | None = None
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int64 | None = Field(None, ge=-1)  # an extension, as in vLLM; -1 and 0 mean off
    min_p: Float | None = Field(None, ge=0, le=1)  # an extension, as in vLLM
    repetition_penalty: Float | None = Field(None, gt=0)  # an extension, as in vLLM and SGLang
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Int64] | None = None  # an extension, as in vLLM
    include_stop_str_in_output: StrictBool | None = None  # an extension, as in vLLM
    ignore_eos: StrictBool | None = None  # an extension, as in vLLM
    min_tokens: Int64 | None = Field(None, ge=0)  # an extension, as in vLLM
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Int64 | None = Field(None, ge=1, le=MAX_N)
    best_of: Int64 | None = None  # only equal to n (no hidden candidates)
    user: StrictStr | None = None  # for the caller's records: no effect on the output, as in OpenAI


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None  # wins over max_tokens, as in vLLM
    logprobs: StrictBool | None = None
    top_logprobs: Int64 | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # tool calls and structured output (see ``guided``)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice required allows one call (auto: not enforced)
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None
    logprobs: Int64 | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: StrictStr | None = None  # refused: insertion is not supported


def parse_body(raw: bytes, kind: type[_Common]) -> _Common:
    """Bytes -> a validated request, or a 400 that names the bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
        code = "missing_required_parameter" if errors and errors[0]["type"] == "missing" else "invalid_value"
        raise ApiError(400, f"invalid request: {detail}", code=code, param=first) from None
    unsupported(req)
    return req


def unsupported(req: _Common) -> None:
    """A 400 naming a declared field whose asked-for behaviour this server does not have (yet)."""
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise invalid("best_of", f"best_of must equal n ({n}) here, got {req.best_of}: hidden candidates are "
                                 "not supported")
    if getattr(req, "suffix", None):
        raise invalid("suffix", "suffix (insertion) is not supported")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")


def sampling_for(req: _Common, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
    """The checkpoint's defaults, overridden by what the request sets; temperature 0 is plain greedy. Every
    option of the request lands in the one ``SamplingParams`` (``max_tokens`` is set per prompt, when its
    length is known: ``check_lengths``)."""
    options: dict[str, Any] = {}
    if req.temperature is not None:
        options["temperature"] = req.temperature
        options["do_sample"] = req.temperature > 0
    if req.top_k is not None:
        if req.top_k > vocab_size:
            raise invalid("top_k", f"top_k must be at most the vocabulary size ({vocab_size}), got {req.top_k}")
        options["top_k"] = max(req.top_k, 0)  # -1 is vLLM's "off", 0 is ours
    for name in ("top_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "min_p",
                 "min_tokens"):
        if getattr(req, name) is not None:
            options[name] = getattr(req, name)
    stop_ids = tuple(token_ids("stop_token_ids", req.stop_token_ids or [], vocab_size))
    options["stop_token_ids"] = (() if req.ignore_eos else defaults.stop_token_ids) + stop_ids
    options.update(stop=stop_strings(req), logit_bias=logit_bias(req.logit_bias, vocab_size),
                   include_stop_str=bool(req.include_stop_str_in_output), logprobs=logprobs_asked(req),
                   prompt_logprobs=req.logprobs if getattr(req, "echo", None) and isinstance(req, CompletionRequest)
                   else None)
    try:
        return defaults.merged(**options)
    except OptionValueError as exc:  # a rule of the engine's the fields above do not state: still a 400
        raise invalid(exc.option, str(exc)) from None


def logprobs_asked(req: _Common) -> int | None:
    """How many top alternatives each token's logprob comes with; None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def token_ids(param: str, ids: list[int], vocab_size: int) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise invalid(param, f"{param}: token ids out of range [0, {vocab_size}): {bad[:5]}")
    return list(ids)


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise invalid("logit_bias", f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}")
        if not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias values are in [-100, 100], got {value} for token {key}")
        out.append((int(key), float(value)))
    return tuple(out)


def stop_strings(req: _Common) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    return tuple(s for s in stops if s)


def asked_max_tokens(req: _Common) -> int | None:
    """``max_completion_tokens`` wins over ``max_tokens`` (as in vLLM); None: the rest of the context."""
    given = getattr(req, "max_completion_tokens", None)
    return given if given is not None else req.max_tokens


def check_lengths(prompt_tokens: int, max_tokens: int | None, context: int, cache_tokens: int,
                  echo: bool = False) -> int:
    """-> max_tokens to use (by default all the room left); a 400 naming the numbers when the request cannot fit.
    ``max_tokens`` 0 is allowed with ``echo`` only: the prompt's logprobs, nothing generated."""
    if prompt_tokens < 1:
        raise invalid("prompt", "the prompt is empty")
    if max_tokens is None:
        max_tokens = max(1, min(context, cache_tokens) - prompt_tokens)
    if max_tokens < (0 if echo else 1):
        raise invalid("max_tokens", f"max_tokens must be at least {0 if echo else 1}, got {max_tokens}")
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
