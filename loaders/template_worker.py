"""Chat templates rendered in a separate process under hard OS limits.

A model's chat template is code from a downloaded file. The sandbox's own checks
(template_sandbox) refuse what they know to be too big before doing it; this module is the
backstop for what they miss: one C call that allocates gigabytes or runs for minutes cannot be
stopped from inside the process that makes it. So the template renders in a worker process:

- a fresh interpreter (`python -m loaders.template_worker`, started with subprocess: never a
  fork of a process that holds torch and threads), in its own session (a terminal's Ctrl-C does
  not reach it), with an environment of its own (no API keys or tokens from ours);
- limits set by the worker on itself before it reads a request (`resource` rlimits): address
  space (its start-up size plus `TemplateLimits.memory`), CPU time (per request, the wall limit
  plus a second; SIGXCPU ends it), no files written, no processes started, few descriptors;
- the parent's own clock (`seconds` plus half a second; then SIGKILL) and a cap on the reply's
  size (the output limit), read from the pipe with a deadline;
- requests in pickle (from us to it), replies as length-prefixed UTF-8 (from it to us: nothing
  the template controls is ever unpickled here).

A worker that passes a limit is killed and a new one started in the background; the request gets
a ChatTemplateError that names the limit and `--chat-template FILE`. Each worker keeps the
templates it compiled by the hash of their source (the source travels with every request: a few
microseconds to copy); a render that must compile first gets the compile's time too.

Threads: a small pool (`POOL_SIZE` processes, started on demand), each worker used by one
request at a time. A pool rather than one worker behind a lock: a template that runs to its time
limit then holds up one of the server's request threads, not all of them. Two, because a render
takes milliseconds and the model thread takes requests one at a time anyway; each worker costs
about 25 MB of RSS.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time
from typing import Any

from .errors import ChatTemplateError
from .template_sandbox import OVERRIDE_HINT, TemplateLimits

POOL_SIZE = 2
START_SECONDS = 20.0            # a worker's start: an interpreter and jinja2 (~0.1 s when idle)
GRACE_SECONDS = 0.5             # the parent's clock: the render's own limit plus this
LIFETIME_CPU = 600              # CPU seconds a worker may use in all; it retires before that

# reply: status (1 byte), retiring (1 byte), payload length (8 bytes), payload
_HEAD = struct.Struct("<ccQ")
_READY, _OK, _TEXT, _ERROR, _MEMORY = b"R", b"C", b"T", b"E", b"M"
_REQUEST = struct.Struct("<Q")


# -- the worker (child side) ---------------------------------------------------------------------

def _vm_size() -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_used() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _limit_self(memory: int) -> None:
    import resource
    space = _vm_size() + memory
    resource.setrlimit(resource.RLIMIT_AS, (space, space))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
    resource.setrlimit(resource.RLIMIT_CPU, (LIFETIME_CPU, LIFETIME_CPU))
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass


def _cpu_for(seconds: float) -> None:
    import resource
    soft = min(LIFETIME_CPU, int(_cpu_used() + seconds) + 2)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, LIFETIME_CPU))


def _read_request(fd: int) -> Any:
    head = _read_all(fd, _REQUEST.size)
    if head is None:
        return None
    (n,) = _REQUEST.unpack(head)
    body = _read_all(fd, n)
    return None if body is None else pickle.loads(body)


def _read_all(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _reply(fd: int, status: bytes, payload: str = "", retiring: bool = False) -> None:
    data = payload.encode("utf-8", "surrogatepass")
    view = memoryview(_HEAD.pack(status, b"1" if retiring else b"0", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the protocol's own descriptors; 1 and 2 go nowhere, so nothing else can write into it
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    try:
        from .template_sandbox import compile_template, render_compiled
        memory = int(sys.argv[1])
        # warm up: what a render imports lazily is imported before the limits
        warm = compile_template("{{ m|tojson }}{{ '%s'|format(1) }}{{ strftime_now('%Y') }}",
                                "warm-up", TemplateLimits())
        render_compiled(warm, "warm-up", TemplateLimits(), {"m": [{"a": "b"}]})
        "é".encode("utf-16").decode("utf-16")
        _limit_self(memory)
        start_rss = _rss()
    except Exception as e:
        _reply(wfd, _ERROR, f"{type(e).__name__}: {e}"[:500])
        return
    compiled: dict[str, Any] = {}
    _reply(wfd, _READY)
    while True:
        req = _read_request(rfd)
        if req is None:
            return
        op, key, source, where, limits, context = req
        status, payload = _OK, ""
        try:
            template = compiled.get(key)
            if template is None:   # kept for the worker's life (it retires as its heap grows)
                _cpu_for(limits.compile_seconds)
                template = compiled[key] = compile_template(source, where, limits)
            if op == "render":
                _cpu_for(limits.seconds)
                status, payload = _TEXT, render_compiled(template, where, limits,
                                                         pickle.loads(context))
        except ChatTemplateError as e:
            status, payload = _ERROR, str(e)
        except MemoryError:
            status = _MEMORY
        del req, context
        # a worker whose heap has grown (or whose CPU time is mostly spent) makes way for a
        # fresh one, so no request inherits what an earlier one left behind
        retiring = status == _MEMORY or _rss() > start_rss + memory // 2 or \
            _cpu_used() > LIFETIME_CPU // 2
        _reply(wfd, status, payload, retiring)
        if retiring:
            return


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the pool (parent side) ----------------------------------------------------------------------

class _Broke(Exception):
    """The worker passed a limit, died, or broke the protocol; the message says which."""


class _Worker:
    """One worker process, used by one thread at a time (the pool hands it out)."""

    def __init__(self, memory: int):
        self.memory = memory
        self.proc: Any = None
        self.compiled: set[str] = set()       # the templates its process holds
        self.last_exit: int | None = None     # how the last process ended (for messages)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.compiled = set()
        env = {"PYTHONPATH": root, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "LC_ALL": "C.UTF-8", "PATH": os.defpath}
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-s", "-m", "loaders.template_worker", str(self.memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd="/", env=env, close_fds=True, start_new_session=True, bufsize=0)
        for f in (self.proc.stdin, self.proc.stdout):
            try:   # room for a whole typical prompt in the pipe: fewer wake-ups per reply
                import fcntl
                fcntl.fcntl(f.fileno(), 1031, 1 << 20)    # F_SETPIPE_SZ
            except (ImportError, OSError):
                pass
        os.set_blocking(self.proc.stdin.fileno(), False)
        try:
            status, _, said = self._read_reply(time.monotonic() + START_SECONDS, 1 << 16)
        except _Broke as e:
            self.kill(wait=1.0)
            said = f"it {e} (exit status {self.last_exit})" if str(e) == "died" else \
                f"no answer in {START_SECONDS:g} s"
            status = None
        if status != _READY:
            self.kill()
            raise ChatTemplateError(f"the chat-template render process did not start: "
                                    f"{_one_line(said)[:300]}; FTPATCH_TEMPLATE_WORKER=0 renders "
                                    "templates in this process instead, without its limits")

    def kill(self, wait: float = 0.0) -> None:
        """End the process (after `wait` seconds for it to end by itself: how a worker that
        died ended is the message)."""
        import subprocess
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if wait:
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        try:
            proc.kill()
        except OSError:
            pass
        proc.wait()
        self.last_exit = proc.returncode
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def call(self, request: tuple, deadline: float, max_reply: int) -> tuple[bytes, str]:
        """Send `request`; its reply (status, text). _Broke when the worker passed a limit or
        died: it is killed then."""
        body = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._write(_REQUEST.pack(len(body)) + body, deadline)
            status, retiring, payload = self._read_reply(deadline, max_reply)
        except _Broke as e:
            self.kill(wait=1.0 if str(e) == "died" else 0.0)
            raise
        except BaseException:   # our own thread interrupted mid-request (an alarm, Ctrl-C)
            self.kill()
            raise
        if retiring:
            self.kill()
        return status, payload

    def _write(self, data: bytes, deadline: float) -> None:
        import select
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Broke("time")
            if not poll.poll(left * 1000):
                continue
            try:
                view = view[os.write(fd, view[:1 << 20]):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError):
                raise _Broke("died") from None

    def _read_reply(self, deadline: float, max_reply: int) -> tuple[bytes, bool, str]:
        head = self._read(_HEAD.size, deadline)
        status, retiring, n = _HEAD.unpack(head)
        if max_reply and n > max_reply:
            raise _Broke("output")
        payload = self._read(n, deadline).decode("utf-8", "surrogatepass") if n else ""
        return status, retiring == b"1", payload

    def _read(self, n: int, deadline: float) -> bytes:
        import select
        fd = self.proc.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Broke("time")
            if not poll.poll(left * 1000):
                continue
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise _Broke("died")
            buf += chunk
        return bytes(buf)


class _Pool:
    """Up to `size` workers for one memory limit, handed out one thread at a time."""

    def __init__(self, memory: int, size: int):
        self.memory, self.size = memory, size
        self.cond = threading.Condition()
        self.idle: list[_Worker] = []
        self.count = 0

    def acquire(self) -> _Worker:
        with self.cond:
            while not self.idle and self.count >= self.size:
                self.cond.wait()
            if self.idle:
                return self.idle.pop()
            self.count += 1
            return _Worker(self.memory)

    def release(self, worker: _Worker) -> None:
        with self.cond:
            self.idle.append(worker)
            self.cond.notify()

    def restart_and_release(self, worker: _Worker) -> None:
        """A new process for a worker that was killed, in the background: the request that
        killed it gets its answer now, the next one finds a worker ready."""
        def run() -> None:
            try:
                worker.start()
            except Exception:   # the next request tries again and reports it
                worker.kill()
            finally:
                self.release(worker)
        threading.Thread(target=run, name="ftpatch-template-restart", daemon=True).start()

    def close(self) -> None:
        """End the idle workers (those in use finish their request first)."""
        with self.cond:
            workers, self.idle = self.idle, []
            self.count -= len(workers)
            self.cond.notify_all()
        for w in workers:
            w.kill()


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(memory: int) -> _Pool:
    with _pools_lock:
        pool = _pools.get(memory)
        if pool is None:
            pool = _pools[memory] = _Pool(memory, POOL_SIZE)
        return pool


def _forget_pools() -> None:
    # a forked child must not share (or kill) its parent's workers
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


def _close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()


os.register_at_fork(after_in_child=_forget_pools)
if __name__ != "__main__":
    import atexit
    atexit.register(_close_pools)


def run(op: str, key: str, source: str, where: str, limits: TemplateLimits,
        context: dict | None = None) -> str:
    """Compile (op "compile") or render (op "render", with `context`) `source` in a worker:
    the rendered text, or ChatTemplateError. Safe to call from many threads at once."""
    data = None
    if op == "render":
        try:
            data = pickle.dumps(context, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ChatTemplateError(f"the chat template's inputs must be plain data (text, "
                                    f"numbers, lists, objects): {_one_line(e)[:200]}") from None
    pool = _pool(limits.memory)
    worker = pool.acquire()
    broken = False
    try:
        if not worker.alive():
            worker.kill()
            worker.start()
        request = (op, key, source, where, limits, data)
        seconds = limits.compile_seconds if op == "compile" else limits.seconds
        if op == "render" and key not in worker.compiled:
            seconds += limits.compile_seconds
        try:
            status, payload = worker.call(request, time.monotonic() + seconds + GRACE_SECONDS,
                                          4 * limits.output_chars + 4096)
        except _Broke as e:
            broken = True
            raise ChatTemplateError(_breach(str(e), worker, where, limits, op)) from None
        except BaseException:
            broken = True
            raise
        broken = not worker.alive()          # it passed its memory limit, or retired
        if status == _MEMORY:
            raise ChatTemplateError(_breach("memory", worker, where, limits, op))
        if status in (_TEXT, _OK):
            worker.compiled.add(key)
        if status == _ERROR:
            raise ChatTemplateError(payload[:2000])
        if status != (_TEXT if op == "render" else _OK):
            broken = True
            worker.kill()
            raise ChatTemplateError(f"{where}: the render process sent an unexpected reply")
        return payload
    finally:
        if broken:
            pool.restart_and_release(worker)
        else:
            pool.release(worker)


def _breach(what: str, worker: _Worker, where: str, limits: TemplateLimits, op: str) -> str:
    doing = "compiling" if op == "compile" else "rendering"
    seconds = limits.compile_seconds if op == "compile" else limits.seconds
    code = worker.last_exit
    if what == "time":
        said = f"{doing} took longer than its {seconds:g} s limit"
    elif what == "output":
        said = f"the prompt passed the {limits.output_chars:,}-character output limit"
    elif what == "memory":
        said = f"{doing} needed more than its {limits.memory >> 20} MiB memory limit"
    elif code is not None and code == -_sigxcpu():
        said = f"{doing} used more than its {seconds:g} s of CPU time"
    else:
        said = f"the render process died while {doing}" + \
            (f" (exit status {code})" if code is not None else "") + \
            f", most likely at its {limits.memory >> 20} MiB memory limit"
    return f"{where}: {said} (the render process was stopped); {OVERRIDE_HINT}"


def _sigxcpu() -> int:
    import signal
    return int(signal.SIGXCPU)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


if __name__ == "__main__":
    main()
