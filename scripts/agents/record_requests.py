"""`ftpatch serve` with every request written down: headers and body, one JSON line a request.

How the fixtures of tests/fixtures/claude_code/ were recorded (scripts/agents/claude_code.sh
--record FILE runs Claude Code against this). The flags are `ftpatch serve`'s; --record FILE
(required) is where the lines go. Authorization and x-api-key values are replaced by "<redacted>".

  PYTHONPATH=. python scripts/agents/record_requests.py --record /tmp/requests.jsonl --port 8080
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

SECRET_HEADERS = {"authorization", "x-api-key", "cookie"}


class Recorder:
    """An ASGI wrapper that appends {time, method, path, headers, body} for each request."""

    def __init__(self, app, path: str):
        self.app, self.path, self.lock = app, path, threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        headers = {k.decode("latin-1"): ("<redacted>" if k.decode("latin-1").lower()
                                         in SECRET_HEADERS else v.decode("latin-1"))
                   for k, v in scope.get("headers", ())}
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        line = json.dumps({"time": time.time(), "method": scope["method"], "path": scope["path"],
                           "query": scope.get("query_string", b"").decode("latin-1"),
                           "headers": headers, "body": parsed}, ensure_ascii=False)
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)


def main(argv=None) -> int:
    from freetoken_patch.cli import serve
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command")
    serve.add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--record" not in argv:
        ap.error("--record FILE is required")
    i = argv.index("--record")
    record = argv[i + 1]
    del argv[i:i + 2]
    args = ap.parse_args(["serve", *argv])
    return serve.run(args, wrap=lambda app: Recorder(app, record))


if __name__ == "__main__":
    sys.exit(main())
