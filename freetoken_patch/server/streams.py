"""A job's events out to the client, in the route's API: streamed as server-sent events (OpenAI's
chat and completion chunks; Anthropic's named events, with pings while the prompt is prefilled),
or awaited whole and formatted as one reply. A client that leaves cancels its job."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import StreamingResponse

from moe_offload import DoneEvent

from . import anthropic_format as anthropic
from .anthropic_format import MessagesRequest
from .jobs import Failure, Job
from .openai_format import (ApiError, OutputParser, chat_logprobs, collect, completion_logprobs,
                            error_body, now, sse, tool_call_object)
from .served import Served
from .validate import (ChatChoice, ChatCompletion, ChatMessageOut, Completion, CompletionChoice,
                       Usage)

DISCONNECT_POLL_S = 1.0   # how often a non-streamed request checks that its client is there
PING_S = 5.0              # an Anthropic stream sends `ping` while its prompt is prefilled


# ---- what both ways share ---------------------------------------------------------------------

def finish_reason(done: DoneEvent, tool_calls: bool) -> str:
    """OpenAI's finish_reason for how generation ended."""
    if done.reason in ("length", "context"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(job: Job, done: DoneEvent | None) -> Usage:
    n_gen = len(done.tokens) if done is not None else 0
    return Usage(prompt_tokens=len(job.prompt), completion_tokens=n_gen,
                 total_tokens=len(job.prompt) + n_gen,
                 prompt_tokens_details={"cached_tokens": job.n_cached})


def stop_fields(served: Served, req: MessagesRequest, done: DoneEvent, tool_use: bool) -> dict:
    """Anthropic's stop_reason and stop_sequence (the stop string the reply ended on)."""
    reason = anthropic.stop_reason(done.reason, tool_use)
    seq = (anthropic.matched_stop(served.tokenizer.decode(done.tokens), req.stop_sequences or [])
           if reason == "stop_sequence" else None)
    return {"stop_reason": reason, "stop_sequence": seq}


# ---- whole replies ----------------------------------------------------------------------------

async def await_reply(job: Job, parser: OutputParser | None, request: Request):
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
                job.error = ev.message
                raise ApiError(ev.status, ev.message)
            if getattr(ev, "logprob", None) is not None:
                job.token_logprobs.append(ev.logprob)
            text = ev.text
            parts += parser.push(text) if parser else [("content", text)] if text else []
            if isinstance(ev, DoneEvent):
                job.n_generated = len(ev.tokens)
                if parser:
                    parts += parser.finish()
                return ev, parts
    finally:
        job.cancel()     # a no-op once done; frees the slot when the client went away


def chat_reply(served: Served, job: Job, rid: str, done: DoneEvent, parts: list) -> dict:
    reasoning, content, calls = collect(parts)
    msg = ChatMessageOut(content=content if content or not calls else None,
                         reasoning_content=reasoning or None,
                         tool_calls=[tool_call_object(c) for c in calls] or None)
    lps = (chat_logprobs(served.tokenizer, job.token_logprobs)
           if job.params.logprobs is not None else None)
    out = ChatCompletion(id=rid, created=now(), model=served.model_id,
                         choices=[ChatChoice(message=msg, logprobs=lps,
                                             finish_reason=finish_reason(done, bool(calls)))],
                         usage=usage(job, done)).model_dump(exclude_none=True)
    if lps is not None:      # refusal: null is part of OpenAI's shape
        out["choices"][0]["logprobs"] = lps
    return out


def completion_reply(served: Served, job: Job, rid: str, done: DoneEvent, parts: list,
                     echo: str | None = None) -> dict:
    """echo: the prompt's text, which the choice's text then starts with (its tokens' logprobs
    first when logprobs are asked for)."""
    text = "".join(t for _, t in parts)
    lps = None
    if job.params.logprobs is not None:
        head = job.echoed_logprobs() if echo is not None else []
        lps = completion_logprobs(served.tokenizer, head + job.token_logprobs)
    if echo is not None:
        text = echo + text
    choice = CompletionChoice(text=text, finish_reason=finish_reason(done, False), logprobs=lps)
    out = Completion(id=rid, created=now(), model=served.model_id, choices=[choice],
                     usage=usage(job, done)).model_dump(exclude_none=True)
    if lps is not None:
        out["choices"][0]["logprobs"] = lps
    return out


def message_reply(served: Served, req: MessagesRequest, job: Job, mid: str, done: DoneEvent,
                  parts: list) -> dict:
    blocks = anthropic.Blocks(anthropic.enable_thinking(req))
    blocks.events(parts)
    return {"id": mid, "type": "message", "role": "assistant", "model": served.model_id,
            "content": blocks.content,
            **stop_fields(served, req, done, blocks.has_tool_use),
            "usage": anthropic.usage(len(job.prompt), job.n_cached, len(done.tokens))}


# ---- streams ----------------------------------------------------------------------------------

def chat_stream(served: Served, job: Job, parser: OutputParser, rid: str,
                include_usage: bool) -> StreamingResponse:
    return _respond(_ChatStream(served, job, parser, rid, include_usage).chunks())


def completion_stream(served: Served, job: Job, rid: str, include_usage: bool,
                      echo: str | None = None) -> StreamingResponse:
    return _respond(_CompletionStream(served, job, None, rid, include_usage, echo).chunks())


def message_stream(served: Served, job: Job, parser: OutputParser, mid: str,
                   req: MessagesRequest) -> StreamingResponse:
    return _respond(_MessageStream(served, job, parser, mid, req).chunks())


def _respond(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Stream:
    """One reply as server-sent events: the loop over the job's events, the same in every
    dialect; a subclass says what each part of it sends."""
    ping_s: float | None = None      # send ping() at this interval until the first event

    def __init__(self, served: Served, job: Job, parser: OutputParser | None):
        self.served, self.job, self.parser = served, job, parser
        self.lps: list = []          # TokenLogprob of tokens whose chunk has not gone out

    async def chunks(self):
        for c in self.opening():
            yield c
        job = self.job
        try:
            ev = None
            while ev is None:     # no timeout without ping_s
                try:
                    ev = await asyncio.wait_for(job.events.get(), self.ping_s)
                except asyncio.TimeoutError:
                    yield self.ping()
            if not isinstance(ev, Failure):
                for c in self.started():
                    yield c
            while True:
                if isinstance(ev, Failure):
                    job.error = ev.message
                    yield self.failed(ev.message)
                    return
                if getattr(ev, "logprob", None) is not None:
                    self.lps.append(ev.logprob)
                for c in self.text(ev.text):
                    yield c
                if isinstance(ev, DoneEvent):
                    job.n_generated = len(ev.tokens)
                    for c in self.done(ev):
                        yield c
                    return
                ev = await job.events.get()
        finally:
            job.cancel()     # a no-op once done; frees the slot when the client went away

    def opening(self) -> list[str]:
        """Sent before the first event arrives."""
        return []

    def ping(self) -> str:
        raise NotImplementedError

    def started(self) -> list[str]:
        """Sent once the first event is there, unless it is a failure."""
        return []

    def text(self, text: str) -> list[str]:
        """Sent for each event's text."""
        raise NotImplementedError

    def done(self, ev: DoneEvent) -> list[str]:
        """Sent at the end, after the last text."""
        raise NotImplementedError

    def failed(self, message: str) -> str:
        raise NotImplementedError


class _OpenAIStream(_Stream):
    """OpenAI's chunks: each repeats the reply's id, object, created and model; the last says
    why it finished; then the usage (if asked for) and [DONE]."""
    object = key = ""                 # the chunks' object; the field of their one choice

    def __init__(self, served, job, parser, rid: str, include_usage: bool):
        super().__init__(served, job, parser)
        self.rid, self.include_usage = rid, include_usage

    def opening(self) -> list[str]:
        self.created = now()
        return []

    def chunk(self, value, finish: str | None = None) -> str:
        """A chunk; the logprobs of the tokens since the last chunk ride on it."""
        lps, self.lps = self.lps, []
        logprobs = None
        if lps and self.job.params.logprobs is not None:
            logprobs = self.logprobs(lps)
        return sse({"id": self.rid, "object": self.object, "created": self.created,
                    "model": self.served.model_id,
                    "choices": [{"index": 0, self.key: value, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    def logprobs(self, lps: list) -> dict:
        return chat_logprobs(self.served.tokenizer, lps)

    def done(self, ev: DoneEvent) -> list[str]:
        out = self.closing(ev)
        if self.include_usage:
            out.append(sse({"id": self.rid, "object": self.object, "created": self.created,
                            "model": self.served.model_id, "choices": [],
                            "usage": usage(self.job, ev).model_dump()}))
        return out + [sse("[DONE]")]

    def closing(self, ev: DoneEvent) -> list[str]:
        raise NotImplementedError

    def failed(self, message: str) -> str:
        return sse(error_body(message, "server_error"))


class _ChatStream(_OpenAIStream):
    object, key = "chat.completion.chunk", "delta"
    n_calls = 0

    def opening(self) -> list[str]:
        return super().opening() + [self.chunk({"role": "assistant", "content": ""})]

    def text(self, text: str) -> list[str]:
        return self._deltas(self.parser.push(text))

    def closing(self, ev: DoneEvent) -> list[str]:
        out = self._deltas(self.parser.finish())
        return out + [self.chunk({}, finish_reason(ev, self.n_calls > 0))]

    def _deltas(self, parts) -> list[str]:
        out = []
        for kind, val in parts:
            if kind == "tool_call":
                out.append(self.chunk({"tool_calls": [tool_call_object(val, self.n_calls)]}))
                self.n_calls += 1
            elif kind == "reasoning":
                out.append(self.chunk({"reasoning_content": val}))
            else:
                out.append(self.chunk({"content": val}))
        return out


class _CompletionStream(_OpenAIStream):
    object, key = "text_completion", "text"

    def __init__(self, served, job, parser, rid: str, include_usage: bool,
                 echo: str | None = None):
        super().__init__(served, job, parser, rid, include_usage)
        self.echo = echo              # the prompt's text, sent first
        self.offset = 0               # characters of text the chunks' logprobs have covered

    def logprobs(self, lps: list) -> dict:
        out = completion_logprobs(self.served.tokenizer, lps, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def started(self) -> list[str]:
        """With echo: the prompt's text first (its logprobs, once the engine has them)."""
        if self.echo is None:
            return []
        if self.job.params.logprobs is not None:
            self.lps = self.job.echoed_logprobs() + self.lps
        return [self.chunk(self.echo)]

    def text(self, text: str) -> list[str]:
        return [self.chunk(text)] if text else []

    def closing(self, ev: DoneEvent) -> list[str]:
        return [self.chunk("", finish_reason(ev, False))]


class _MessageStream(_Stream):
    """Anthropic's stream: pings while the prompt is prefilled, message_start, the content
    blocks' events, message_delta (stop reason, usage), message_stop."""

    def __init__(self, served, job, parser, mid: str, req: MessagesRequest):
        super().__init__(served, job, parser)
        self.mid, self.req, self.ping_s = mid, req, PING_S
        self.blocks = anthropic.Blocks(anthropic.enable_thinking(req))

    def ping(self) -> str:
        return anthropic.event("ping", {})

    def started(self) -> list[str]:
        return [anthropic.event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant",
            "model": self.served.model_id, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropic.usage(len(self.job.prompt), self.job.n_cached, 0)}})]

    def text(self, text: str) -> list[str]:
        return self.blocks.events(self.parser.push(text))

    def done(self, ev: DoneEvent) -> list[str]:
        job, blocks = self.job, self.blocks
        return blocks.events(self.parser.finish()) + blocks.finish() + [
            anthropic.event("message_delta", {
                "delta": stop_fields(self.served, self.req, ev, blocks.has_tool_use),
                "usage": anthropic.usage(len(job.prompt), job.n_cached, len(ev.tokens))}),
            anthropic.event("message_stop", {})]

    def failed(self, message: str) -> str:
        return anthropic.event("error", {"error": {"type": "api_error", "message": message}})
