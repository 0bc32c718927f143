"""What a client may cost the server (server/limits.py, the serve command's start and stop):
bodies over --max-body and requests over --max-messages are 413 with an error object before
they are parsed; a body or headers that do not arrive in time end the request (408) or the
connection; connections beyond the cap get 503 while those open keep going, under a lowered
open-file limit, with no EMFILE; --api-key "" and a busy port are one line at start; Ctrl-C
drains, twice stops at once, without a traceback."""
from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from freetoken_patch.cli import main  # noqa: E402
from freetoken_patch.server.limits import Limits, protocol_class  # noqa: E402

MiB = 1 << 20
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def _served(kit, tiny_parts, limits: Limits | None = None, **kw):
    served = kit.make_served(tiny_parts, generate_fn=kit.scripted(["ok"]), **kw)
    if limits is not None:
        served.limits = limits
    return served


def _big_chat(n_bytes: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x" * n_bytes}]}).encode()


# ---- bodies ----------------------------------------------------------------------------------------

def test_a_20_mb_body_is_413_before_it_is_parsed(kit, tiny_parts, monkeypatch):
    from freetoken_patch.server import prompt
    rendered = []
    monkeypatch.setattr(prompt, "render_chat", lambda *a, **k: rendered.append(1))
    from freetoken_patch.server.app import create_app
    with TestClient(create_app(_served(kit, tiny_parts))) as c:
        body = _big_chat(20 * MiB)
        t0 = time.perf_counter()
        r = c.post(CHAT, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and time.perf_counter() - t0 < 5
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "16 MiB (--max-body)" in err["message"]
        r = c.post(MESSAGES, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "request_too_large"
        assert c.get("/health").status_code == 200 and not rendered


def test_a_chunked_body_is_cut_at_the_limit(kit, tiny_parts):
    from freetoken_patch.server.app import create_app
    sent = []

    def chunks():
        for _ in range(64):
            sent.append(1)
            yield b"x" * (64 << 10)
    with TestClient(create_app(_served(kit, tiny_parts, Limits(max_body=MiB)))) as c:
        r = c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1 MiB (--max-body)" in r.json()["error"]["message"]
        ok = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200


def test_too_many_messages_is_413_before_validation(kit, tiny_parts):
    from freetoken_patch.server.app import create_app
    msgs = [{"role": "user", "content": "hi"}] * 101
    served = _served(kit, tiny_parts, Limits(max_messages=100), n_ctx=2048)
    with TestClient(create_app(served)) as c:
        r = c.post(CHAT, json={"messages": msgs})
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "too_many_messages"
        assert err["message"] == ("the request has 101 messages, more than the 100 this server "
                                  "takes (--max-messages)")
        r = c.post(MESSAGES, json={"model": "tiny", "max_tokens": 4, "messages": msgs})
        assert r.status_code == 413 and r.json()["type"] == "error"
        r = c.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": msgs})
        assert r.status_code == 413
        r = c.post(CHAT, json={"messages": msgs[:100]})
        assert r.status_code == 200, r.text    # at the limit: on to validation and the model
        r = c.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400            # the app's own error, not the limit's


# ---- time: headers and bodies --------------------------------------------------------------------

@contextlib.contextmanager
def _live(served, limits: Limits):
    """The app on 127.0.0.1 behind the limited protocol, in a thread; yields (host, port)."""
    import uvicorn
    from freetoken_patch.server.app import create_app
    served.limits = limits
    http = protocol_class(limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning", http=http))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        th.join(30)
        sock.close()


def _read_all(s: socket.socket, seconds: float) -> bytes:
    s.settimeout(seconds)
    out = b""
    with contextlib.suppress(socket.timeout, ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_headers_that_never_end_are_cut_off(kit, tiny_parts):
    with _live(_served(kit, tiny_parts), Limits(header_timeout=0.5)) as addr:
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")   # and no more
        t0 = time.monotonic()
        assert _read_all(s, 5) == b"" and 0.4 < time.monotonic() - t0 < 3   # closed, no reply
        ok = httpx.get(f"http://{addr[0]}:{addr[1]}/health", timeout=5)
        assert ok.status_code == 200               # a complete request is not affected


def test_a_body_that_never_arrives_is_408(kit, tiny_parts):
    with _live(_served(kit, tiny_parts), Limits(body_timeout=0.5)) as addr:
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\": ")
        reply = _read_all(s, 5).decode()
        assert reply.startswith("HTTP/1.1 408 ")
        body = json.loads(reply.split("\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "body_timeout" and "--body-timeout" in body["error"]["message"]


def test_a_declared_length_over_the_limit_is_refused_before_the_body(kit, tiny_parts):
    with _live(_served(kit, tiny_parts), Limits()) as addr:
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 20000000\r\n\r\n")                   # the body never comes
        reply = _read_all(s, 5).decode()
        assert reply.startswith("HTTP/1.1 413 ")
        assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["type"] == "request_too_large"


# ---- the serve command: start, connections, stop ------------------------------------------------

def test_an_empty_api_key_is_refused(capsys):
    assert main(["serve", "--api-key", ""]) == 1
    assert capsys.readouterr().err == ("ftpatch: error: --api-key is empty, which would let every "
                                       "request in; give a key, or leave --api-key out to serve "
                                       "without one\n")
    from freetoken_patch.server.auth import Guarded
    with pytest.raises(ValueError):
        Guarded(object.__new__(type("A", (), {"state": None})), type("S", (), {
            "api_key": " ", "limits": Limits()})(), ())


def test_a_busy_port_is_one_line_before_anything_loads(monkeypatch, capsys):
    from freetoken_patch.cli import serve
    monkeypatch.setattr(serve, "load", lambda args: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    assert capsys.readouterr().err == (f"ftpatch: error: cannot listen on 127.0.0.1:{port}: "
                                       "another program is listening there; stop it or pick "
                                       "another --port\n")


def _start(args: list[str], nofile: int | None = None):
    """`ftpatch serve` in a child process on a free port -> (process, base URL)."""
    def lower():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    from helpers import child_env, ftpatch_cmd
    proc = subprocess.Popen(ftpatch_cmd("serve", *args, "--port", "0"), stderr=subprocess.PIPE,
                            text=True, preexec_fn=lower, env=child_env(PYTHONUNBUFFERED="1"))
    lines = []
    while True:
        line = proc.stderr.readline()
        assert line, "".join(lines)
        lines.append(line)
        m = re.search(r"(http://\S+)/v1 ", line)
        if m:
            break
    url = m.group(1)
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url, lines
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def _streaming(got: list, limit: float = 30.0) -> None:
    """Wait until the stream has its first event: a request is running (a fixed sleep let a
    loaded machine send Ctrl-C before it arrived, and the server stopped with none to drain)."""
    deadline = time.monotonic() + limit
    while not got:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)


def _stream(url: str, got: list, max_tokens: int) -> threading.Thread:
    body = {"prompt": "Once", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stop": ["\x01never\x02"]}

    def read():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                got.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as e:
            got.append(f"error: {type(e).__name__}")
    th = threading.Thread(target=read)
    th.start()
    return th


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_NOFILE and /proc")
def test_a_flood_of_idle_connections_under_a_low_file_limit(tiny_model):
    """256 descriptors: the server serves up to its cap, answers 503 (an error object) to new
    connections beyond it and closes those it has no descriptor to answer; a stream started
    before keeps going; idle connections are closed at the header deadline, then all is well."""
    proc, url, lines = _start([str(tiny_model), "--ctx", "2048", "--header-timeout", "2"],
                              nofile=256)
    try:
        cap = int(re.search(r"(\d+) connections", "".join(lines)).group(1))
        assert 16 <= cap < 128                      # cut to fit 256 descriptors
        host, port = url[7:].split(":")
        got: list = []
        th = _stream(url, got, 600)
        _streaming(got)
        idle = [socket.create_connection((host, int(port))) for _ in range(cap + 20)]
        time.sleep(0.3)
        r = httpx.get(url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        flood = []
        for _ in range(300):                        # more than the process has descriptors
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection((host, int(port)), timeout=2))
        th.join(60)
        assert got[-1] == "data: [DONE]" and not any(x.startswith("error") for x in got)
        time.sleep(2.5)                             # the header deadline closes the idle ones
        assert sum(_read_all(s, 0.05) == b"" for s in idle) == len(idle)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        for s in idle + flood:
            s.close()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    err = proc.stderr.read()
    assert rc == 0 and "Too many open files" not in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_twice_stops_at_once_and_the_drain_is_bounded(tiny_model):
    proc, url, _ = _start([str(tiny_model), "--ctx", "4096"])
    got: list = []
    th = _stream(url, got, 3000)
    _streaming(got)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):        # no longer accepting
        httpx.get(url + "/health", timeout=2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 130 and time.monotonic() - t0 < 5
    th.join(30)
    err = proc.stderr.read()
    assert "Traceback" not in err and "terminate called" not in err, err
    assert err.strip().splitlines()[-2:] == [
        "ftpatch serve: stopping: no new connections; 1 request(s) running get up to 30 s to "
        "finish (Ctrl-C again to stop at once)",
        "ftpatch serve: stopped at once (a second Ctrl-C); requests still running were cut off"]

    proc, url, _ = _start([str(tiny_model), "--ctx", "4096", "--drain-timeout", "1"])
    got = []
    th = _stream(url, got, 3000)
    _streaming(got)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0 and time.monotonic() - t0 < 5
    th.join(30)
    err = proc.stderr.read()
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("ftpatch serve: stopped after 1 s (--drain-timeout) "
                                            "with 1 request(s) unfinished")
