"""The outermost ASGI wrapper: one access-log line per request, and the retry headers clients
act on.

  log line    method, path, status, milliseconds, prompt / cached / completion tokens (what the
              route recorded in scope["ftpatch.log"]), the error's message if any; `text` (one
              line of key=value) or `json`, on stderr
  headers     x-should-retry: false on errors a retry cannot fix (400, 401, 403, 404, 413, 422):
              Anthropic's SDK (and so Claude Code) otherwise retries a 401 for minutes before it
              shows our message; x-should-retry: true and retry-after on 429, 503 and 529
"""
from __future__ import annotations

import json
import sys
import time

NO_RETRY = {400, 401, 403, 404, 405, 413, 422}
RETRY = {429, 503, 529}
RETRY_AFTER_S = "1"
ERROR_BODY_MAX = 8192     # bytes of an error body read for its message


class AccessLog:
    """Wraps `app`; `fmt` text | json | off; `out` the stream the lines go to."""

    def __init__(self, app, fmt: str = "text", out=None):
        self.app, self.fmt, self.out = app, fmt, out
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        log: dict = {}
        scope["ftpatch.log"] = log
        status, body = [500], bytearray()

        async def sending(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = dict(msg, headers=_with_retry_headers(msg.get("headers", []), msg["status"]))
            elif msg["type"] == "http.response.body" and status[0] >= 400 \
                    and len(body) < ERROR_BODY_MAX:
                body.extend(msg.get("body", b"")[:ERROR_BODY_MAX - len(body)])
            await send(msg)

        try:
            await self.app(scope, receive, sending)
        finally:
            if self.fmt != "off":
                if status[0] >= 400 and "error" not in log:
                    log["error"] = _error_message(bytes(body))
                self.write(scope, status[0], 1e3 * (time.perf_counter() - t0), log)

    def write(self, scope, status: int, ms: float, log: dict) -> None:
        job = log.get("job")
        rec = {"method": scope.get("method"), "path": scope.get("path"), "status": status,
               "ms": round(ms, 1)}
        if job is not None:
            rec["prompt_tokens"] = len(job.prompt)
            rec["cached_tokens"] = job.n_cached
            rec["completion_tokens"] = job.n_generated
            if job.error and not log.get("error"):
                log["error"] = job.error
        for k in ("input_tokens",):
            if k in log:
                rec[k] = log[k]
        if log.get("error"):
            rec["error"] = str(log["error"])[:500]
        out = self.out or sys.stderr
        if self.fmt == "json":
            line = json.dumps({"time": round(time.time(), 3), **rec}, ensure_ascii=False)
        else:
            line = " ".join(f"{k}={json.dumps(v, ensure_ascii=False) if k == 'error' else v}"
                            for k, v in rec.items())
        try:
            print(line, file=out, flush=True)
        except (OSError, ValueError):   # a closed stderr must not fail the request
            pass


def _with_retry_headers(headers, status: int):
    names = {bytes(k).lower() for k, _ in headers}
    out = list(headers)
    if status in NO_RETRY and b"x-should-retry" not in names:
        out.append((b"x-should-retry", b"false"))
    elif status in RETRY:
        if b"x-should-retry" not in names:
            out.append((b"x-should-retry", b"true"))
        if b"retry-after" not in names:
            out.append((b"retry-after", RETRY_AFTER_S.encode()))
    return out


def _error_message(body: bytes) -> str:
    """The message of an error body in either API's format (or the start of the body)."""
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace")
