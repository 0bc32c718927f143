"""`ftpatch bench serve [MODEL]`: a load generator for an OpenAI-compatible server on this
machine. Without --url it starts `ftpatch serve` as a child process (127.0.0.1, a free port,
the model and server flags given here) and stops it at the end; with --url it drives a running one, on a
loopback address only.

Per concurrency level: --requests streamed chat completions, --concurrency clients at once
(asyncio + httpx), each timing its first content/reasoning chunk (TTFT), its decode rate and
the gaps between its chunks (inter-token latency);
then a conversation of --turns turns whose follow-ups are timed with prefix reuse and without
(the same messages with a system message that differs from its first word on, so no cached
prefix matches). Registered on `ftpatch bench` by `attach` (the word `serve` in the place of
MODEL hands the rest of the line to this module's parser).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import sys
import time
from urllib.parse import urlsplit

from ..errors import CLIError
from ..server.metrics import PREFIX as METRICS_PREFIX
from .inputs import check
from .model_args import add_model_args, add_template_arg, add_vram_arg, resolve_parallel

DESCRIPTION = """\
Load an OpenAI-compatible server on this machine with streamed chat completions and measure
time to first token, inter-token latency, decode speed per stream and in aggregate, and the effect of prefix reuse
on follow-up turns. Without --url it starts `ftpatch serve` on MODEL (default: the embedded
random-weights model) in a child process, on 127.0.0.1 at a free port, and stops it at the
end: a process of its own, as a real client's server would be, so these clients never hold the
server's interpreter.
"""

METHOD = (
    "one untimed warm-up request first. Per level: `requests` streamed POST "
    "/v1/chat/completions (stream_options.include_usage), "
    "`concurrency` asyncio clients at once, each request a short user message that starts with "
    "its own nonce (no shared prefix). TTFT = request sent -> first chunk with non-empty "
    "content or reasoning_content. Per-stream decode tok/s = (usage.completion_tokens - 1) / "
    "(finish chunk - first content chunk), streams of 2+ tokens only. Aggregate decode tok/s = "
    "sum of completion_tokens / wall time of the level (first request sent -> last stream "
    "ended). Inter-token latency (ITL) = the gaps between a stream's consecutive chunks "
    "that carry output, every stream's pooled. Engine: the server's own counters (GET /metrics) read before and after the level: "
    "its engine thread's seconds in prompt chunks and in decode steps, and its graph captures "
    "(absent when /metrics does not answer). Percentiles: linear interpolation between order statistics. Follow-up: turn 1 is "
    "a system message and a user message of filler words sized to about `prompt_tokens` "
    "tokens (the server's tokens per word measured first by two max_tokens=1 requests of 0 "
    "and 64 words); each later turn adds "
    "the reply and a short question and is sent twice: as is (the server may reuse the cached "
    "prefix) and with a system message whose first word is a new nonce (no prefix matches); "
    "cached_tokens is usage.prompt_tokens_details.cached_tokens as the server reports it.")

EPILOG = """\
examples:
  ftpatch bench serve                                   # the embedded default, its own server
  ftpatch bench serve model.gguf --vram 8GiB --concurrency 1,2,4 --json --out serve.json
  ftpatch bench serve --url http://127.0.0.1:8080 --requests 16 --max-tokens 256
  ftpatch bench serve model.gguf --device cuda --parallel 8 --concurrency 1,8 --turns 3

method: """ + METHOD + """

only loopback servers (127.0.0.0/8, localhost, ::1): this is a load generator, not a scanner.
"""

CALIBRATION_WORDS = 64
WORDS = ("river stone cloud garden lantern harbor meadow window forest signal paper orbit "
         "valley copper thunder market candle island silver bridge").split()


def build_parser(prog: str = "ftpatch bench serve") -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s, model_optional=True, device_default=None,
                   model_help="GGUF file for the server started here (default: the embedded "
                              "random-weights model); not with --url",
                   device_help="server started here: cpu (default) or cuda / cuda:N")
    add_vram_arg(s)
    add_template_arg(s)
    s.add_argument("--parallel", type=int, metavar="N",
                   help="server started here: requests generated at once (default 4; 1 under --vram)")
    s.add_argument("--no-batch", action="store_true",
                   help="server started here: requests take turns, one decode step each, instead "
                        "of one step for all (to compare)")
    s.add_argument("--url", metavar="URL",
                   help="a running server (http://127.0.0.1:PORT); loopback addresses only")
    s.add_argument("--api-key", metavar="KEY", help="with --url: the server's API key")
    s.add_argument("--concurrency", default="1,2,4,8", metavar="LIST",
                   help="clients at once, one level each (default 1,2,4,8)")
    s.add_argument("--requests", type=int, default=16, metavar="N",
                   help="requests per level (default 16)")
    s.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="max_tokens of each request (default 128)")
    s.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="tokens of the follow-up test's first prompt, about (default 512)")
    s.add_argument("--turns", type=int, default=2, metavar="N",
                   help="turns of the follow-up conversation; 1 skips it (default 2)")
    s.add_argument("--time-limit", type=float, default=300.0, metavar="S",
                   help="stop starting requests after S seconds in all (default 300)")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    s.add_argument("--out", metavar="FILE", help="also write the JSON object to FILE")
    return s


def attach(bench_parser: argparse.ArgumentParser) -> None:
    """`ftpatch bench serve ...`: hand everything after `serve` to this module's parser (its
    own flags and --help), the way `kernels` and `report` take the place of MODEL."""
    plain = bench_parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        if args and args[0] == "serve":
            ns = build_parser().parse_args(list(args[1:]))
            ns.func, ns.argv = run, list(args[1:])   # the server's flags pass on as given
            return ns, []
        return plain(args, namespace)
    bench_parser.parse_known_args = parse_known_args


# ---- flags ------------------------------------------------------------------------------------

def concurrency_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    check("--concurrency", repr(text), bool(levels) and all(1 <= n <= 256 for n in levels),
          "give client counts from 1 to 256 separated by commas, like 1,2,4,8")
    return levels


def loopback_url(url: str) -> str:
    """The base URL (no trailing /v1), refused unless it names this machine."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    host = (parts.hostname or "").lower()
    ok = parts.scheme in ("http", "https") and host == "localhost"
    if not ok and parts.scheme in ("http", "https"):
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
    if not ok:
        raise CLIError(f"--url {url}: bench serve loads only a server on this machine; give "
                       "http://127.0.0.1:PORT, http://localhost:PORT or http://[::1]:PORT")
    try:
        parts.port
    except ValueError:
        raise CLIError(f"--url {url}: the port is not a number from 0 to 65535") from None
    base = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _check_flags(args: argparse.Namespace) -> list[int]:
    levels = concurrency_levels(args.concurrency)
    for flag, v in (("--requests", args.requests), ("--max-tokens", args.max_tokens),
                    ("--prompt-tokens", args.prompt_tokens), ("--turns", args.turns)):
        check(flag, v, v >= 1, "give 1 or more")
    resolve_parallel(args)
    check("--time-limit", args.time_limit, args.time_limit > 0, "give a number of seconds above 0")
    if args.url is not None:
        loopback_url(args.url)
        given = [f for f, v in (("MODEL", args.model), ("--vram", args.vram),
                                ("--device", args.device)) if v is not None]
        if given:
            raise CLIError(f"{given[0]} is for the server started here; with --url the running "
                           "server's model is measured")
    return levels


# ---- the server ------------------------------------------------------------------------------

# flags of this command that are not the server's (with whether each takes a value); the rest
# of the command line goes to `ftpatch serve` as given
BENCH_ONLY = {"--url": True, "--api-key": True, "--concurrency": True, "--requests": True,
              "--max-tokens": True, "--prompt-tokens": True, "--turns": True,
              "--time-limit": True, "--json": False, "--out": True}
START_LIMIT_S = 900   # loading a large model from a cold page cache takes minutes


def serve_argv(argv: list[str]) -> list[str]:
    """This command's arguments less its own flags: the model and the server's flags."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in BENCH_ONLY:
            skip = BENCH_ONLY[flag] and "=" not in a
            continue
        out.append(a)
    return out


@contextlib.contextmanager
def child_server(serve_args: list[str], extra: tuple[str, ...] = (), capture: bool = True):
    """`ftpatch serve SERVE_ARGS --host 127.0.0.1 --port PORT EXTRA` as a child process on 127.0.0.1 at a free port, its own
    interpreter (the clients here never take the server's time), importing what this process
    imports; yields (base URL, its /health, the command, seconds to start). Its output goes to
    a file read for the error when it does not start (capture), else to ours. Stopped by
    SIGINT (it drains) at the end. The agents' benchmarks start theirs with it too."""
    import subprocess
    import tempfile
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # -P and PYTHONPATH = our import path: the child imports the same freetoken_patch (and built
    # extension) as this process, not a source tree that happens to be the working folder.
    launcher = [sys.executable, "-P", "-m", "freetoken_patch.cli"]
    cmd = [*launcher, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port), *extra]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+") if capture else None
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if capture else None,
                            env=env)

    def failed(why: str) -> CLIError:
        if log is None:
            return CLIError(f"the server did not start ({why}); its output is above")
        log.seek(0)
        tail = [ln for ln in log.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
        return CLIError(f"the server did not start ({why}): "
                        f"{tail[0].removeprefix('ftpatch: error: ')}")
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            if proc.poll() is not None:
                raise failed(f"exit status {proc.returncode}")
            if time.monotonic() > deadline:
                raise failed(f"not answering after {START_LIMIT_S} s")
            try:
                health = httpx.get(url + "/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, health.json(), ["ftpatch", *cmd[len(launcher):]], time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not None:
            log.close()


@contextlib.contextmanager
def _own_server(args: argparse.Namespace, queue: int):
    """child_server with this command's model and server flags; yields (base URL,
    description)."""
    with child_server(serve_argv(getattr(args, "argv", [])),
                      ("--queue", str(queue), "--prefix-cache", "4")) as (url, h, command, load_s):
        yield url, {"mode": "child process", "url": url, "parallel": h.get("parallel"),
                    "decode": h.get("mode"), "queue": h.get("queue_size"),
                    "prefix_cache": h.get("prefix_cache"), "n_ctx": h.get("n_ctx"),
                    "device": str(args.device or ("cuda" if args.vram is not None else "cpu")),
                    "vram": args.vram, "load_s": round(load_s, 3), "command": command}


# ---- one request ----------------------------------------------------------------------------

async def _chat(client, url: str, messages: list, max_tokens: int, seed: int) -> dict:
    """One streamed chat completion, timed: ttft_s, decode_tps, itl_s (the gaps between
    consecutive events that carry output, as a client sees its text arrive), usage, error."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = end = last = None
    gaps: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                return {"error": f"HTTP {r.status_code}: {text}"[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return {"error": str(obj["error"].get("message"))[:300]}
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    d = ch.get("delta") or {}
                    if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                    if ch.get("finish_reason"):
                        end = time.perf_counter()
    except Exception as e:   # noqa: BLE001 -- a failed request is counted, the run goes on
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if usage is None:
        return {"error": "the stream ended without a usage chunk"}
    n = usage.get("completion_tokens", 0)
    out = {"ttft_s": None if first is None else first - t0, "completion_tokens": n,
           "prompt_tokens": usage.get("prompt_tokens", 0),
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
           "decode_tps": None, "itl_s": gaps, "error": None}
    if first is not None and end is not None and n >= 2 and end > first:
        out["decode_tps"] = (n - 1) / (end - first)
    return out


# ---- statistics --------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _r(x, nd=4):
    return None if x is None else round(x, nd)


# ---- a level ------------------------------------------------------------------------------------

async def _level(url: str, headers: dict, concurrency: int, n_req: int, max_tokens: int,
                 deadline: float, run_id: str) -> dict:
    import httpx
    results: list[dict] = []
    counter = iter(range(n_req))
    lock = asyncio.Lock()

    async def worker(client):
        while time.monotonic() < deadline:
            async with lock:
                i = next(counter, None)
            if i is None:
                return
            msgs = [{"role": "user", "content": f"{run_id}-c{concurrency}-r{i}: tell me a "
                                                "short story about the sea."}]
            results.append(await _chat(client, url, msgs, max_tokens, seed=i))

    timeout = httpx.Timeout(max(1.0, deadline - time.monotonic()) + 30, connect=10)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    per = [r["decode_tps"] for r in ok if r["decode_tps"] is not None]
    itl = [g for r in ok for g in r["itl_s"]]
    total = sum(r["completion_tokens"] for r in ok)
    errors = [r["error"] for r in results if r["error"] is not None]
    return {
        "concurrency": concurrency, "requests": n_req, "sent": len(results), "ok": len(ok),
        "errors": len(errors), "error_samples": sorted(set(errors))[:3],
        "skipped_time_limit": n_req - len(results), "wall_s": _r(wall),
        "completion_tokens": total,
        "prompt_tokens_mean": _r(sum(r["prompt_tokens"] for r in ok) / len(ok), 1) if ok else None,
        "aggregate_decode_tps": _r(total / wall if wall > 0 else None, 2),
        "per_stream_decode_tps": {"median": _r(percentile(per, 50), 2),
                                  "min": _r(min(per) if per else None, 2),
                                  "max": _r(max(per) if per else None, 2), "streams": len(per)},
        "ttft_s": {"p50": _r(percentile(ttft, 50)), "p90": _r(percentile(ttft, 90)),
                   "p99": _r(percentile(ttft, 99)), "n": len(ttft)},
        "no_content": len(ok) - len(ttft),
        # every stream's gaps pooled (as vLLM's benchmark_serving reports ITL): a newcomer's
        # prompt chunk shows as a long gap in the streams already running; to the microsecond
        # (events that arrive in one read are microseconds apart, not zero)
        "inter_token_s": {"p50": _r(percentile(itl, 50), 6), "p90": _r(percentile(itl, 90), 6),
                          "p99": _r(percentile(itl, 99), 6),
                          "max": _r(max(itl) if itl else None, 6), "n": len(itl)},
    }


ENGINE_COUNTERS = ("engine_busy_seconds_total", "graph_captures_total",
                   "graph_capture_seconds_total")


def engine_counters(url: str, headers: dict) -> dict | None:
    """{counter name, or name:phase -> value} of the server's engine counters, None when
    /metrics does not answer (another server, or one without them)."""
    import httpx
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for line in r.text.splitlines():
        if not line.startswith(METRICS_PREFIX):
            continue
        key, _, val = line.rpartition(" ")
        name, _, label = key[len(METRICS_PREFIX):].partition("{")
        if name not in ENGINE_COUNTERS:
            continue
        if label:   # phase="..."}
            name += ":" + label[len('phase="'):-2]
        out[name] = float(val)
    return out


def engine_delta(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """What the engine did during a level: seconds by phase, captures, and the rest of the
    wall (the engine thread waiting for requests, or between them)."""
    if not before or not after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    phases = {k.split(":", 1)[1]: round(v, 3) for k, v in d.items()
              if k.startswith("engine_busy_seconds_total:")}
    return {"busy_s": phases,
            "idle_s": round(wall - sum(phases.values()), 3),
            "graph_captures": int(d.get("graph_captures_total", 0)),
            "graph_capture_s": round(d.get("graph_capture_seconds_total", 0.0), 3)}


# ---- follow-up turns ---------------------------------------------------------------------------

async def _followup(url: str, headers: dict, turns: int, prompt_tokens: int, max_tokens: int,
                    deadline: float, run_id: str) -> dict:
    import httpx
    system_rest = "You answer questions about the text the user gives, briefly."

    def system(nonce: str) -> dict:
        return {"role": "system", "content": f"{nonce} {system_rest}"}

    def opening(nonce: str, n_words: int) -> list:
        text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n_words))
        return [system(nonce),
                {"role": "user", "content": f"Here is a text: {text}\nWhat is it about?"}]

    out: dict = {"turns": turns, "prompt_tokens_asked": prompt_tokens, "first": None,
                 "followups": []}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(
            max(1.0, deadline - time.monotonic()) + 30, connect=10)) as client:
        # words per token of this server's tokenizer: two 1-token requests, 0 and 64 words
        sizes = []
        for n in (0, CALIBRATION_WORDS):
            c = await _chat_text(client, url, opening(f"{run_id}-cal{n}", n), 1)
            if c["error"]:
                out["first"] = {"error": c["error"]}
                return out
            sizes.append(c["prompt_tokens"])
        per_word = max(1e-6, (sizes[1] - sizes[0]) / CALIBRATION_WORDS)
        words = max(0, round((prompt_tokens - sizes[0]) / per_word))
        out["prompt_words"] = words
        msgs = opening(f"{run_id}-keep", words)
        r = await _chat_text(client, url, msgs, max_tokens)
        out["first"] = {k: _r(v) if isinstance(v, float) else v for k, v in r.items()
                        if k != "text"}
        if r["error"]:
            return out
        reply_text = r["text"]
        for turn in range(2, turns + 1):
            if time.monotonic() >= deadline:
                out["stopped"] = "time limit"
                break
            msgs = msgs + [{"role": "assistant", "content": reply_text},
                           {"role": "user", "content": f"And what comes next? ({turn})"}]
            reuse = await _chat_text(client, url, msgs, max_tokens)
            fresh_msgs = [system(f"{run_id}-fresh{turn}")] + msgs[1:]
            fresh = await _chat_text(client, url, fresh_msgs, max_tokens)
            out["followups"].append({
                "turn": turn,
                "with_reuse": {k: _r(v) if isinstance(v, float) else v
                               for k, v in reuse.items() if k != "text"},
                "without_reuse": {k: _r(v) if isinstance(v, float) else v
                                  for k, v in fresh.items() if k != "text"}})
            if reuse["error"]:
                break
            reply_text = reuse["text"]
    return out


async def _chat_text(client, url: str, messages: list, max_tokens: int) -> dict:
    """_chat, keeping the reply's text for the next turn (a second, non-streamed read would
    change the cache, so the streamed text is collected here)."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "seed": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: "
                                 f"{(await r.aread()).decode('utf-8', 'replace')}"[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    return {"error": str(obj["error"].get("message"))[:300]}
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or ():
                    d = ch.get("delta") or {}
                    if d.get("content"):
                        parts.append(d["content"])
                    if first is None and (d.get("content") or d.get("reasoning_content")):
                        first = time.perf_counter()
    except Exception as e:   # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    if usage is None:
        return {"error": "the stream ended without a usage chunk"}
    return {"ttft_s": None if first is None else first - t0,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0), "error": None,
            "text": "".join(parts)}


async def _warmup(url: str, headers: dict, run_id: str) -> dict:
    import httpx
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(120, connect=10)) as c:
        return await _chat_text(c, url, [{"role": "user", "content": f"{run_id} hello"}], 2)


# ---- the command ------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    levels = _check_flags(args)
    try:
        import httpx
    except ImportError:
        raise CLIError("ftpatch bench serve needs httpx, in the serve extra: "
                       "pip install 'ftpatch[serve]'") from None
    t_start = time.monotonic()
    deadline = t_start + args.time_limit
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url is not None:
        ctx = contextlib.nullcontext((loopback_url(args.url), {"mode": "url"}))
    else:
        ctx = _own_server(args, queue=max(64, max(levels)))
    with ctx as (url, info):
        info["url"] = url
        try:
            models = httpx.get(url + "/v1/models", headers=headers, timeout=10)
            health = httpx.get(url + "/health", timeout=10)
        except httpx.HTTPError as e:
            raise CLIError(f"no server answers at {url}: {e}") from None
        if models.status_code != 200:
            raise CLIError(f"{url}/v1/models answered {models.status_code}"
                           + (" (give --api-key)" if models.status_code == 401 else ""))
        m = models.json()["data"][0]
        info.setdefault("n_ctx", (m.get("meta") or {}).get("n_ctx"))
        if health.status_code == 200:
            info.setdefault("parallel", health.json().get("parallel"))
            info.setdefault("decode", health.json().get("mode"))
        run_id = secrets.token_hex(4)
        result = {"kind": "ftpatch-bench-serve", "model": m["id"], "server": info,
                  "settings": {"concurrency": levels, "requests": args.requests,
                               "max_tokens": args.max_tokens,
                               "prompt_tokens": args.prompt_tokens, "turns": args.turns,
                               "time_limit_s": args.time_limit},
                  "levels": [], "followup": None, "method": METHOD}
        warm = asyncio.run(_warmup(url, headers, run_id))
        if warm["error"]:
            raise CLIError(f"the warm-up request failed: {warm['error']}")
        for c in levels:
            if time.monotonic() >= deadline:
                result["levels"].append({"concurrency": c, "skipped": "time limit"})
                continue
            before = engine_counters(url, headers)
            lv = asyncio.run(_level(url, headers, c, args.requests, args.max_tokens, deadline,
                                    run_id))
            lv["engine"] = engine_delta(before, engine_counters(url, headers), lv["wall_s"])
            result["levels"].append(lv)
        if args.turns >= 2 and time.monotonic() < deadline:
            result["followup"] = asyncio.run(_followup(url, headers, args.turns,
                                                       args.prompt_tokens, args.max_tokens,
                                                       deadline, run_id))
        result["total_s"] = round(time.monotonic() - t_start, 3)
    _table(result)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    return 0


def _ms(s):
    return None if s is None else s * 1000


def _fmt(x, spec=".1f", unit="") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _table(result: dict) -> None:
    p = lambda s="": print(s, file=sys.stderr)  # noqa: E731
    srv = result["server"]
    p(f"bench serve: {result['model']} at {srv['url']} ({srv['mode']}, parallel "
      f"{srv.get('parallel')}, {srv.get('decode') or 'decode mode not reported'})")
    p(f"{'conc':>4} {'ok':>4} {'err':>4} {'agg tok/s':>10} {'stream med':>10} {'min':>7} "
      f"{'max':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p99':>8}")
    for lv in result["levels"]:
        if "skipped" in lv:
            p(f"{lv['concurrency']:>4} skipped ({lv['skipped']})")
            continue
        ps, t, itl = lv["per_stream_decode_tps"], lv["ttft_s"], lv["inter_token_s"]
        p(f"{lv['concurrency']:>4} {lv['ok']:>4} {lv['errors']:>4} "
          f"{_fmt(lv['aggregate_decode_tps']):>10} {_fmt(ps['median']):>10} "
          f"{_fmt(ps['min']):>7} {_fmt(ps['max']):>7} {_fmt(t['p50'], '.3f', 's'):>9} "
          f"{_fmt(t['p90'], '.3f', 's'):>8} {_fmt(t['p99'], '.3f', 's'):>8} "
          f"{_fmt(_ms(itl['p50']), '.1f', 'ms'):>8} {_fmt(_ms(itl['p99']), '.1f', 'ms'):>8}")
        e = lv.get("engine")
        if e:
            p("     engine: " + ", ".join(f"{k} {v:.2f}s" for k, v in e["busy_s"].items() if v)
              + f", idle {e['idle_s']:.2f}s; {e['graph_captures']} graph captures "
              f"({e['graph_capture_s']:.2f}s)")
    fu = result.get("followup")
    if fu:
        for f in fu["followups"]:
            a, b = f["with_reuse"], f["without_reuse"]
            p(f"turn {f['turn']}: TTFT {_fmt(a.get('ttft_s'), '.3f', 's')} with reuse "
              f"({a.get('cached_tokens')} of {a.get('prompt_tokens')} prompt tokens cached), "
              f"{_fmt(b.get('ttft_s'), '.3f', 's')} without ({b.get('cached_tokens')} cached)")
