"""The screens of `ftpatch chat`: plain lines when stdin is piped, prompt_toolkit input and rich
output on a terminal. Each offers read, say, note, error, busy, streaming and finish."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager, nullcontext

from ..inputs import displayable, read_stdin_line
from .conversation import Answer

_CONTROLS = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {0x7F: 0x2421} | {
    c: 0xFFFD for c in range(0x80, 0xA0)}


def printable(text: str) -> str:
    """Control characters (a random-weights model emits them) as visible symbols, one for one,
    so model output can never drive the terminal."""
    return text.translate(_CONTROLS)


class PlainScreen:
    """stdin is not a terminal: plain lines; answers on stdout, everything else on stderr (so a
    script reads the answers alone); counts the errors for the exit status."""

    def __init__(self):
        self.errors = 0

    def read(self) -> str | None:
        return read_stdin_line()

    def say(self, text: str) -> None:
        print(displayable(text), file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        self.say(text)

    def error(self, text: str) -> None:
        self.errors += 1
        self.say(f"ftpatch: error: {text}")

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
        self.console.print(Text(displayable(text), style=style))   # user text may echo back

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
