"""What a client may cost the server: request bodies and their message counts, the time to send
headers and a body, and how many connections are open at once (below the process's file
limit). Each refusal is an error object in the route's API format.

Two layers:
  RequestLimits   an ASGI wrapper (the app behind it sees only bodies that passed): a body over
                  --max-body is 413 before it is read (Content-Length) or as soon as it passes
                  the limit (chunked); one that does not arrive within --body-timeout is 408;
                  a chat or messages body with more than --max-messages messages is 413 before
                  the app parses and validates it.
  protocol_class  uvicorn's h11 protocol with two additions uvicorn lacks: a deadline for a
                  request's headers (--header-timeout; uvicorn closes only idle keep-alive
                  connections, and a client that never finishes its headers never reaches the
                  app), and a connection cap (--max-connections, lowered to fit RLIMIT_NOFILE):
                  a connection beyond it gets 503 for its request and is closed; past the file
                  descriptors kept for that, it is closed at once. uvicorn's own
                  `limit_concurrency` answers 503 only once a request's headers are in, so
                  connections that never send any would still hold their descriptors.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
from dataclasses import dataclass

MiB = 1 << 20
MESSAGE_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens")
REFUSE_WAIT_S = 1.0    # a connection over the cap: how long its request may take to arrive
FD_RESERVE = 64        # descriptors kept for everything but connections (files, pipes, workers)


@dataclass(frozen=True)
class Limits:
    max_body: int = 16 * MiB          # bytes of a request body
    max_messages: int = 10_000        # messages of a chat or Anthropic request
    header_timeout: float = 10.0      # seconds to send a request's headers
    body_timeout: float = 60.0        # seconds to send a request's body
    max_connections: int = 512        # connections open at once (before the fd limit's cut)

    def connection_cap(self) -> tuple[int, int, int]:
        """(connections served, connections held at all, listen backlog), inside RLIMIT_NOFILE
        less what the process has open now and a reserve. asyncio accepts up to `backlog`
        connections in a burst before any of them is looked at, so the burst's descriptors are
        kept free; of the rest, half serve and half may wait for a 503; past that a new
        connection is closed at once."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return self.max_connections, 2 * self.max_connections, 2048
        try:
            open_now = len(os.listdir("/proc/self/fd"))
        except OSError:
            open_now = 64
        room = max(4, soft - open_now - FD_RESERVE)
        backlog = max(2, min(2048, room // 8))
        held = room - backlog
        return max(1, min(self.max_connections, held // 2)), held, backlog


def error_response(path: str, status: int, message: str, code: str, headers: dict | None = None):
    """A JSONResponse with the error object of the route's API (Anthropic's on /v1/messages)."""
    from fastapi.responses import JSONResponse

    from . import anthropic_format as anthropic
    from .openai_format import error_body
    if path.startswith("/v1/messages"):
        body = anthropic.error_body(status, message, code)
    else:
        body = error_body(message, "invalid_request_error" if status < 500 else "server_error",
                          code=code)
    return JSONResponse(body, status_code=status, headers=headers)


class RequestLimits:
    """The ASGI wrapper: a request's body is read here, within the limits, and handed on whole."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path, lim = scope.get("path", ""), self.limits
        length = _content_length(scope)
        if length is not None and length > lim.max_body:
            return await self._too_large(scope, receive, send, path)
        body = bytearray()
        try:
            async with asyncio.timeout(lim.body_timeout):
                more = True
                while more:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body += msg.get("body", b"")
                    more = msg.get("more_body", False)
                    if len(body) > lim.max_body:
                        return await self._too_large(scope, receive, send, path)
        except TimeoutError:
            resp = error_response(path, 408, f"the request body did not arrive within "
                                  f"{lim.body_timeout:g} s (--body-timeout)", "body_timeout",
                                  {"Connection": "close"})
            return await resp(scope, receive, send)
        if path in MESSAGE_ROUTES and body:
            n = await asyncio.to_thread(_message_count, bytes(body))
            if n > lim.max_messages:
                resp = error_response(path, 413, f"the request has {n:,} messages, more than the "
                                      f"{lim.max_messages:,} this server takes (--max-messages)",
                                      "too_many_messages")
                return await resp(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, path: str):
        lim = self.limits
        resp = error_response(path, 413, f"the request body is larger than {_size(lim.max_body)} "
                              "(--max-body)", "request_too_large", {"Connection": "close"})
        await resp(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _message_count(body: bytes) -> int:
    """len(body["messages"]) of a JSON object body; 0 where it is no such thing (the app's
    validation says what is wrong with it)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return 0
    msgs = obj.get("messages") if isinstance(obj, dict) else None
    return len(msgs) if isinstance(msgs, list) else 0


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n:,} bytes"


def protocol_class(limits: Limits):
    """uvicorn's H11Protocol with the header deadline and the connection cap (see the module's
    docstring); pass it as uvicorn.Config(http=...)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol
    cap, most, burst = limits.connection_cap()

    async def over_capacity(scope, receive, send):
        resp = error_response(scope.get("path", ""), 503,
                              f"the server holds {cap} connections, its limit "
                              "(--max-connections and the open-file limit); retry in a moment",
                              "too_many_connections", {"Connection": "close", "Retry-After": "1"})
        await resp(scope, receive, send)

    class LimitedH11Protocol(H11Protocol):
        connection_cap, connections_held, backlog = cap, most, burst   # uvicorn.Config(backlog=)
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            n = len(self.connections)
            if n > most:            # no descriptor to spare for a reply
                transport.abort()
                return
            if n > cap:
                self.app = over_capacity
                self._arm(REFUSE_WAIT_S)
            else:
                self._arm(limits.header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(limits.header_timeout)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._headers_due)

        def _headers_due(self) -> None:
            """Close the connection if it is still waiting for a request's headers (a request
            in progress is the body timeout's and the app's business)."""
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return LimitedH11Protocol
