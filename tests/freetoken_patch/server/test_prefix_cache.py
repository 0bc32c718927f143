"""The server's prefix cache on its own: the longest covered prefix wins, a partly matching entry
falls back to its latest snapshot at or below the match, one prompt token is always left to
feed, and the oldest entry goes first."""
from types import SimpleNamespace

from freetoken_patch.server.prefix_cache import Cached, PrefixCache


def _snap(n):
    return SimpleNamespace(n_past=n)


def test_longest_covered_prefix_is_taken_and_removed():
    c = PrefixCache(4)
    short, long_ = Cached("A", [1, 2]), Cached("B", [1, 2, 3, 4])
    c.put(short)
    c.put(long_)
    entry, n, snap = c.take([1, 2, 3, 4, 5])
    assert (entry, n, snap) == (long_, 4, None)
    assert c.entries == [short]


def test_a_diverging_entry_rewinds_to_its_snapshot():
    c = PrefixCache(4)
    e = Cached("A", [1, 2, 3, 4, 5, 6], snaps=[_snap(2), _snap(4), _snap(6)])
    c.put(e)
    entry, n, snap = c.take([1, 2, 3, 4, 9, 9])     # matches 4 tokens, then differs
    assert entry is e and n == 4 and snap.n_past == 4
    c.put(e)
    entry, n, snap = c.take([1, 2, 3, 9])           # matches 3: the snapshot at 2
    assert n == 2 and snap.n_past == 2
    c.put(e)
    assert c.take([7, 8]) == (None, 0, None)        # nothing shared: nothing taken
    assert c.entries == [e]


def test_one_prompt_token_is_left_to_feed():
    c = PrefixCache(4)
    c.put(Cached("A", [1, 2, 3], snaps=[_snap(1)]))
    entry, n, snap = c.take([1, 2, 3])              # the whole prompt is cached
    assert n == 1 and snap.n_past == 1              # rewind so the last token is fed again


def test_oldest_goes_first():
    c = PrefixCache(2)
    a, b, d = Cached("A", [1]), Cached("B", [2]), Cached("D", [3])
    assert c.put(a) is None and c.put(b) is None
    assert c.put(d) is a
    assert c.pop_oldest() is b and c.pop_oldest() is d and c.pop_oldest() is None
