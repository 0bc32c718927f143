"""`ftpatch chat [MODEL]`: talk to a model in the terminal.

On a terminal: prompt_toolkit input (history in the cache directory, Alt-Enter for a new line,
bracketed paste) and rich output: while an answer streams, a transient view shows its newest
lines; then the whole answer is printed once, followed by a status line. With piped stdin: one
message (or command) per line in, each answer and a newline out on stdout, the banner and status
lines on stderr, no escape codes.

Ctrl-C during an answer stops it between two tokens, so the cache still matches the conversation
and the partial answer stays in it. A second Ctrl-C stops at once; the cache may then be half a
step ahead, so it is dropped (the conversation is kept and re-read on the next message).
"""
from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

from .errors import CLIError
from .model_args import (add_model_args, add_sampling_args, add_vram_arg, build_for,
                         context_size, device_for, offload_stats_lines, placement_options,
                         sampling_params)

DESCRIPTION = """\
Chat with MODEL in the terminal. Without MODEL it runs the embedded default: a tiny synthetic
qwen35moe with random weights, built once into the cache directory, for trying the machinery
(its replies are gibberish by design).

The model runs on the CPU unless you say otherwise, GPU or not: --device cuda puts the whole
model in VRAM (fine for models that fit), --vram SIZE runs the offload runtime for ones that do
not. Input history is kept in the cache directory ($FTPATCH_CACHE, else ~/.cache/ftpatch).

Piped stdin is read one message per line; each answer is printed followed by a newline, and the
banner and status lines go to standard error, so scripts can drive it.
"""

HELP = """\
/reset          start a new conversation (keeps the system prompt)
/system [TEXT]  show the system prompt, or set it and start a new conversation
/temp [X]       show the temperature, or set it (0 = greedy)
/stats          timings of the last answer, session totals, expert cache hits and misses
/help           this list
/quit           leave (also Ctrl-D)
//TEXT          send a message that starts with '/'
keys: Enter sends | Alt-Enter or Esc Enter: new line | Ctrl-C: stop the answer, or clear the line
      | Ctrl-C on an empty line twice, or Ctrl-D: quit"""

EPILOG = f"""\
commands (type them at the prompt):
{HELP}

examples:
  ftpatch chat                                     the embedded default (random weights)
  ftpatch chat model.gguf --temp 0.7 --system "Answer briefly."
  ftpatch chat model.gguf --no-think -n 2048       skip the reasoning block (Qwen3.5 templates)
  ftpatch chat model.gguf --vram 8GiB --ctx 8192   hot experts on the GPU under an 8 GiB cap
  printf 'hi\\n/stats\\n' | ftpatch chat             scripted: one message per line
"""


def add_parser(sub) -> None:
    s = sub.add_parser("chat", help="chat with a model in the terminal",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s, model_optional=True, device_default=None,
                   model_help="GGUF file, shard or folder (default: the embedded random-weights "
                              "model)",
                   device_help="cpu (default; the whole model in RAM) or cuda / cuda:N (the whole "
                               "model in VRAM; with --vram: the GPU the runtime uses)")
    add_sampling_args(s, n_default=None, n_flags=("-n", "--max-tokens"),
                      n_help="most tokens per answer (default 1024; 128 for the embedded default)")
    s.add_argument("--system", metavar="TEXT", help="system prompt (change it with /system)")
    s.add_argument("--no-think", action="store_true",
                   help="ask the chat template to skip the reasoning block (enable_thinking=false)")
    add_vram_arg(s)


# ---- the conversation (no I/O) ------------------------------------------------------------------

@dataclass
class Conversation:
    session: object                      # moe_offload.generate.Session
    params: object                       # SamplingParams
    system: str | None = None
    think: bool | None = None            # enable_thinking for the template (None: its default)
    turns: list = field(default_factory=list)
    answers: list = field(default_factory=list)   # (Timings, tokens shown, stop reason) each

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def reset(self) -> None:
        self.turns.clear()
        self.session.reset()


class Answer:
    """The answer so far; the live view reads it from rich's refresh thread."""

    def __init__(self):
        self.pieces: list[str] = []
        self.n_tokens, self.timings, self.done = 0, None, None
        self.on_text = None               # the plain screen writes each piece as it comes

    def add(self, ev) -> None:
        from moe_offload.generate import DoneEvent
        self.pieces.append(ev.text)
        self.timings = ev.timings
        if isinstance(ev, DoneEvent):
            self.done = ev
        else:
            self.n_tokens += 1
        if self.on_text and ev.text:
            self.on_text(ev.text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@contextmanager
def _stop_on_sigint(stop: threading.Event):
    """Ctrl-C sets `stop` (checked between tokens); a second one raises KeyboardInterrupt."""
    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def answer(conv: Conversation, screen, text: str) -> None:
    """Send `text` as the user's message and show the reply; errors become one line."""
    import torch
    from loaders import GGUFError
    from moe_offload.errors import OffloadError
    from native.errors import NativeError
    conv.turns.append({"role": "user", "content": text})
    ans, stop = Answer(), threading.Event()
    try:
        with torch.inference_mode(), _stop_on_sigint(stop), screen.streaming(ans, stop):
            events = conv.session.chat(conv.messages(), conv.params, conv.think)
            try:
                for ev in events:
                    ans.add(ev)
                    if stop.is_set():
                        break
            finally:
                events.close()
    except KeyboardInterrupt:
        conv.session.reset()              # stopped inside a step: the cache is not trustworthy
    except (OffloadError, GGUFError, NativeError) as e:
        conv.turns.pop()                  # checks fail before the model runs; the rest may not
        if ans.n_tokens or isinstance(e, NativeError):
            conv.session.reset()
        if ans.n_tokens:
            screen.finish(ans, "stopped by an error")
        more = " (/reset starts a new conversation)" if conv.turns else ""
        screen.error(f"{e}{more}")
        return
    if ans.n_tokens or ans.done:
        conv.turns.append({"role": "assistant", "content": ans.text})
    else:
        conv.turns.pop()                  # stopped before a word: forget the question too
    reason = ans.done.reason if ans.done else "interrupted"
    if ans.timings is not None:
        conv.answers.append((ans.timings, ans.n_tokens, reason))
    screen.finish(ans, status_line(conv, ans.timings, ans.n_tokens, reason))


_REASONS = {"length": "hit -n", "context": "context full: /reset", "interrupted": "interrupted"}


def status_line(conv: Conversation, t, n: int, reason: str) -> str:
    st = conv.session.state
    parts = [f"TTFT {t.ttft_s * 1000:.0f} ms", f"prompt {t.n_prompt} tok {t.prompt_tps:.1f} tok/s",
             f"answer {n} tok {t.decode_tps:.1f} tok/s", f"ctx {st.n_past}/{st.n_ctx}"
             ] if t is not None else []
    return " | ".join(parts + ([_REASONS[reason]] if reason in _REASONS else []))


def stats_text(conv: Conversation) -> str:
    if conv.answers:
        t, n, reason = conv.answers[-1]
        lines = [f"last answer: {n} tokens at {t.decode_tps:.1f} tok/s, prompt {t.n_prompt} "
                 f"tokens at {t.prompt_tps:.1f} tok/s, TTFT {t.ttft_s * 1000:.0f} ms, stop: {reason}"]
    else:
        lines = ["last answer: none yet"]

    def total(key):
        return sum(getattr(t, key) for t, _, _ in conv.answers)

    def rate(n, sec):
        return f"{n / sec:.1f}" if sec > 0 else "-"
    k = len(conv.answers)
    lines.append(f"session: {k} answer{'' if k == 1 else 's'}, {total('n_prompt')} prompt tokens "
                 f"at {rate(total('n_prompt'), total('prompt_s'))} tok/s, "
                 f"{sum(n for _, n, _ in conv.answers)} answer tokens at "
                 f"{rate(total('n_decode'), total('decode_s'))} tok/s")
    st = conv.session.state
    lines.append(f"context: {st.n_past} of {st.n_ctx} tokens in use")
    model_stats = getattr(conv.session.model, "stats", None)
    if callable(model_stats):
        lines += offload_stats_lines(model_stats())
    return "\n".join(lines)


def command(conv: Conversation, screen, line: str) -> bool:
    """Run one /command; False means quit."""
    name, arg = (line.split(maxsplit=1) + [""])[:2]
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        conv.reset()
        screen.say("new conversation")
    elif name == "/system":
        if arg:
            conv.system = arg
            conv.reset()
            screen.say("system prompt set; new conversation")
        else:
            screen.say(f"system prompt: {conv.system}" if conv.system else
                       "no system prompt; /system TEXT sets one")
    elif name == "/temp":
        if arg:
            try:
                value = float(arg)
            except ValueError:
                value = -1.0
            if not (math.isfinite(value) and value >= 0):
                screen.note(f"/temp {arg}: give a number >= 0 (0 = greedy)")
                return True
            conv.params = replace(conv.params, temperature=value)
        temp = conv.params.temperature
        screen.say(f"temperature {temp:g}" + (" (greedy)" if temp <= 0 else ""))
    elif name == "/stats":
        screen.say(stats_text(conv))
    elif name == "/help":
        screen.say(HELP)
    else:
        screen.note(f"unknown command {name}; /help lists the commands (// sends a leading /)")
    return True


# ---- loading -------------------------------------------------------------------------------------

def load(args: argparse.Namespace, screen) -> tuple[Conversation, list[str]]:
    """The model, its session and the banner lines; bad input raises one clear error."""
    from loaders import open_model
    from loaders.chat_template import ChatTemplate
    from loaders.synth import default_model_path, ensure_default_model
    from loaders.tokenizer import Tokenizer
    from moe_offload.generate import Session
    dev = device_for(args.device, args.vram)
    embedded = args.model is None
    if args.n_predict is None:
        args.n_predict = 128 if embedded else 1024
    params = sampling_params(args)
    if embedded:
        path = default_model_path()
        with screen.busy(f"building the embedded default model into {path.parent} (once)"
                         if not path.exists() else "loading the embedded default model"):
            ensure_default_model()
    else:
        path = args.model
    with screen.busy(f"loading {path}"):
        loaded = open_model(path)
        md = loaded.metadata
        if "tokenizer.ggml.tokens" not in md:
            raise CLIError(f"{path} has no tokenizer metadata, so chat cannot read or write text; "
                           "use `ftpatch logits MODEL --tokens IDS` instead")
        tok = Tokenizer.from_metadata(md, str(path))
        template = ChatTemplate.from_metadata(md, str(path))
        n_ctx = context_size(args.ctx, loaded.config.n_ctx_train)
        model = build_for(loaded, dev, n_ctx, args.vram, placement_options(args))
        session = Session(model, model.new_state(1, n_ctx), tok, template)
    conv = Conversation(session, params, args.system, False if args.no_think else None)
    where = f"{dev}" + (f", offload runtime under {args.vram / 2**30:.2f} GiB of VRAM"
                        if args.vram is not None else "")
    if embedded:
        banner = ["embedded default model: a tiny synthetic qwen35moe with random weights, for "
                  "trying the machinery; its replies are gibberish, not a bug.",
                  "Pass a GGUF file (ftpatch chat MODEL.gguf) to talk to a real model."]
    else:
        banner = [f"{md.get('general.name') or path}"]
    banner.append(f"{where} | context {n_ctx} tokens | /help lists the commands, Ctrl-D quits")
    if args.no_think and "enable_thinking" not in template.source:
        banner.append("note: this model's chat template has no thinking switch; --no-think "
                      "changes nothing")
    return conv, banner


# ---- screens: piped (plain lines) and terminal (prompt_toolkit + rich) ------------------------------

_CONTROLS = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {0x7F: 0x2421} | {
    c: 0xFFFD for c in range(0x80, 0xA0)}


def printable(text: str) -> str:
    """Control characters (a random-weights model emits them) as visible symbols, one for one,
    so model output can never drive the terminal."""
    return text.translate(_CONTROLS)


class PlainScreen:
    """stdin is not a terminal: plain lines; answers and command output on stdout."""

    def read(self) -> str | None:
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None

    def say(self, text: str) -> None:
        print(text, flush=True)

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def error(self, text: str) -> None:
        print(f"ftpatch: error: {text}", file=sys.stderr, flush=True)

    def busy(self, what: str):
        return nullcontext()

    @contextmanager
    def streaming(self, ans: Answer, stop: threading.Event):
        ans.on_text = lambda t: (sys.stdout.write(printable(t)), sys.stdout.flush())
        yield

    def finish(self, ans: Answer, status: str) -> None:
        print(flush=True)
        if status:
            self.note(status)


class TerminalScreen:
    """A terminal: prompt_toolkit reads, rich writes. While an answer streams, a transient view
    shows its newest lines under a spinner; then the whole answer is printed once (soft-wrapped,
    so it copies cleanly) and the status line follows."""

    def __init__(self):
        from rich.console import Console
        self.console = Console(highlight=False)
        self._prompt = None
        self._armed = False               # Ctrl-C on an empty line once: the next one quits

    def _session(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
        from loaders.synth import default_model_path
        keys = KeyBindings()

        @keys.add("escape", "enter")      # Alt-Enter sends the same bytes
        def _newline(event):
            event.current_buffer.insert_text("\n")

        @keys.add("c-c")
        def _clear_or_quit(event):
            if event.current_buffer.text:
                event.current_buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt())

        path = default_model_path().parent / "chat_history"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:
            history = InMemoryHistory()
        return PromptSession(history=history, key_bindings=keys,
                             prompt_continuation=lambda width, n, soft: "." * (width - 1) + " ")

    def read(self) -> str | None:
        from prompt_toolkit.formatted_text import FormattedText
        self._prompt = self._prompt or self._session()
        while True:
            try:
                text = self._prompt.prompt(FormattedText([("bold ansicyan", "> ")]))
            except EOFError:
                return None
            except KeyboardInterrupt:
                if self._armed:
                    return None
                self._armed = True
                self.console.print("[dim](Ctrl-C again or Ctrl-D to quit)[/]")
                continue
            self._armed = False
            return text

    def say(self, text: str, style: str = "") -> None:
        from rich.text import Text
        self.console.print(Text(text, style=style))

    def note(self, text: str) -> None:
        self.say(text, "dim")

    def error(self, text: str) -> None:
        self.say(f"error: {text}", "red")

    def busy(self, what: str):
        return self.console.status(what, spinner="dots")

    @contextmanager
    def streaming(self, ans: Answer, stop: threading.Event):
        from rich.live import Live
        with Live(_LiveTail(ans, stop), console=self.console, transient=True,
                  refresh_per_second=12, vertical_overflow="crop"):
            yield

    def finish(self, ans: Answer, status: str) -> None:
        if ans.text.strip():
            self.console.print(styled(ans.text), soft_wrap=True)
        self.note(status)
        self.console.print()


def styled(text: str):
    """The answer as rich Text: control characters made visible, a <think> block dimmed."""
    from rich.text import Text
    out = Text(printable(text))
    start = text.find("<think>")
    if start >= 0:
        end = text.find("</think>", start)
        out.stylize("dim", start, len(text) if end < 0 else end + len("</think>"))
    return out


class _LiveTail:
    """What the live view draws: the last lines of the answer that fit, then a spinner line."""

    def __init__(self, ans: Answer, stop: threading.Event):
        self.ans, self.stop = ans, stop

    def __rich_console__(self, console, options):
        from rich.spinner import Spinner
        from rich.text import Text
        width, keep = options.max_width, max(1, console.size.height - 3)
        text = self.ans.text
        cut = max(0, len(text) - keep * width * 2)    # enough characters for `keep` lines
        lines = styled(text)[cut:].wrap(console, width)
        yield Text("\n").join(lines[-keep:])
        t, n = self.ans.timings, self.ans.n_tokens
        what = ("stopping" if self.stop.is_set() else
                f"{n} tokens, {t.decode_tps:.1f} tok/s | Ctrl-C stops" if n and t else
                "reading the prompt | Ctrl-C stops")
        yield Spinner("dots", Text(what, style="dim"))


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    screen = TerminalScreen() if interactive else PlainScreen()
    conv, banner = load(args, screen)
    for line in banner:
        screen.note(line)
    while True:
        line = screen.read()
        if line is None:
            break
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("/") and not stripped.startswith("//"):
            if not command(conv, screen, stripped):
                break
            continue
        answer(conv, screen, stripped[1:] if stripped.startswith("//") else line)
    return 0


COMMANDS = {"chat": (add_parser, run)}
