"""Checks at the edge: text from argv and stdin, and numbers held to their ranges.

Python hands argv (and, in a C locale, stdin) over as str with the bytes that are not UTF-8 kept
as lone surrogates (surrogateescape). Such text goes to the model as it is: the tokenizer encodes
each of those surrogates as the byte it stands for, so the model reads the bytes the user gave.
stdin is read as bytes for the same reason (a UTF-8 locale would otherwise refuse them). Only
text shown back to people is made displayable. A number outside its range raises CLIError
naming the flag, the value and what is allowed.
"""
from __future__ import annotations

import sys

from ..errors import CLIError


def displayable(s: str) -> str:
    """`s` with lone surrogates (bytes that were not UTF-8) as U+FFFD, safe to print anywhere."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:
        raw = s.encode("utf-8", "surrogateescape")    # the original bytes of argv / stdin
    except UnicodeEncodeError:
        raw = s.encode("utf-8", "surrogatepass")      # surrogates from elsewhere: invalid UTF-8
    return raw.decode("utf-8", "replace")


def read_stdin() -> str:
    """All of standard input; bytes that are not UTF-8 kept as surrogateescape does."""
    buf = getattr(sys.stdin, "buffer", None)
    return buf.read().decode("utf-8", "surrogateescape") if buf is not None else sys.stdin.read()


def read_stdin_line() -> str | None:
    """One line of standard input without its line end (bytes kept as in read_stdin); None at
    the end."""
    buf = getattr(sys.stdin, "buffer", None)
    line = (buf.readline().decode("utf-8", "surrogateescape") if buf is not None
            else sys.stdin.readline())
    return line.rstrip("\r\n") if line else None


def check(flag: str, value, ok: bool, allowed: str) -> None:
    """Raise `FLAG VALUE: ALLOWED` unless ok."""
    if not ok:
        shown = f"{value:g}" if isinstance(value, float) else value   # -1, not -1.0, as typed
        raise CLIError(f"{flag} {shown}: {allowed}")


def check_positive(flag: str, value: int | None) -> None:
    """An optional count that must be 1 or more."""
    if value is not None:
        check(flag, value, value >= 1, "give 1 or more")


def check_fraction(flag: str, value: float | None) -> None:
    """An optional number in [0, 1]."""
    if value is not None:
        check(flag, value, 0.0 <= value <= 1.0, "give a number from 0 to 1")


def check_seed(flag: str, value: int | None) -> None:
    if value is not None:
        check(flag, value, 0 <= value < 2**64, "give a whole number from 0 to 2**64 - 1")
