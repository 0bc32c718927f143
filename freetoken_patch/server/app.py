"""The FastAPI app: the routes, each the same four steps (validate the request, render its
prompt, submit a job to the engine, send the reply streamed or whole), and the handlers that
turn any error into one error object in the wire format of the route's API."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_offload import SamplingParams

from . import anthropic_format as anthropic
from . import prompt, streams
from .anthropic_format import CountTokensRequest, MessagesRequest
from .auth import Guarded
from .jobs import Job, QueueFull, ShuttingDown
from .openai_format import ApiError, OutputParser, new_id
from .served import Served
from .validate import (ChatCompletion, ChatRequest, Completion, CompletionRequest,
                       anthropic_sampling_params, check_model, check_no_echo,
                       check_response_format, forced_tool, sampling_params, validation_message)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
             *anthropic.ROUTES)


def create_app(served: Served) -> Guarded:
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
        return {"status": "degraded" if eng.faults else "ok", "faults": eng.faults,
                "model": served.model_id, "parallel": eng.parallel,
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
            return streams.chat_stream(served, job, parser, rid, req.include_usage)
        done, parts = await streams.await_reply(job, parser, request)
        return streams.chat_reply(served, job, rid, done, parts)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        check_model(req.model, served.model_id, anthropic=True)
        params = anthropic_sampling_params(req)
        text, ids, tools, prefix = await run_in_threadpool(prompt.render_messages, served, req)
        job = _submit(served, ids, params, text)
        parser = OutputParser(text, tools, parse_tools=tools is not None, output_prefix=prefix)
        mid = anthropic.new_message_id()
        if req.stream:
            return streams.message_stream(served, job, parser, mid, req)
        done, parts = await streams.await_reply(job, parser, request)
        return streams.message_reply(served, req, job, mid, done, parts)

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
            return streams.completion_stream(served, job, rid, req.include_usage)
        done, parts = await streams.await_reply(job, None, request)
        return streams.completion_reply(served, job, rid, done, parts)

    return Guarded(app, served, ENDPOINTS)


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


__all__ = ["create_app", "Served", "ChatRequest", "CompletionRequest", "ChatCompletion",
           "Completion"]
