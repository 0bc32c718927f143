"""Prefix reuse: a prompt that starts with what a cached sequence holds prefills only the rest.

One rule for the chat session and the server: the longest common prefix of the prompt and the
cached ids is used where the cache holds all of it, else the last rewind point (snapshot) below
it. A chat's reply rarely comes back as the same ids: the client returns its text, and the text
of sampled ids need not tokenize into those ids again (a word split unusually, or bytes of a
character cut). So an entry also keeps the text its ids spell, and a prompt whose text extends
it continues from the entry's own ids, only the new text tokenized (`continue_ids`). Where the
reply's text does not come back exactly (a reply cut inside a character, a template that trims
it), the entry's prompt still does: its ids, with the rewind point at its end, are kept and
the rest tokenized (`Cached.prompt_text`). Without that fallback, the ids of every reply a
conversation reused so far would stay in the cache while the new prompt re-tokenizes them, and
the next miss would fall back past all the rewind points kept."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


def continue_ids(tokens: Sequence[int], cached_text: str | None, text: str,
                 encode: Callable[[str], list[int]]) -> list[int] | None:
    """The ids of `text` on top of a cache that holds `tokens`, whose text is `cached_text`:
    those ids, then encode(the rest of the text) -- when `text` extends `cached_text` with
    something new; else None."""
    if cached_text is None or not tokens or len(text) <= len(cached_text) \
            or not text.startswith(cached_text):
        return None
    return list(tokens) + encode(text[len(cached_text):])


def usable_prefix(tokens: Sequence[int], snaps: Sequence, prompt: Sequence[int]) -> tuple[int, object]:
    """How much of a cache holding `tokens` (rewind points `snaps`, oldest first) a prompt can
    keep -> (tokens kept, the snapshot to restore or None when the cache stays as it is). At
    least one prompt token is always left to feed."""
    n, m = 0, min(len(prompt) - 1, len(tokens))
    while n < m and tokens[n] == prompt[n]:
        n += 1
    if n == len(tokens):
        return n, None
    below = [s for s in snaps if s.n_past <= n]
    return (below[-1].n_past, below[-1]) if below else (0, None)


@dataclass(eq=False)
class Cached:
    """A sequence kept for reuse: its State, the ids it holds, rewind points in it."""

    state: object
    tokens: list[int]
    snaps: list = field(default_factory=list)
    text: str | None = None           # the text the tokens spell, when it is known exactly
    prompt_text: str | None = None    # the text of tokens[:n_prompt], the last prompt fed
    n_prompt: int = 0

    def prompt_snapshot(self):
        """The rewind point at the end of the last prompt, or None."""
        return next((s for s in self.snaps if s.n_past == self.n_prompt), None)


class PrefixIndex:
    """Recent sequences' States by the tokens they hold, most recent last, at most `size`."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[Cached] = []

    def take(self, prompt: list[int], text: str | None = None,
             encode: Callable[[str], list[int]] | None = None, max_len: int | None = None
             ) -> tuple[Cached | None, int, object, list[int]]:
        """Remove and return the entry that covers the longest prefix of `prompt`, with that
        length, the snapshot to restore (None: the entry's tokens are all a prefix) and the
        prompt's ids: `prompt`, or -- when `text` extends an entry's text further than any ids
        match, in fewer than `max_len` ids -- the entry's ids followed by encode(the rest)."""
        best, best_n, best_snap, ids = None, 0, None, prompt
        for e in self.entries:
            use, snap = usable_prefix(e.tokens, e.snaps, prompt)
            if use > best_n:
                best, best_n, best_snap = e, use, snap
        if text is not None and encode is not None:
            fits = lambda ids: ids is not None and (max_len is None or len(ids) < max_len)  # noqa: E731
            for e in self.entries:
                if len(e.tokens) > best_n:
                    extended = continue_ids(e.tokens, e.text, text, encode)
                    if fits(extended):
                        best, best_n, best_snap, ids = e, len(e.tokens), None, extended
                        continue
                snap = e.prompt_snapshot() if e.n_prompt > best_n else None
                if snap is not None:
                    extended = continue_ids(e.tokens[:e.n_prompt], e.prompt_text, text, encode)
                    if fits(extended):
                        best, best_n, best_snap, ids = e, e.n_prompt, snap, extended
        if best is not None:
            self.entries.remove(best)
        return best, best_n, best_snap, ids

    def put(self, entry: Cached) -> Cached | None:
        """Add an entry; returns the one pushed out, if any."""
        self.entries.append(entry)
        return self.entries.pop(0) if len(self.entries) > self.size else None

    def pop_oldest(self) -> Cached | None:
        return self.entries.pop(0) if self.entries else None
