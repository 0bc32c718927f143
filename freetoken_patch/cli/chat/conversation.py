"""The conversation behind `ftpatch chat`: its messages, the sampling settings, one answer at a
time, the /commands and the statistics. No terminal I/O here: what is shown goes through a
screen object (say, note, error, streaming, finish; see screens.py)."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from moe_offload import as_backend, sampling_problem

from ..model_args import offload_stats_lines, stop_reason

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


@dataclass
class Conversation:
    session: object                      # moe_offload.Session
    params: object                       # SamplingParams
    system: str | None = None
    think: bool | None = None            # enable_thinking for the template (None: its default)
    turns: list = field(default_factory=list)
    answers: list = field(default_factory=list)   # (Timings, tokens shown, stop reason) each
    loaded: object = None                # the LoadedModel (its file, for an error about it)

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
        from moe_offload import DoneEvent
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
    from moe_offload import NonFiniteLogits, OffloadError
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
    except NonFiniteLogits:               # the weights are bad: no later answer can be good
        raise
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


def status_line(conv: Conversation, t, n: int, reason: str) -> str:
    """One line after an answer: speeds, context use, and why it stopped unless at its end."""
    st = conv.session.state
    parts = [f"TTFT {t.ttft_s * 1000:.0f} ms", f"prompt {t.n_prompt} tok {t.prompt_tps:.1f} tok/s",
             f"answer {n} tok {t.decode_tps:.1f} tok/s", f"ctx {st.n_past}/{st.n_ctx}"
             ] if t is not None else []
    if reason == "context":
        parts.append("context full: /reset")
    elif reason in ("length", "interrupted"):
        parts.append(stop_reason(reason, conv.params, st.n_ctx))
    return " | ".join(parts)


def stats_text(conv: Conversation) -> str:
    if conv.answers:
        t, n, reason = conv.answers[-1]
        lines = [f"last answer: {n} tokens at {t.decode_tps:.1f} tok/s, prompt {t.n_prompt} "
                 f"tokens at {t.prompt_tps:.1f} tok/s, TTFT {t.ttft_s * 1000:.0f} ms, stop: "
                 f"{stop_reason(reason, conv.params, conv.session.state.n_ctx)}"]
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
    if conv.session.draft is not None:
        lines.append(conv.session.draft.stats.summary())
    stats = as_backend(conv.session.model).stats()
    if stats is not None:
        lines += offload_stats_lines(stats)
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
            problem = sampling_problem("temperature", value)
            if problem:
                screen.error(f"/temp {arg}: {problem}")
                return True
            conv.params = replace(conv.params, temperature=value)
        temp = conv.params.temperature
        screen.say(f"temperature {temp:g}" + (" (greedy)" if temp <= 0 else ""))
    elif name == "/stats":
        screen.say(stats_text(conv))
    elif name == "/help":
        screen.say(HELP)
    else:
        screen.error(f"unknown command {name}; /help lists the commands (// sends a leading /)")
    return True


