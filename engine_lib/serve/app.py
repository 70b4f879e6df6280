"""The HTTP layer: OpenAI-compatible routes over the scheduler (FastAPI).

Defined in chapter 12 (serving many users). Routes: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streamed as Server-Sent Events, or whole), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. A handler validates and tokenizes, hands a sequence
to the scheduler thread, and relays its events; a client that goes away is cancelled, so
its batch slot and KV blocks are freed for the others. Chat requests may carry ``tools`` and
``response_format`` (see ``guided``): their output is parsed for ``<tool_call>`` blocks and
held to a grammar.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from .guided import ChatPlan, make_matcher, plan_chat
from .protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_lengths,
    chunk_body,
    completion_body,
    new_id,
    parse_body,
    sampling_for,
    sse,
    stop_strings,
    usage,
)
from .scheduler import QueueFull, Scheduler
from .sequence import Delta
from .tools import ToolCallStream, parse_tool_calls

KEEPALIVE_S = 1.0  # an SSE comment this often while a request waits: it also notices a client gone


@dataclass
class ServerState:
    scheduler: Scheduler
    tokenizer: object
    defaults: SamplingParams
    model_name: str
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    created: int = 0

    @property
    def context(self) -> int:
        return self.scheduler.max_len

    @property
    def cache_tokens(self) -> int:
        return self.scheduler.cache.capacity_tokens


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it passes ``limit`` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    return bytes(body)


class BearerAuth:
    """Pure ASGI middleware: every route but ``/health`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                               type="authentication_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="engine_lib server", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())
    app.state.engine = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status in (400, 404, 413):
            state.scheduler.metrics.request("invalid")
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), type=kind))

    if state.api_key:
        app.add_middleware(BearerAuth, key=state.api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "engine_lib", "max_model_len": state.context}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_body(await read_body(request, state.max_body), ChatCompletionRequest)
        plan = plan_chat(req, state.tokenizer)
        return await run(request, req, plan.prompt_ids, chat=True,
                         max_tokens=req.max_tokens if req.max_tokens is not None else req.max_completion_tokens,
                         plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await read_body(request, state.max_body), CompletionRequest)
        if isinstance(req.prompt, str):
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=False)
        else:
            vocab = state.scheduler.vocab_size
            bad = [i for i in req.prompt if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="prompt",
                               code="invalid_value")
            ids = list(req.prompt)
        return await run(request, req, ids, chat=False, max_tokens=req.max_tokens)

    async def run(request: Request, req, prompt_ids: list[int], chat: bool, max_tokens: int | None,
                  plan: ChatPlan | None = None) -> Response:
        if req.model != state.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           type="not_found_error", code="model_not_found", param="model")
        if req.n != 1:
            raise ApiError(400, f"only n=1 is supported, got n={req.n}", param="n", code="invalid_value")
        max_tokens = check_lengths(len(prompt_ids), max_tokens, state.context, state.cache_tokens)
        params, stops = sampling_for(req, state.defaults), stop_strings(req)
        grammar = None
        if plan is not None and plan.grammar is not None:
            grammar = await make_matcher(plan.grammar, state.tokenizer, state.scheduler.vocab_size,
                                         params.stop_token_ids)
        tools = plan.tool_names if plan is not None else set()
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        seq = state.scheduler.new_sequence(prompt_ids, params, max_tokens, stops,
                                           sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                                           request_id=new_id("chatcmpl" if chat else "cmpl"), grammar=grammar)
        try:
            state.scheduler.submit(seq)
        except QueueFull as exc:
            state.scheduler.metrics.request("rejected")
            raise ApiError(429, f"the server is busy ({exc}); retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        watcher = asyncio.create_task(cancel_on_disconnect(request, seq.id))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(seq.id, events, chat, include_usage, watcher, tools),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            parts = []
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    continue
                if ev.reason == "error":
                    raise ApiError(500, ev.message, type="server_error", code="internal_error")
                text, reason, calls = "".join(parts), ev.reason, []
                if tools:
                    text, calls = parse_tool_calls(text, tools)
                    reason = "tool_calls" if calls and reason == "stop" else reason
                body = completion_body(chat, seq.id, state.model_name, text, reason,
                                       usage(ev.prompt_tokens, ev.completion_tokens))
                if calls:
                    body["choices"][0]["message"]["tool_calls"] = calls
                return JSONResponse(body)
        finally:
            watcher.cancel()
            state.scheduler.cancel(seq.id)  # a no-op once finished; frees everything if not

    async def cancel_on_disconnect(request: Request, seq_id: str) -> None:
        """Wait for the client to go away, then cancel its sequence at once."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                state.scheduler.cancel(seq_id)
                return

    def tool_chunks(seq_id: str, deltas: list[dict]):
        for delta in deltas:
            body = chunk_body(True, seq_id, state.model_name, None)
            body["choices"][0]["delta"] = delta
            yield sse(body)

    async def stream(seq_id: str, events: asyncio.Queue, chat: bool, include_usage: bool, watcher: asyncio.Task,
                     tools: set[str]):
        name, finished = state.model_name, False
        parser = ToolCallStream(tools) if tools else None
        try:
            if chat:
                yield sse(chunk_body(True, seq_id, name, None, role=True))
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if isinstance(ev, Delta):
                    if parser is not None:
                        for chunk in tool_chunks(seq_id, parser.feed(ev.text)):
                            yield chunk
                    elif ev.text:
                        yield sse(chunk_body(chat, seq_id, name, ev.text))
                    continue
                finished = True
                reason = ev.reason
                if parser is not None:
                    for chunk in tool_chunks(seq_id, parser.finish()):
                        yield chunk
                    reason = "tool_calls" if parser.calls and reason == "stop" else reason
                if ev.reason == "error":
                    yield sse(ApiError(500, ev.message, type="server_error", code="internal_error").body())
                else:
                    use = usage(ev.prompt_tokens, ev.completion_tokens)
                    yield sse(chunk_body(chat, seq_id, name, None, finish=reason,
                                         use=None if include_usage else use))
                    if include_usage:
                        yield sse(chunk_body(chat, seq_id, name, None, use=use, no_choices=True))
                yield sse("[DONE]")
                return
        finally:
            watcher.cancel()
            if not finished:
                state.scheduler.cancel(seq_id)

    return app

