"""The server's prefix cache: recent sequences' States by the tokens they hold, so a request
whose prompt starts with a cached conversation (or with one of its snapshots' prefixes) takes
that State over and prefills only the rest."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Cached:
    """A finished sequence kept for reuse: its State, the ids it holds, rewind points in it."""

    state: object
    tokens: list[int]
    snaps: list = field(default_factory=list)


class PrefixCache:
    """Recent sequences' States by the tokens they hold, most recent last, at most `size`."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[Cached] = []

    def take(self, prompt: list[int]) -> tuple[Cached | None, int, object]:
        """Remove and return the entry that covers the longest prefix of `prompt` (at least one
        prompt token is left to feed), with that length and the snapshot to restore (None:
        the entry's tokens are all a prefix)."""
        best, best_n, best_snap = None, 0, None
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
        if best is not None:
            self.entries.remove(best)
        return best, best_n, best_snap

    def put(self, entry: Cached) -> Cached | None:
        """Add an entry; returns the one pushed out, if any."""
        self.entries.append(entry)
        return self.entries.pop(0) if len(self.entries) > self.size else None

    def pop_oldest(self) -> Cached | None:
        return self.entries.pop(0) if self.entries else None
