"""The API key, the request limits and the request counts, as a plain ASGI wrapper around the
app (so streamed replies pass through unbuffered): every route but /health wants the key, by
'Authorization: Bearer KEY' (OpenAI's clients) or 'x-api-key: KEY' (Anthropic's), checked on
the headers before any body is read; the body is then read within the limits (limits.py); every
request is counted by route and status."""
from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from . import anthropic_format as anthropic
from .limits import RequestLimits
from .openai_format import error_body
from .served import Served

MISSING_KEY = ("a valid API key is required: send the header 'Authorization: Bearer KEY' or "
               "'x-api-key: KEY' with the key the server was started with (--api-key)")


class Guarded:
    """The app behind the key check and the counts; `endpoints` are the paths counted by name
    (any other counts as "other")."""

    def __init__(self, app, served: Served, endpoints: tuple[str, ...]):
        self.app, self.served, self.endpoints = app, served, endpoints
        self.state = app.state
        self.limited = RequestLimits(app, served.limits)
        if served.api_key is not None and not served.api_key.strip():
            raise ValueError("an empty API key would let every request in; give a key or None")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status = [500]

        async def sending(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            key = self.served.api_key
            if key and path != "/health" and not authorized(scope, key):
                body = (anthropic.error_body(401, MISSING_KEY) if path.startswith("/v1/messages")
                        else error_body(MISSING_KEY, code="invalid_api_key"))
                resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, sending)
            return await self.limited(scope, receive, sending)
        finally:
            self.served.metrics.request(endpoint, status[0])


def authorized(scope, key: str) -> bool:
    """Whether the request's headers carry `key`, compared in constant time."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                   key.encode()):
                return True
        elif name == b"x-api-key" and hmac.compare_digest(value.strip(), key.encode()):
            return True
    return False
