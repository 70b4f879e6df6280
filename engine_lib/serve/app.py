"""The HTTP layer: OpenAI-compatible routes over the serving loop (FastAPI).

Defined in chapter 12 (serving many users). Routes: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (streamed as Server-Sent Events, or whole), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (``HEAD`` too, for monitors). A handler validates and
tokenizes, hands one sequence per choice to the loop's thread (``n`` per prompt; completions
take a list of prompts), and relays their events; a client that goes away is cancelled, so its batch slots and KV
blocks are freed for the others. Any error that escapes becomes OpenAI's error JSON with a
500, counted in ``/metrics``: never a bare 500. Chat requests may carry ``tools`` and
``response_format`` (see ``guided``): each choice's output is then held to a grammar and/or
parsed for ``<tool_call>`` blocks, whole or as streamed deltas.

The routes are module-level handlers: ``create_app`` puts the ``ServerState`` on
``app.state.engine`` and each handler reads it from its request (``server_state``). A request in
flight is a ``Reply``: its choices, the queue their events arrive on, and how its answer is
shaped; ``whole`` waits for every choice, ``stream`` relays them as chunks.
"""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..loop.logprobs import TokenLogprob, TokenText
from ..loop.sequence import Delta, Finished, PromptLogprobs, Sequence
from ..loop.serving import QueueFull, ServingLoop
from ..sampling import SamplingParams
from . import responses as R
from .guided import ChatPlan, make_matcher, plan_chat
from .protocol import (
    MAX_BODY_BYTES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    asked_max_tokens,
    check_lengths,
    parse_body,
    sampling_for,
    token_ids,
)
from .tools import ToolCallStream, parse_tool_calls

KEEPALIVE_S = 1.0  # an SSE comment this often while a request waits: it also notices a client gone
SEED_SPACE = 2**64  # torch's generators take seeds modulo this


@dataclass
class ServerState:
    loop: ServingLoop
    tokenizer: object
    defaults: SamplingParams
    model_name: str
    api_key: str | None = None
    max_body: int = MAX_BODY_BYTES
    created: int = 0
    metrics_no_auth: bool = False  # /metrics open to scrapers without the key

    def __post_init__(self):
        self.loop.metrics.model_name = self.model_name
        self.token_text = TokenText(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.loop.max_model_len

    @property
    def cache_tokens(self) -> int:
        return self.loop.cache.capacity_tokens


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
    tokens: int = 0  # tokens generated so far (the streamed usage counts them)
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


def server_state(request: Request) -> ServerState:
    """The state ``create_app`` put on the app: handlers read it here, so none closes over it."""
    return request.app.state.engine


# ----------------------------------------------------------------------------- errors


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    if exc.status in (400, 404, 413):  # a 500 here relays a sequence's error: the scheduler counted it
        server_state(request).loop.metrics.request("invalid")
    return error_response(exc)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(exc.status_code, str(exc.detail), type=kind))


async def any_error(request: Request, exc: Exception) -> JSONResponse:
    """The catch-all: a bug answers with OpenAI's error JSON and is counted, never a bare 500."""
    traceback.print_exception(exc, file=sys.stderr)
    server_state(request).loop.metrics.request("error")
    return error_response(internal_error(f"internal error: {type(exc).__name__}"))


# ----------------------------------------------------------------------------- routes


async def health() -> dict:
    return {"status": "ok"}


async def models(request: Request) -> dict:
    state = server_state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "engine_lib", "max_model_len": state.max_model_len}]}


async def metrics_route(request: Request) -> Response:
    """Prometheus text. HEAD (how monitors probe) gets GET's status and headers, and no body."""
    text = PlainTextResponse(server_state(request).loop.metrics.render(), media_type="text/plain; version=0.0.4")
    return Response(headers=dict(text.headers)) if request.method == "HEAD" else text


async def chat(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_body(request, state.max_body), ChatCompletionRequest)
    plan = plan_chat(req, state.tokenizer)
    return await run(request, req, [plan.prompt_ids], chat=True, plan=plan)


async def completions(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_body(request, state.max_body), CompletionRequest)
    prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
        else [req.prompt]
    ids = [state.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
           else token_ids("prompt", p, state.loop.vocab_size) for p in prompts]
    echoes = [p if isinstance(p, str) else state.tokenizer.decode(i) for p, i in zip(prompts, ids)] \
        if req.echo else None
    return await run(request, req, ids, chat=False, echoes=echoes)


ROUTES = (  # path, handler, methods
    ("/health", health, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/metrics", metrics_route, ["GET", "HEAD"]),
    ("/v1/chat/completions", chat, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="engine_lib server", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())
    app.state.engine = state
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, any_error)
    if state.api_key:
        app.add_middleware(BearerAuth, key=state.api_key, open_paths=("/metrics",) if state.metrics_no_auth else ())
    for path, handler, methods in ROUTES:
        app.add_api_route(path, handler, methods=methods)
    return app


# ----------------------------------------------------------------------------- one request


@dataclass
class Reply:
    """One request in flight: its choices, the queue their events arrive on, and the answer's shape."""

    state: ServerState
    rid: str
    chat: bool
    prompt_tokens: int  # once per prompt, however many choices
    logprobs: bool  # the answer carries logprobs
    include_usage: bool = False  # streamed: a last chunk with no choices carries the usage
    continuous_usage: bool = False  # streamed: every chunk carries the usage so far
    choices: list[Choice] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @classmethod
    def of(cls, state: ServerState, req, chat: bool, prompts: list[list[int]]) -> Reply:
        options = req.stream_options
        return cls(state, R.new_id("chatcmpl" if chat else "cmpl"), chat, sum(len(p) for p in prompts),
                   wants_logprobs(req), include_usage=bool(options and options.include_usage),
                   continuous_usage=bool(options and options.continuous_usage_stats))

    @property
    def done(self) -> bool:
        return all(c.end is not None for c in self.choices)

    def usage(self) -> dict:
        """The usage so far: the whole request's once every choice has finished."""
        return R.usage(self.prompt_tokens, sum(c.tokens for c in self.choices))

    def sse(self, choices: list[dict], last: bool = False) -> str:
        """A chunk of ``choices``; the usage rides on it when asked to continuously, and on the last
        chunk when no separate usage chunk follows (``include_usage``)."""
        use = self.usage() if self.continuous_usage or (last and not self.include_usage) else None
        return R.sse(R.chunk(self.chat, self.rid, self.state.model_name, choices, use=use))

    def usage_sse(self) -> str:
        return R.sse(R.chunk(self.chat, self.rid, self.state.model_name, [], use=self.usage()))


def wants_logprobs(req) -> bool:
    return (req.logprobs is True) if isinstance(req, ChatCompletionRequest) else req.logprobs is not None


async def run(request: Request, req, prompts: list[list[int]], chat: bool,
              echoes: list[str] | None = None, plan: ChatPlan | None = None) -> Response:
    """Check the request, hand its sequences to the scheduler, and answer whole or streamed."""
    state = server_state(request)
    check_request(state, req, prompts)
    reply = Reply.of(state, req, chat, prompts)
    await open_choices(reply, req, prompts, echoes, plan)
    submit_all(state, reply.choices)
    watcher = asyncio.create_task(cancel_on_disconnect(request, state, [c.seq.id for c in reply.choices]))
    if req.stream:
        return StreamingResponse(stream(reply, watcher), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await whole(reply, watcher)


def check_request(state: ServerState, req, prompts: list[list[int]]) -> None:
    """The checks that need the server: the model's name, and room in the queue for every choice."""
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                       type="not_found_error", code="model_not_found", param="model")
    if not prompts:
        raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    n, max_queue = req.n or 1, state.loop.config.max_queue
    if len(prompts) * n > max_queue:  # a 429 would never clear: say so once
        raise ApiError(400, f"{len(prompts)} prompts x n={n} = {len(prompts) * n} sequences in one request; this "
                            f"server queues at most {max_queue} (--max-queue)", param="prompt", code="invalid_value")


def choice_params(params: SamplingParams, j: int, max_tokens: int) -> SamplingParams:
    """Choice j of a prompt draws with seed + j (mod 2**64): seeded n > 1 gives n different answers."""
    seed = params.seed if params.seed is None or j == 0 else (params.seed + j) % SEED_SPACE
    return replace(params, seed=seed, max_tokens=max_tokens)


async def open_choices(reply: Reply, req, prompts: list[list[int]], echoes: list[str] | None,
                       plan: ChatPlan | None) -> None:
    """One sequence per choice (``n`` per prompt), each sending its events to the reply's queue."""
    state, vocab = reply.state, reply.state.loop.vocab_size
    lengths = [check_lengths(len(p), asked_max_tokens(req), state.max_model_len, state.cache_tokens,
                             echo=echoes is not None) for p in prompts]
    params = sampling_for(req, state.defaults, vocab)
    if plan is not None and plan.grammar is not None:
        params = replace(params, grammar=plan.grammar)
    loop = asyncio.get_running_loop()
    for p, (ids, max_tokens) in enumerate(zip(prompts, lengths)):
        for j in range(req.n or 1):
            index = len(reply.choices)
            matcher = None  # one matcher per choice: each follows its own tokens
            if params.grammar is not None:
                matcher = await make_matcher(params.grammar, state.tokenizer, vocab, params.stop_token_ids)
            seq = state.loop.new_sequence(
                ids, choice_params(params, j, max_tokens), request_id=f"{reply.rid}-{index}",
                sink=lambda ev, index=index: loop.call_soon_threadsafe(reply.events.put_nowait, (index, ev)),
                matcher=matcher)
            tools = ToolCallStream(plan.tool_names) if plan is not None and plan.tool_names else None
            reply.choices.append(Choice(index, p, seq, echo=echoes[p] if echoes else None, tools=tools))


def submit_all(state: ServerState, choices: list[Choice]) -> None:
    """All of a request's sequences or none: a full queue cancels those already in and answers 429."""
    try:
        for c in choices:
            state.loop.submit(c.seq)
    except QueueFull as exc:
        for c in choices:
            state.loop.cancel(c.seq.id)
        state.loop.metrics.request("rejected")
        raise ApiError(429, f"the server is busy ({exc}); retry later", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": "1"}) from None


async def cancel_on_disconnect(request: Request, state: ServerState, seq_ids: list[str]) -> None:
    """Wait for the client to go away, then cancel its sequences at once."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for seq_id in seq_ids:
                state.loop.cancel(seq_id)
            return


def record(c: Choice, ev) -> None:
    """Fold one event into a choice that is answered whole."""
    if isinstance(ev, Delta):
        c.parts.append(ev.text)
        c.logprobs += [(e.token, e) for e in ev.logprobs]
        c.tokens = ev.tokens
    elif isinstance(ev, PromptLogprobs):
        c.logprobs[:0] = [(t, e) for t, e in zip(c.seq.prompt_ids, ev.entries)]
    else:
        c.end, c.tokens = ev, ev.completion_tokens


# ----------------------------------------------------------------------------- whole answers


async def whole(reply: Reply, watcher: asyncio.Task) -> JSONResponse:
    """Wait for every choice, then answer with one body."""
    try:
        while not reply.done:
            index, ev = await reply.events.get()
            record(reply.choices[index], ev)
            if isinstance(ev, Finished) and ev.reason == "error":
                raise internal_error(ev.message)
        out = [whole_choice(reply, c) for c in reply.choices]
        return JSONResponse(R.body(reply.chat, reply.rid, reply.state.model_name, out, reply.usage()))
    finally:
        watcher.cancel()
        for c in reply.choices:
            reply.state.loop.cancel(c.seq.id)  # a no-op once finished; frees everything if not


def whole_choice(reply: Reply, c: Choice) -> dict:
    text, text_of = (c.echo or "") + "".join(c.parts), reply.state.token_text
    if not reply.chat:
        lps = R.completion_logprobs(c.logprobs, text_of) if reply.logprobs else None
        return R.completion_choice(c.index, text, c.end.reason, lps)
    lps = R.chat_logprobs([e for _, e in c.logprobs], text_of) if reply.logprobs else None
    if c.tools is None:
        return R.chat_choice(c.index, text, c.end.reason, lps)
    content, calls = parse_tool_calls(text, c.tools.names)
    out = R.chat_choice(c.index, content, finish_reason(c, bool(calls)), lps)
    if calls:
        out["message"]["tool_calls"] = calls
    return out


def finish_reason(c: Choice, called: bool) -> str:
    return "tool_calls" if called and c.end.reason == "stop" else c.end.reason


# ----------------------------------------------------------------------------- streamed answers


async def stream(reply: Reply, watcher: asyncio.Task):
    """The Server-Sent Events of a reply: its opening chunks, a chunk per event, ``[DONE]``; a keep-alive
    comment while nothing comes (it also notices a client gone). Whatever happens, unfinished
    sequences are cancelled at the end."""
    try:
        for text in opening(reply):
            yield text
        while not reply.done:
            try:
                index, ev = await asyncio.wait_for(reply.events.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            c = reply.choices[index]
            if isinstance(ev, Finished) and ev.reason == "error":
                c.end = ev
                yield R.sse(internal_error(ev.message).body())
                break
            for text in event_chunks(reply, c, ev):
                yield text
        yield R.sse("[DONE]")
    except Exception as exc:  # headers are out: the error goes in the stream, counted
        traceback.print_exception(exc, file=sys.stderr)
        reply.state.loop.metrics.request("error")
        yield R.sse(internal_error(f"internal error: {type(exc).__name__}").body())
    finally:
        watcher.cancel()
        for c in reply.choices:
            if c.end is None:
                reply.state.loop.cancel(c.seq.id)


def opening(reply: Reply) -> Iterator[str]:
    """Before any token: chat's role chunk per choice; completions' echoed prompt (unless its logprobs
    are asked for: then it comes with them, after the prefill)."""
    for c in reply.choices:
        if reply.chat:
            yield reply.sse([R.chat_delta(c.index, role=True)])
        elif c.echo is not None and c.seq.prompt_entries is None:
            yield reply.sse([piece(reply, c, c.echo, [])])


def event_chunks(reply: Reply, c: Choice, ev) -> Iterator[str]:
    """The chunks one event of choice ``c`` makes (none while text is held back)."""
    if isinstance(ev, PromptLogprobs):
        yield reply.sse([piece(reply, c, c.echo or "", list(zip(c.seq.prompt_ids, ev.entries)))])
    elif isinstance(ev, Delta):
        c.tokens = ev.tokens
        entries = [(e.token, e) for e in ev.logprobs]
        if c.tools is not None:  # content and tool-call deltas, as the parser gives them out
            for delta in c.tools.feed(ev.text) or ([{"content": ""}] if entries else []):
                yield reply.sse([tool_piece(reply, c, delta, entries)])
                entries = []
        elif ev.text or ev.logprobs:
            yield reply.sse([piece(reply, c, ev.text, entries)])
    else:
        yield from finish_chunks(reply, c, ev)


def finish_chunks(reply: Reply, c: Choice, ev: Finished) -> Iterator[str]:
    """A choice's last chunks: its held-back tool-call deltas, its finish reason; after the last choice,
    the usage chunk when ``include_usage`` asked for one."""
    c.end, c.tokens = ev, ev.completion_tokens
    reason = ev.reason
    if c.tools is not None:
        for delta in c.tools.finish():
            yield reply.sse([tool_piece(reply, c, delta, [])])
        reason = finish_reason(c, bool(c.tools.calls))
    last = reply.done
    yield reply.sse([piece(reply, c, "", [], finish=reason)], last=last)
    if last and reply.include_usage:
        yield reply.usage_sse()


def piece(reply: Reply, c: Choice, text: str, entries: list[tuple[int, TokenLogprob | None]],
          finish: str | None = None) -> dict:
    """One choice's chunk: its new text, the logprobs of its new tokens, maybe its finish reason."""
    text_of = reply.state.token_text
    if reply.chat:
        lps = R.chat_logprobs([e for _, e in entries], text_of) if reply.logprobs else None
        return R.chat_delta(c.index, text if text or finish is None else None, finish, logprobs=lps)
    lps = R.completion_logprobs(entries, text_of, c.offset) if reply.logprobs else None
    c.offset += len(text)
    return R.completion_choice(c.index, text, finish, lps)


def tool_piece(reply: Reply, c: Choice, delta: dict, entries: list[tuple[int, TokenLogprob | None]]) -> dict:
    """A chat choice's chunk whose delta is the tool parser's (content or tool_calls)."""
    out = piece(reply, c, delta.get("content", ""), entries)
    out["delta"] = delta
    return out
