"""`ftpatch serve [MODEL]`: an OpenAI- and Anthropic-compatible HTTP server
(freetoken_patch/server/)."""
from __future__ import annotations

import argparse
import asyncio
import errno
import math
import os
import sys
from pathlib import Path

from ..errors import CLIError
from .inputs import check
from .model_args import (add_draft_arg, add_model_args, add_template_arg, add_vram_arg,
                         device_for, load_for_text, resolve_parallel, size_arg, speculative_for)

DESCRIPTION = """\
Serve MODEL over an OpenAI-compatible HTTP API: POST /v1/chat/completions (streaming, tools,
reasoning_content, response_format json_object / json_schema, logprobs), POST /v1/completions
(logprobs, echo), GET /v1/models[/ID], POST /tokenize and /detokenize (llama-server's), /health
and /metrics (Prometheus); and Anthropic's POST /v1/messages (streaming, tool_use, thinking,
system messages anywhere; what Claude Code speaks) and /v1/messages/count_tokens. Without MODEL
it serves the embedded default (a tiny random-weights model, for trying clients).

The context defaults to --ctx auto: the largest that fits, up to the model's trained length
(host RAM for every sequence's KV on the CPU; under --vram, what leaves the expert cache half
of its room); the start-up line and /v1/models (meta.n_ctx) say which. Structured output and
forced tool calls (tool_choice required / a named function / Anthropic's any and tool) are
enforced by a token mask (llguidance: pip install 'ftpatch[structured]'). One line a request
goes to stderr (--log-format).

One thread owns the model. Up to --parallel requests are active at once. On the plain model
(the CPU, or a GPU holding the whole model) they are batched: each step advances every active
request by one token together (a layer's experts read once for all of them), and a newcomer's
prompt goes in by chunks of --prefill-chunk tokens between those steps, so a long prompt does
not stall the others. Under --vram the runtime holds one sequence unless --parallel asks for
more (up to 8; each takes its delta-net state, ~63 MB on a 35B-A3B, and its KV from the expert
cache); they are stepped together the same way, each layer's experts fetched once for the
batch, every batch size's step captured at start-up, and a newcomer's short prompt fed in the
running streams' steps, a few tokens a step. --no-batch makes the requests take turns
instead, one request a step (interleaved), to compare. More requests wait in a queue of --queue; past that the server answers 429 (529,
overloaded, on /v1/messages). A follow-up whose prompt (or, for a chat, whose text) starts
with a recent conversation prefills only the new tokens. With --draft a model with an MTP head
decodes speculatively, one request at a time (--parallel 1); /health and /metrics show how
many drafts were accepted.
"""

EPILOG = """\
examples:
  ftpatch serve                                      # the embedded default on 127.0.0.1:8080
  ftpatch serve model.gguf --vram 8GiB --ctx 16384
  ftpatch serve model.gguf --device cuda --parallel 8 --api-key "$KEY" --host 0.0.0.0
  ftpatch serve mtp.gguf --vram 8GiB --draft auto    # speculative decoding (MTP head)

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")
  client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])

  # Claude Code against it (the model id is the file's stem, or "default")
  ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_AUTH_TOKEN="$KEY" \
    ANTHROPIC_MODEL=default ANTHROPIC_SMALL_FAST_MODEL=default \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude
"""


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s, model_optional=True, device_default=None,
                   ctx_auto="host RAM (every sequence's KV) or, under --vram, leaves the expert "
                            "cache half of its room",
                   model_help="GGUF file, shard or folder (default: the embedded random-weights "
                              "model)",
                   device_help="cpu (default) or cuda / cuda:N (the whole model in VRAM; with "
                               "--vram: the GPU the runtime uses)")
    add_vram_arg(s)
    add_template_arg(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    s.add_argument("--parallel", type=int, metavar="N",
                   help="requests generated at once, stepped together (default 4; 1 under --vram, "
                        "where each more takes its state and KV from the expert cache: up to 8)")
    s.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="prompt tokens a new request feeds in one decode step of the running "
                        "ones (batched mode; default 256, 1024 under --vram, where every chunk "
                        "streams the cold experts once, and a prompt of up to 64 tokens goes "
                        "in pieces that fill the step's 8 rows instead); a prompt with no one "
                        "waiting goes in the model's own chunks (under --vram as large as the "
                        "reserved workspace holds)")
    s.add_argument("--no-batch", action="store_true",
                   help="let active requests take turns, one decode step each, instead of "
                        "stepping them together (to compare)")
    s.add_argument("--queue", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot; more get 429 (default 64)")
    s.add_argument("--prefix-cache", type=int, default=4, metavar="N",
                   help="finished conversations whose state is kept for follow-ups (default 4; "
                        "each holds a context's KV cache)")
    add_draft_arg(s, note=". The server then decodes one request at a time (--parallel 1, its "
                          "default with --draft): a verify step checks one sequence's drafts, "
                          "and several requests gain more from being stepped together, sharing "
                          "each layer's expert reads")
    s.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every "
                        "route but /health")
    s.add_argument("--allow-special-in-content", action="store_true",
                   help="let message text spell control tokens (\"<|im_end|>\" becomes the "
                        "token, as in llama.cpp and vLLM); by default client text stays text, so "
                        "a message cannot forge a turn")
    s.add_argument("--log-format", choices=("text", "json", "off"), default="text",
                   help="the access log on stderr, one line a request (method, path, status, "
                        "ms, prompt / cached / completion tokens, the error): text (default), "
                        "json, or off")
    add_limit_args(s)


def add_limit_args(s: argparse.ArgumentParser) -> None:
    """What one client may cost: body size, message count, read timeouts, connections, and how
    long Ctrl-C waits for running requests."""
    from ..server.limits import Limits
    d = Limits()
    g = s.add_argument_group("limits")
    g.add_argument("--max-body", type=size_arg, default=d.max_body, metavar="SIZE",
                   help="largest request body (default 16MiB); larger ones get 413 before they "
                        "are read")
    g.add_argument("--max-messages", type=int, default=d.max_messages, metavar="N",
                   help=f"most messages in one chat or /v1/messages request (default "
                        f"{d.max_messages:,}); more get 413 before they are validated")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="S",
                   help=f"seconds a client has to send a request's headers; then its connection "
                        f"is closed (default {d.header_timeout:g})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="S",
                   help=f"seconds a client has to send a request's body; then 408 (default "
                        f"{d.body_timeout:g})")
    g.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help=f"connections open at once (default {d.max_connections}, lowered to fit "
                        "the open-file limit, ulimit -n); new ones beyond it get 503 while "
                        "those open keep going")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="after Ctrl-C (or SIGTERM), seconds running requests may take to finish "
                        "before the server stops anyway (default 30); a second Ctrl-C stops at "
                        "once")


def limits_from(args: argparse.Namespace):
    """The Limits of the flags, each checked."""
    from ..server.limits import Limits
    check("--max-body", args.max_body, 1 <= args.max_body <= 1 << 40, "give 1B to 1TiB")
    check("--max-messages", args.max_messages, 1 <= args.max_messages <= 10**7,
          "give 1 to 10000000")
    check("--max-connections", args.max_connections, 1 <= args.max_connections <= 1 << 20,
          "give 1 or more")
    for flag, v in (("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout),
                    ("--drain-timeout", args.drain_timeout)):
        check(flag, v, math.isfinite(v) and 0 < v <= 86400, "give seconds above 0, at most 86400")
    return Limits(max_body=args.max_body, max_messages=args.max_messages,
                  header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                  max_connections=args.max_connections)


def run(args: argparse.Namespace, wrap=None) -> int:
    """wrap: an ASGI wrapper put around the app (scripts/agents/record_requests.py)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:   # name the module: a partial install lacks one dependency, not all
        raise CLIError(f"ftpatch serve needs the server packages ({e}): "
                       "pip install 'ftpatch[serve]'") from None
    check("--port", args.port, 0 <= args.port <= 65535, "give a port from 0 to 65535")
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key is empty, which would let every request in; give a key, or "
                       "leave --api-key out to serve without one")
    check_draft_parallel(args)
    resolve_parallel(args)
    check("--queue", args.queue, 0 <= args.queue <= 100_000, "give 0 to 100000")
    check("--prefix-cache", args.prefix_cache, 0 <= args.prefix_cache <= 256, "give 0 to 256")
    if args.prefill_chunk is not None:
        check("--prefill-chunk", args.prefill_chunk, 1 <= args.prefill_chunk <= 1 << 20,
              "give 1 or more")
    limits = limits_from(args)
    sock = listen(args.host, args.port)     # a busy port fails here, before the model loads
    try:
        served = load(args)
    except BaseException:
        sock.close()
        raise
    served.limits = limits
    from ..server.app import create_app
    from ..server.limits import protocol_class
    note = lambda line: print(f"ftpatch serve: {line}", file=sys.stderr)  # noqa: E731
    eng = served.engine
    http = protocol_class(limits)
    note(f"{served.model_id} | {served.context.describe()} | {eng.parallel} at once "
         f"({describe(eng)}), queue {eng.queue_size}, {http.connection_cap} connections")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        note(f"listening on {args.host} without --api-key: anyone who reaches it can use it")
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    note(f"http://{shown}:{port}/v1 (Ctrl-C finishes the requests in flight and exits)")
    _index_vocabulary(served)
    app = create_app(served, log_format=args.log_format)
    config = uvicorn.Config(app if wrap is None else wrap(app), log_level="warning", http=http,
                            backlog=http.backlog, timeout_graceful_shutdown=None)
    server = draining_server(config, args.drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    note("stopped")
    return 0


def _index_vocabulary(served) -> None:
    """Constrained decoding's index of the vocabulary (about a second for Qwen3.5's, once),
    built in the background from start-up rather than on the first request with tools or a
    response_format; skipped without the structured extra."""
    import importlib.util
    import threading
    if importlib.util.find_spec("llguidance") is None:
        return
    from moe_offload import grammar_tokenizer
    threading.Thread(target=grammar_tokenizer, args=(served.tokenizer,),
                     name="vocabulary index", daemon=True).start()


def listen(host: str, port: int):
    """The server's socket, bound now (asyncio starts listening on it once the app is up, so a
    client connecting while the model loads is refused, as before): a port in use, or an address
    that is not this machine's, is one line here, before anything loads or says it listens."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not a port in use: TIME_WAIT
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = ("another program is listening there; stop it or pick another --port"
               if e.errno == errno.EADDRINUSE else e.strerror or str(e))
        raise CLIError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


LISTEN_QUEUE = 2048   # connections the kernel queues before the server accepts them


def draining_server(config, drain_s: float):
    """uvicorn's Server with our Ctrl-C (and SIGTERM): the first stops accepting and says so,
    then running requests have `drain_s` seconds to finish; a second Ctrl-C, or the time running
    out, ends the process at once with one line and no traceback (os._exit: nothing is unwound
    mid-step, neither the engine thread nor the native ones; uvicorn would cancel the streams'
    tasks and log each one's CancelledError)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            # asyncio listens with the backlog it accepts in one burst (kept small: limits.py);
            # the kernel's queue may be long, so a burst of clients waits instead of retrying
            for sock in sockets or ():
                sock.listen(LISTEN_QUEUE)

        def handle_exit(self, sig, frame):
            if self.should_exit:
                _say_and_exit("stopped at once (a second Ctrl-C); requests still running were "
                              "cut off", 130)
            self.should_exit = True
            n = len(self.server_state.tasks)
            _say(f"stopping: no new connections; {n} request(s) running get up to {drain_s:g} s "
                 "to finish (Ctrl-C again to stop at once)")

        async def shutdown(self, sockets=None):
            try:
                async with asyncio.timeout(drain_s):
                    await super().shutdown(sockets)
            except TimeoutError:
                _say_and_exit(f"stopped after {drain_s:g} s (--drain-timeout) with "
                              f"{len(self.server_state.tasks)} request(s) unfinished", 0)

    return DrainingServer(config)


def _say(line: str) -> None:
    """A line from a signal handler: one os.write (print could re-enter a write in progress)."""
    try:
        os.write(sys.stderr.fileno(), f"ftpatch serve: {line}\n".encode())
    except (OSError, ValueError):
        pass


def _say_and_exit(line: str, status: int) -> None:
    _say(line)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(status)


def check_draft_parallel(args: argparse.Namespace) -> None:
    """--draft decodes one request at a time: --parallel defaults to 1 with it, and more is
    refused (a batched step of several sequences has no speculative form here)."""
    if not getattr(args, "draft", 0):
        return
    if args.parallel is None:
        args.parallel = 1
    elif args.parallel != 1:
        raise CLIError(f"--draft decodes one request at a time, not --parallel {args.parallel}; "
                       "use --parallel 1, or drop --draft to batch several")


def load(args: argparse.Namespace):
    """The model named by the flags (or the embedded default), its engine, and the app's Served."""
    from loaders.synth import default_model_path, ensure_default_model
    from moe_offload import SERVING
    from ..server.engine import Engine
    from ..server.app import Served
    from ..server.metrics import Metrics
    dev = device_for(args.device, args.vram)
    if args.model is None:
        path = default_model_path()
        ensure_default_model()
    else:
        path = args.model
    loaded, tok, template, choice, model = load_for_text(args, path, dev, "the server")
    n_ctx = choice.n_ctx
    metrics = Metrics()
    engine = Engine(model, tok, n_ctx, parallel=args.parallel, queue_size=args.queue,
                    prefix_cache=args.prefix_cache, metrics=metrics,
                    prefill_chunk=getattr(args, "prefill_chunk", None)
                    or (SERVING.prefill_chunk_under_cap if args.vram is not None
                        else SERVING.prefill_chunk),
                    batch=False if getattr(args, "no_batch", False) else None,
                    draft=speculative_for(args, model), source=str(path))
    return Served(engine, tok, template, model_id(path), n_ctx, args.api_key, metrics,
                  allow_special=args.allow_special_in_content, context=choice,
                  n_ctx_train=loaded.config.n_ctx_train)


def describe(engine) -> str:
    """How the engine steps its sequences, for the startup line."""
    if engine.draft is not None:
        d = engine.draft_summary()["setting"]
        return f"speculative: one sequence, {d} draft tokens a step from the MTP head"
    if engine.batched:
        m = engine.model
        ready = (f", {m.captures} steps captured at start ({m.capture_s:.1f} s)"
                 if m.caps.offload and m.captures else "")
        return (f"batched: one decode step for all{ready}, prompts in chunks of "
                f"{engine.prefill_chunk}")
    if engine.single_state:
        return "one sequence at a time: the runtime holds one sequence"
    return "interleaved: one decode step each in turn"


def model_id(path) -> str:
    """The served model's id: the file's stem (a split set's without its shard suffix)."""
    import re
    p = Path(path)
    stem = p.name if p.is_dir() else p.stem
    return re.sub(r"-\d{5}-of-\d{5}$", "", stem)


COMMANDS = {"serve": (add_parser, run)}
