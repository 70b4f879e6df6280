"""The HTTP layer: OpenAI-compatible routes over the scheduler (FastAPI).

Defined in chapter 12 (serving many users). Routes: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streamed as Server-Sent Events, or whole), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. A handler validates and tokenizes, hands one sequence
per choice to the scheduler thread (``n`` per prompt; completions take a list of prompts),
and relays their events; a client that goes away is cancelled, so its batch slots and KV
blocks are freed for the others. Any error that escapes becomes OpenAI's error JSON with a
500, counted in ``/metrics``: never a bare 500. Chat requests may carry ``tools`` and
``response_format`` (see ``guided``): each choice's output is then held to a grammar and/or
parsed for ``<tool_call>`` blocks, whole or as streamed deltas.
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import SamplingParams
from . import responses as R
from .guided import ChatPlan, make_matcher, plan_chat
from .logprobs import TokenLogprob, TokenText
from .protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Settings,
    asked_max_tokens,
    check_lengths,
    parse_body,
    sampling_for,
    token_ids,
)
from .scheduler import QueueFull, Scheduler
from .sequence import Delta, Finished, PromptLogprobs, Sequence
from .tools import ToolCallStream, parse_tool_calls

KEEPALIVE_S = 1.0  # an SSE comment this often while a request waits: it also notices a client gone
SEED_SPACE = 2**64  # torch's generators take seeds modulo this


@dataclass
class ServerState:
    scheduler: Scheduler
    tokenizer: object
    defaults: SamplingParams
    model_name: str
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    created: int = 0
    metrics_no_auth: bool = False  # /metrics open to scrapers without the key

    def __post_init__(self):
        self.scheduler.metrics.model_name = self.model_name
        self.token_text = TokenText(self.tokenizer)

    @property
    def context(self) -> int:
        return self.scheduler.max_len

    @property
    def cache_tokens(self) -> int:
        return self.scheduler.cache.capacity_tokens


@dataclass
class Choice:
    """One sequence's answer as it is assembled."""

    index: int
    prompt: int  # which prompt it answers
    seq: Sequence
    echo: str | None = None  # the prompt's text, put before the answer (completions' echo)
    parts: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)
    offset: int = 0  # characters sent so far (completions' text_offset)
    end: Finished | None = None
    tools: ToolCallStream | None = None  # parses the streamed text for tool calls (chat with tools)


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
    """Pure ASGI middleware: every route but ``/health`` (and ``open_paths``) needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...] = ()):
        self.app, self.expected = app, f"Bearer {key}".encode()
        self.open_paths = ("/health", *open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                               type="authentication_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, type="internal_error", code="internal_error")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="engine_lib server", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())
    app.state.engine = state
    metrics = state.scheduler.metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status in (400, 404, 413):
            metrics.request("invalid")  # a 500 here relays a sequence's error: the scheduler counted it
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception):
        """The catch-all: a bug answers with OpenAI's error JSON and is counted, never a bare 500."""
        traceback.print_exception(exc, file=sys.stderr)
        metrics.request("error")
        return error_response(internal_error(f"internal error: {type(exc).__name__}"))

    if state.api_key:
        app.add_middleware(BearerAuth, key=state.api_key, open_paths=("/metrics",) if state.metrics_no_auth else ())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "engine_lib", "max_model_len": state.context}]}

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_body(await read_body(request, state.max_body), ChatCompletionRequest)
        plan = plan_chat(req, state.tokenizer)
        return await run(request, req, [plan.prompt_ids], chat=True, plan=plan)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await read_body(request, state.max_body), CompletionRequest)
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            else [req.prompt]
        ids = [state.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
               else token_ids("prompt", p, state.scheduler.vocab_size) for p in prompts]
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(i) for p, i in zip(prompts, ids)] \
            if req.echo else None
        return await run(request, req, ids, chat=False, echoes=echoes)

    def choice_settings(settings: Settings, j: int) -> SamplingParams:
        """Choice j of a prompt draws with seed + j (mod 2**64): seeded n > 1 gives n different answers."""
        seed = settings.params.seed
        return settings.params if seed is None or j == 0 else replace(settings.params, seed=(seed + j) % SEED_SPACE)

    async def run(request: Request, req, prompts: list[list[int]], chat: bool,
                  echoes: list[str] | None = None, plan: ChatPlan | None = None) -> Response:
        if req.model is not None and req.model != state.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           type="not_found_error", code="model_not_found", param="model")
        if not prompts:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        n = req.n or 1
        if len(prompts) * n > state.scheduler.config.max_queue:  # a 429 would never clear: say so once
            raise ApiError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} sequences in one request; this "
                                f"server queues at most {state.scheduler.config.max_queue} (--max-queue)",
                           param="prompt", code="invalid_value")
        lengths = [check_lengths(len(p), asked_max_tokens(req), state.context, state.cache_tokens,
                                 echo=echoes is not None) for p in prompts]
        settings = sampling_for(req, state.defaults, state.scheduler.vocab_size)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        rid = R.new_id("chatcmpl" if chat else "cmpl")
        choices = []
        for p, (ids, max_tokens) in enumerate(zip(prompts, lengths)):
            for j in range(n):
                index = len(choices)
                grammar = None  # one matcher per choice: each follows its own tokens
                if plan is not None and plan.grammar is not None:
                    grammar = await make_matcher(plan.grammar, state.tokenizer, state.scheduler.vocab_size,
                                                 settings.params.stop_token_ids)
                seq = state.scheduler.new_sequence(
                    ids, choice_settings(settings, j), max_tokens, settings.stops, request_id=f"{rid}-{index}",
                    sink=lambda ev, index=index: loop.call_soon_threadsafe(events.put_nowait, (index, ev)),
                    extras=settings.extras, grammar=grammar)
                tools = ToolCallStream(plan.tool_names) if plan is not None and plan.tool_names else None
                choices.append(Choice(index, p, seq, echo=echoes[p] if echoes else None, tools=tools))
        try:
            for c in choices:
                state.scheduler.submit(c.seq)
        except QueueFull as exc:
            for c in choices:
                state.scheduler.cancel(c.seq.id)
            metrics.request("rejected")
            raise ApiError(429, f"the server is busy ({exc}); retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        ids = [c.seq.id for c in choices]
        watcher = asyncio.create_task(cancel_on_disconnect(request, ids))
        prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, however many choices
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(rid, chat, choices, events, prompt_tokens, include_usage, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while any(c.end is None for c in choices):
                index, ev = await events.get()
                c = choices[index]
                record(c, ev)
                if isinstance(ev, Finished) and ev.reason == "error":
                    raise internal_error(ev.message)
            out = [whole_choice(chat, c, req) for c in choices]
            use = R.usage(prompt_tokens, sum(c.end.completion_tokens for c in choices))
            return JSONResponse(R.body(chat, rid, state.model_name, out, use))
        finally:
            watcher.cancel()
            for seq_id in ids:
                state.scheduler.cancel(seq_id)  # a no-op once finished; frees everything if not

    def record(c: Choice, ev) -> None:
        if isinstance(ev, Delta):
            c.parts.append(ev.text)
            c.logprobs += [(e.token, e) for e in ev.logprobs]
        elif isinstance(ev, PromptLogprobs):
            c.logprobs[:0] = [(t, e) for t, e in zip(c.seq.prompt_ids, ev.entries)]
        else:
            c.end = ev

    def wants_logprobs(req) -> bool:
        return (req.logprobs is True) if isinstance(req, ChatCompletionRequest) else req.logprobs is not None

    def whole_choice(chat: bool, c: Choice, req) -> dict:
        text = (c.echo or "") + "".join(c.parts)
        if chat:
            lps = R.chat_logprobs([e for _, e in c.logprobs], state.token_text) if wants_logprobs(req) else None
            if c.tools is None:
                return R.chat_choice(c.index, text, c.end.reason, lps)
            content, calls = parse_tool_calls(text, c.tools.names)
            out = R.chat_choice(c.index, content, finish_reason(c, bool(calls)), lps)
            if calls:
                out["message"]["tool_calls"] = calls
            return out
        lps = R.completion_logprobs(c.logprobs, state.token_text) if wants_logprobs(req) else None
        return R.completion_choice(c.index, text, c.end.reason, lps)

    def finish_reason(c: Choice, called: bool) -> str:
        return "tool_calls" if called and c.end.reason == "stop" else c.end.reason

    async def cancel_on_disconnect(request: Request, seq_ids: list[str]) -> None:
        """Wait for the client to go away, then cancel its sequences at once."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for seq_id in seq_ids:
                    state.scheduler.cancel(seq_id)
                return

    async def stream(rid: str, chat: bool, choices: list[Choice], events: asyncio.Queue, prompt_tokens: int,
                     include_usage: bool, watcher: asyncio.Task):
        name, text_of = state.model_name, state.token_text

        def piece(c: Choice, text: str, entries: list[tuple[int, TokenLogprob | None]],
                  finish: str | None = None) -> dict:
            """One choice's chunk: its new text, the logprobs of its new tokens, maybe its finish reason."""
            if chat:
                lps = R.chat_logprobs([e for _, e in entries], text_of) if logprobs else None
                return R.chat_delta(c.index, text if text or finish is None else None, finish, logprobs=lps)
            lps = R.completion_logprobs(entries, text_of, c.offset) if logprobs else None
            c.offset += len(text)
            return R.completion_choice(c.index, text, finish, lps)

        def tool_piece(c: Choice, delta: dict, entries: list[tuple[int, TokenLogprob | None]]) -> dict:
            """A chat choice's chunk whose delta is the tool parser's (content or tool_calls)."""
            out = piece(c, delta.get("content", ""), entries)
            out["delta"] = delta
            return out

        logprobs = any(c.seq.extras.logprobs is not None for c in choices)
        try:
            for c in choices:
                if chat:
                    yield R.sse(R.chunk(True, rid, name, [R.chat_delta(c.index, role=True)]))
                elif c.echo is not None and c.seq.prompt_logprobs is None:
                    yield R.sse(R.chunk(False, rid, name, [piece(c, c.echo, [])]))
            while any(c.end is None for c in choices):
                try:
                    index, ev = await asyncio.wait_for(events.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                c = choices[index]
                if isinstance(ev, PromptLogprobs):
                    entries = list(zip(c.seq.prompt_ids, ev.entries))
                    yield R.sse(R.chunk(False, rid, name, [piece(c, c.echo or "", entries)]))
                elif isinstance(ev, Delta):
                    entries = [(e.token, e) for e in ev.logprobs]
                    if c.tools is not None:  # content and tool-call deltas, as the parser gives them out
                        for delta in c.tools.feed(ev.text) or ([{"content": ""}] if entries else []):
                            yield R.sse(R.chunk(True, rid, name, [tool_piece(c, delta, entries)]))
                            entries = []
                    elif ev.text or ev.logprobs:
                        yield R.sse(R.chunk(chat, rid, name, [piece(c, ev.text, entries)]))
                elif ev.reason == "error":
                    c.end = ev
                    yield R.sse(internal_error(ev.message).body())
                    break
                else:
                    c.end = ev
                    reason = ev.reason
                    if c.tools is not None:
                        for delta in c.tools.finish():
                            yield R.sse(R.chunk(True, rid, name, [tool_piece(c, delta, [])]))
                        reason = finish_reason(c, bool(c.tools.calls))
                    last = all(x.end is not None for x in choices)
                    use = R.usage(prompt_tokens, sum(x.end.completion_tokens for x in choices)) if last else None
                    yield R.sse(R.chunk(chat, rid, name, [piece(c, "", [], finish=reason)],
                                        use=None if include_usage else use))
                    if last and include_usage:
                        yield R.sse(R.chunk(chat, rid, name, [], use=use))
            yield R.sse("[DONE]")
        except Exception as exc:  # headers are out: the error goes in the stream, counted
            traceback.print_exception(exc, file=sys.stderr)
            metrics.request("error")
            yield R.sse(internal_error(f"internal error: {type(exc).__name__}").body())
        finally:
            watcher.cancel()
            for c in choices:
                if c.end is None:
                    state.scheduler.cancel(c.seq.id)

    return app
