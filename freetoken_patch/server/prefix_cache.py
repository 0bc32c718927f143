"""The server's prefix cache: recent sequences' States by the tokens they hold, so a request
whose prompt starts with a cached conversation (or with one of its snapshots' prefixes) takes
that State over and prefills only the rest.

A chat's reply rarely comes back as the same ids: the client returns its text, and the text of
sampled ids need not tokenize into those ids again (a word split unusually, or bytes of a
character cut). So an entry also keeps the text its ids spell (the prompt's text and the reply's
decoded ids), and a prompt whose text extends it continues from the entry's own ids, only the
new text tokenized -- the conversation keeps the tokens the model saw, as `ftpatch chat` does."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moe_offload import continue_ids


@dataclass(eq=False)
class Cached:
    """A finished sequence kept for reuse: its State, the ids it holds, rewind points in it."""

    state: object
    tokens: list[int]
    snaps: list = field(default_factory=list)
    text: str | None = None           # the text the tokens spell, when it is known exactly


class PrefixCache:
    """Recent sequences' States by the tokens they hold, most recent last, at most `size`."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[Cached] = []

    def take(self, prompt: list[int], text: str | None = None,
             encode: Callable[[str], list[int]] | None = None, max_len: int | None = None
             ) -> tuple[Cached | None, int, object, list[int]]:
        """Remove and return the entry that covers the longest prefix of `prompt` (at least one
        prompt token is left to feed), with that length, the snapshot to restore (None:
        the entry's tokens are all a prefix) and the prompt's ids: `prompt`, or -- when
        `text` extends an entry's text further than any ids match, in fewer than `max_len`
        ids -- the entry's ids followed by encode(the rest of the text)."""
        best, best_n, best_snap, ids = None, 0, None, prompt
        limit = len(prompt) - 1
        for e in self.entries:
            n, m = 0, min(limit, len(e.tokens))
            while n < m and e.tokens[n] == prompt[n]:
                n += 1
            if n == len(e.tokens):
                use, snap = n, None
            else:
                snaps = [s for s in e.snaps if s.n_past <= n]
                use, snap = (snaps[-1].n_past, snaps[-1]) if snaps else (0, None)
            if use > best_n:
                best, best_n, best_snap = e, use, snap
        if text is not None and encode is not None:
            for e in self.entries:
                if len(e.tokens) <= best_n:
                    continue
                extended = continue_ids(e.tokens, e.text, text, encode)
                if extended is not None and (max_len is None or len(extended) < max_len):
                    best, best_n, best_snap, ids = e, len(e.tokens), None, extended
        if best is not None:
            self.entries.remove(best)
        return best, best_n, best_snap, ids

    def put(self, entry: Cached) -> Cached | None:
        """Add an entry; returns the one pushed out, if any."""
        self.entries.append(entry)
        return self.entries.pop(0) if len(self.entries) > self.size else None

    def pop_oldest(self) -> Cached | None:
        return self.entries.pop(0) if self.entries else None
