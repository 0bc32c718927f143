"""The FastAPI app: OpenAI-compatible routes and Anthropic's /v1/messages (their request models
and checks are validate.py's, their prompts prompt.py's), errors in the wire format of the
route's API, API-key auth and per-route request counts (a plain ASGI wrapper, so streams are
not buffered)."""
from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_offload import DoneEvent, SamplingParams, TokenEvent

from . import anthropic_format as anthropic
from . import prompt
from .anthropic_format import CountTokensRequest, MessagesRequest
from .engine import Failure, Job, QueueFull, ShuttingDown
from .openai_format import (ApiError, OutputParser, collect, error_body, new_id, now, sse,
                            tool_call_object)
from .served import Served
from .validate import (ChatChoice, ChatCompletion, ChatMessageOut, ChatRequest, Completion,
                       CompletionChoice, CompletionRequest, Usage, anthropic_sampling_params,
                       check_model, check_no_echo, check_response_format, forced_tool,
                       sampling_params, validation_message)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
             *anthropic.ROUTES)
DISCONNECT_POLL_S = 1.0   # how often a non-streamed request checks that its client is there
PING_S = 5.0              # an Anthropic stream sends `ping` while its prompt is prefilled


def create_app(served: Served) -> FastAPI:
    """The app; its lifespan starts the engine thread and, at shutdown, drains it."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        yield
        await run_in_threadpool(served.engine.shutdown, True)

    app = FastAPI(title="ftpatch", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.served = served

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _error(request, e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        msg, param = validation_message(e.errors())
        return _error(request, ApiError(400, msg, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}; the routes are {', '.join(ENDPOINTS)}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
                   e.status_code, str(e.detail))
        return _error(request, ApiError(e.status_code, msg, code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):
        return _error(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"[:500],
                                        type="server_error"))

    @app.get("/health")
    async def health():
        eng = served.engine
        return {"status": "ok", "model": served.model_id, "parallel": eng.parallel,
                "mode": eng.mode, "prefill_chunk": eng.prefill_chunk, "n_ctx": served.n_ctx,
                "queue_size": eng.queue_size, "prefix_cache": eng.cache.size,
                "draft": eng.draft_summary(),
                "active": eng.n_active, "queued": eng.queue_length}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(served.metrics.render(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served.model_id, "object": "model", "created": served.created,
            "owned_by": "ftpatch", "meta": {"n_ctx": served.n_ctx}}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req.model, served.model_id)
        params = sampling_params(req, req.max_completion_tokens)
        check_response_format(req.response_format)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        forced = forced_tool(req.tool_choice, tools)
        use_tools = bool(tools) and req.tool_choice != "none"
        text, ids, prefix = await run_in_threadpool(prompt.render_chat, served, req,
                                                    tools if use_tools else None, forced)
        job = _submit(served, ids, params, text)
        parser = OutputParser(text, tools, parse_tools=use_tools, output_prefix=prefix)
        rid = new_id("chatcmpl")
        if req.stream:
            return _stream(_chat_chunks(served, job, parser, rid, req.include_usage))
        done, parts = await _collect(job, parser, request)
        reasoning, content, calls = collect(parts)
        msg = ChatMessageOut(content=content if content or not calls else None,
                             reasoning_content=reasoning or None,
                             tool_calls=[tool_call_object(c) for c in calls] or None)
        return ChatCompletion(id=rid, created=now(), model=served.model_id,
                              choices=[ChatChoice(message=msg,
                                                  finish_reason=_finish(done, bool(calls)))],
                              usage=_usage(job, done)).model_dump(exclude_none=True)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        check_model(req.model, served.model_id, anthropic=True)
        params = anthropic_sampling_params(req)
        text, ids, tools, prefix = await run_in_threadpool(prompt.render_messages, served, req)
        job = _submit(served, ids, params, text)
        parser = OutputParser(text, tools, parse_tools=tools is not None, output_prefix=prefix)
        mid = anthropic.new_message_id()
        if req.stream:
            return _stream(_message_events(served, job, parser, mid, req))
        done, parts = await _collect(job, parser, request)
        blocks = anthropic.Blocks()
        blocks.events(parts)
        return {"id": mid, "type": "message", "role": "assistant", "model": served.model_id,
                "content": blocks.content,
                **_stop_fields(served, req, done, blocks.has_tool_use),
                "usage": anthropic.usage(len(job.prompt), job.n_cached, len(done.tokens))}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        check_model(req.model, served.model_id, anthropic=True)
        _, ids, _, _ = await run_in_threadpool(prompt.render_messages, served, req, False)
        return {"input_tokens": len(ids)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model, served.model_id)
        params = sampling_params(req, None)
        check_no_echo(req)
        ids = await run_in_threadpool(prompt.encode_prompt, served, req.prompt)
        job = _submit(served, ids, params)
        rid = new_id("cmpl")
        if req.stream:
            return _stream(_completion_chunks(served, job, rid, req.include_usage))
        done, parts = await _collect(job, None, request)
        text = "".join(t for _, t in parts)
        return Completion(id=rid, created=now(), model=served.model_id,
                          choices=[CompletionChoice(text=text, finish_reason=_finish(done, False))],
                          usage=_usage(job, done)).model_dump(exclude_none=True)

    return _Observe(app, served)


# ---- errors, the queue ---------------------------------------------------------------------------

def _error(request: Request, e: ApiError) -> JSONResponse:
    """An error in the wire format of the route's API (Anthropic's on /v1/messages)."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic.error_body(e.status, e.message, e.code),
                            status_code=anthropic.error_status(e.status, e.code),
                            headers=e.headers)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _submit(served: Served, ids: list[int], params: SamplingParams, text: str | None = None
            ) -> Job:
    """Queue a request; `text` (a chat's rendered prompt, which `ids` encode) lets it continue
    a cached conversation whose reply re-tokenizes differently."""
    job = Job(ids, params, text=text)
    try:
        served.engine.submit(job)
    except QueueFull:
        raise ApiError(429, f"the server is busy: {served.engine.queue_size} requests are "
                            "queued already; retry after a moment", code="queue_full",
                       type="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down", code="shutting_down") from None
    return job


# ---- replies -------------------------------------------------------------------------------------

async def _collect(job: Job, parser: OutputParser | None, request: Request):
    """Wait for the whole reply: (DoneEvent, parts). A client that hangs up is noticed within
    a second and its sequence dropped."""
    parts: list = []
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if loop.time() - checked >= DISCONNECT_POLL_S:
                checked = loop.time()
                if await request.is_disconnected():
                    raise ApiError(499, "the client closed the connection") from None
            if ev is None:
                continue
            if isinstance(ev, Failure):
                raise ApiError(ev.status, ev.message)
            text = ev.text
            parts += parser.push(text) if parser else [("content", text)] if text else []
            if isinstance(ev, DoneEvent):
                if parser:
                    parts += parser.finish()
                return ev, parts
    finally:
        job.cancel()     # a no-op once done; frees the slot when the client went away


def _finish(done: DoneEvent, tool_calls: bool) -> str:
    if done.reason in ("length", "context"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _usage(job: Job, done: DoneEvent | None) -> Usage:
    n_gen = len(done.tokens) if done is not None else 0
    return Usage(prompt_tokens=len(job.prompt), completion_tokens=n_gen,
                 total_tokens=len(job.prompt) + n_gen,
                 prompt_tokens_details={"cached_tokens": job.n_cached})


def _stream(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(job: Job):
    """The job's events until its end; cancels the job if the consumer leaves first."""
    try:
        while True:
            ev = await job.events.get()
            yield ev
            if not isinstance(ev, TokenEvent):
                return
    finally:
        job.cancel()


async def _chat_chunks(served: Served, job: Job, parser: OutputParser, rid: str, usage: bool):
    created = now()

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": served.model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]})

    def deltas(parts) -> list[str]:
        out = []
        for kind, val in parts:
            if kind == "tool_call":
                out.append(chunk({"tool_calls": [tool_call_object(val, n_calls[0])]}))
                n_calls[0] += 1
            elif kind == "reasoning":
                out.append(chunk({"reasoning_content": val}))
            else:
                out.append(chunk({"content": val}))
        return out

    n_calls = [0]
    yield chunk({"role": "assistant", "content": ""})
    async for ev in _events(job):
        if isinstance(ev, Failure):
            yield sse(error_body(ev.message, "server_error"))
            return
        for c in deltas(parser.push(ev.text)):
            yield c
        if isinstance(ev, DoneEvent):
            for c in deltas(parser.finish()):
                yield c
            yield chunk({}, _finish(ev, n_calls[0] > 0))
            if usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": served.model_id, "choices": [],
                           "usage": _usage(job, ev).model_dump()})
            yield sse("[DONE]")


def _stop_fields(served: Served, req: MessagesRequest, done: DoneEvent, tool_use: bool) -> dict:
    reason = anthropic.stop_reason(done.reason, tool_use)
    seq = (anthropic.matched_stop(served.tokenizer.decode(done.tokens), req.stop_sequences or [])
           if reason == "stop_sequence" else None)
    return {"stop_reason": reason, "stop_sequence": seq}


async def _message_events(served: Served, job: Job, parser: OutputParser, mid: str,
                          req: MessagesRequest):
    """Anthropic's stream: pings while the prompt is prefilled, message_start, the content
    blocks' events, message_delta (stop reason, usage), message_stop."""
    ev = None
    try:
        while ev is None:
            try:
                ev = await asyncio.wait_for(job.events.get(), PING_S)
            except asyncio.TimeoutError:
                yield anthropic.event("ping", {})
        start_usage = anthropic.usage(len(job.prompt), job.n_cached, 0)
        if not isinstance(ev, Failure):
            yield anthropic.event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": served.model_id,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": start_usage}})
        blocks = anthropic.Blocks()
        while True:
            if isinstance(ev, Failure):
                yield anthropic.event("error", {"error": {"type": "api_error",
                                                          "message": ev.message}})
                return
            for e in blocks.events(parser.push(ev.text)):
                yield e
            if isinstance(ev, DoneEvent):
                for e in blocks.events(parser.finish()) + blocks.finish():
                    yield e
                yield anthropic.event("message_delta", {
                    "delta": _stop_fields(served, req, ev, blocks.has_tool_use),
                    "usage": anthropic.usage(len(job.prompt), job.n_cached, len(ev.tokens))})
                yield anthropic.event("message_stop", {})
                return
            ev = await job.events.get()
    finally:
        job.cancel()


async def _completion_chunks(served: Served, job: Job, rid: str, usage: bool):
    created = now()

    def chunk(text: str, finish: str | None = None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": created,
                    "model": served.model_id,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]})

    async for ev in _events(job):
        if isinstance(ev, Failure):
            yield sse(error_body(ev.message, "server_error"))
            return
        if ev.text:
            yield chunk(ev.text)
        if isinstance(ev, DoneEvent):
            yield chunk("", _finish(ev, False))
            if usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": served.model_id, "choices": [],
                           "usage": _usage(job, ev).model_dump()})
            yield sse("[DONE]")


# ---- auth and counts --------------------------------------------------------------------------

class _Observe:
    """ASGI wrapper: the API key on every route but /health, and requests counted by route
    and status (a plain wrapper, so streamed bodies pass through unbuffered)."""

    def __init__(self, app: FastAPI, served: Served):
        self.app, self.served = app, served
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = [500]

        async def sending(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            key = self.served.api_key
            if key and path != "/health" and not _authorized(scope, key):
                msg = ("a valid API key is required: send the header 'Authorization: Bearer KEY' "
                       "or 'x-api-key: KEY' with the key the server was started with (--api-key)")
                body = (anthropic.error_body(401, msg) if path.startswith("/v1/messages")
                        else error_body(msg, code="invalid_api_key"))
                resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, sending)
            return await self.app(scope, receive, sending)
        finally:
            self.served.metrics.request(endpoint, status[0])


def _authorized(scope, key: str) -> bool:
    """'Authorization: Bearer KEY' (OpenAI's clients) or 'x-api-key: KEY' (Anthropic's)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                   key.encode()):
                return True
        elif name == b"x-api-key" and hmac.compare_digest(value.strip(), key.encode()):
            return True
    return False


__all__ = ["create_app", "Served", "ChatRequest", "CompletionRequest", "ChatCompletion",
           "Completion"]
