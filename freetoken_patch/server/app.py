"""The FastAPI app: the routes, each the same four steps (validate the request, render its
prompt, submit a job to the engine, send the reply streamed or whole), and the handlers that
turn any error into one error object in the wire format of the route's API."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_offload import SamplingParams

from . import anthropic_format as anthropic
from . import prompt, streams, structured
from .access import AccessLog
from .anthropic_format import CountTokensRequest, MessagesRequest
from .auth import Guarded
from .jobs import Job, QueueFull, ShuttingDown
from .openai_format import ApiError, OutputParser, new_id
from .served import Served
from .validate import (ChatCompletion, ChatRequest, Completion, CompletionRequest,
                       anthropic_sampling_params, bad_value, check_model, check_no_suffix,
                       check_text,
                       forced_tool, sampling_params, validation_message)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", *anthropic.ROUTES)
TOKENIZE_MAX_CHARS = 4 << 20       # /tokenize's content; a chat prompt's own limit is the context


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize: content, add_special, with_pieces."""
    model_config = ConfigDict(strict=True, extra="allow")
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    tokens: list[int]


def create_app(served: Served, log_format: str = "text", log_out=None) -> AccessLog:
    """The app; its lifespan starts the engine thread and, at shutdown, drains it. Outermost,
    the access log (`log_format` text | json | off, to `log_out` or stderr) and the retry
    headers; inside it the API key and the counts (auth.Guarded)."""
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

    def model_card() -> dict:
        return {"id": served.model_id, "object": "model", "created": served.created,
                "owned_by": "ftpatch", "meta": served.model_meta()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in (served.model_id, "default"):
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves "
                                f"{served.model_id!r} (or \"default\")", param="model",
                           code="model_not_found")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if len(req.content) > TOKENIZE_MAX_CHARS:
            raise bad_value("content", f"{len(req.content)} characters",
                            f"give at most {TOKENIZE_MAX_CHARS} characters")
        tok = served.tokenizer
        ids = await run_in_threadpool(tok.encode, req.content, add_special=req.add_special,
                                      parse_special=req.parse_special)
        if not req.with_pieces:
            return {"tokens": ids}
        out = []
        for i in ids:
            b = tok.token_bytes(i)
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:   # llama-server gives a piece's bytes when not UTF-8
                piece = list(b)
            out.append({"id": i, "piece": piece})
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        tok = served.tokenizer
        bad = [i for i in req.tokens if not 0 <= i < len(tok)]
        if bad:
            raise bad_value("tokens", bad[0], f"token ids run from 0 to {len(tok) - 1}")
        return {"content": tok.decode(req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req.model, served.model_id)
        check_text(req.model_dump())
        params = sampling_params(req, req.max_completion_tokens, served.n_ids)
        schema = structured.response_format_schema(req.response_format)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        forced = forced_tool(req.tool_choice, tools)
        use_tools = bool(tools) and req.tool_choice != "none"
        if schema is not None and forced[0]:
            raise ApiError(400, "response_format and a forced tool_choice both constrain the "
                                "reply; send one of them", param="response_format",
                           code="invalid_value")
        _check_mode(served, params, schema is not None or forced[0])
        p = await run_in_threadpool(prompt.render_chat, served, req,
                                    tools if use_tools else None, forced, schema is not None)
        constraint = await run_in_threadpool(_constraint, served, p, tools, schema, use_tools)
        job = _submit(served, p, params, constraint, request)
        parser = OutputParser(p.text, tools, parse_tools=use_tools, output_prefix=p.prefix)
        rid = new_id("chatcmpl")
        if req.stream:
            return streams.chat_stream(served, job, parser, rid, req.include_usage)
        done, parts = await streams.await_reply(job, parser, request)
        return streams.chat_reply(served, job, rid, done, parts)

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        check_model(req.model, served.model_id, anthropic=True)
        check_text(req.model_dump())
        params = anthropic_sampling_params(req)
        forced = anthropic.forced_tool(req) if req.tools else (False, None)
        _check_mode(served, params, forced[0])
        p = await run_in_threadpool(prompt.render_messages, served, req)
        constraint = await run_in_threadpool(_constraint, served, p, p.tools or [], None,
                                             bool(p.tools))
        job = _submit(served, p, params, constraint, request)
        parser = OutputParser(p.text, p.tools, parse_tools=p.tools is not None,
                              output_prefix=p.prefix)
        mid = anthropic.new_message_id()
        if req.stream:
            return streams.message_stream(served, job, parser, mid, req)
        done, parts = await streams.await_reply(job, parser, request)
        return streams.message_reply(served, req, job, mid, done, parts)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest, request: Request):
        check_model(req.model, served.model_id, anthropic=True)
        check_text(req.model_dump())
        p = await run_in_threadpool(prompt.render_messages, served, req, False)
        request.scope.get("ftpatch.log", {})["input_tokens"] = len(p.ids)
        return {"input_tokens": len(p.ids)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model, served.model_id)
        check_text(req.model_dump())
        params = sampling_params(req, None, served.n_ids)
        check_no_suffix(req)
        _check_mode(served, params, False, echo=req.echo and params.logprobs is not None)
        ids = await run_in_threadpool(prompt.encode_prompt, served, req.prompt)
        echo = None
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else served.tokenizer.decode(ids)
        job = _submit(served, prompt.Prompt(None, ids), params, None, request,
                      echo_logprobs=params.logprobs if req.echo else None)
        rid = new_id("cmpl")
        if req.stream:
            return streams.completion_stream(served, job, rid, req.include_usage, echo)
        done, parts = await streams.await_reply(job, None, request)
        return streams.completion_reply(served, job, rid, done, parts, echo)

    return AccessLog(Guarded(app, served, ENDPOINTS), log_format, log_out)


def _check_mode(served: Served, params, constrained: bool, echo: bool = False) -> None:
    """Speculative decoding (--draft) draws several ids from one verify step: no mask, no
    logprobs there."""
    if served.engine.draft is None:
        return
    what = ("structured output and forced tool calls" if constrained else
            "logprobs" if params.logprobs is not None or echo else None)
    if what:
        raise ApiError(400, f"{what} are not available while the server decodes speculatively "
                            "(--draft); restart it without --draft for them",
                       param="logprobs" if not constrained else "response_format",
                       code="unsupported")


def _constraint(served: Served, p, tools: list, schema: dict | None, use_tools: bool):
    """The request's mask: a GrammarConstraint (a schema, a forced call), a TriggeredConstraint
    (tools the reply may call: a call it begins must parse), or None when the reply is free."""
    if schema is not None:
        return structured.constraint_for(served, schema=schema)
    force, name = p.forced
    if not force:
        return structured.lazy_tool_calls(served, tools, p.text) if use_tools else None
    return structured.constraint_for(served, grammar=structured.call_grammar(served, tools, name))


def _error(request: Request, e: ApiError) -> JSONResponse:
    """An error in the wire format of the route's API (Anthropic's on /v1/messages)."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic.error_body(e.status, e.message, e.code),
                            status_code=anthropic.error_status(e.status, e.code),
                            headers=e.headers)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _submit(served: Served, p, params: SamplingParams, constraint=None, request=None,
            echo_logprobs: int | None = None) -> Job:
    """Queue a request: its Prompt (a chat's text lets it continue a cached conversation whose
    reply re-tokenizes differently, tokenized by `p.encode`), its constraint; the access log
    gets the job."""
    job = Job(p.ids, params, text=p.text, encode=p.encode, constraint=constraint,
              echo_logprobs=echo_logprobs)
    if request is not None:
        request.scope.get("ftpatch.log", {})["job"] = job
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
           "Completion", "TokenizeRequest", "DetokenizeRequest"]
