"""The prefix index (the server's cache and the chat session's rule): the longest covered prefix wins, a partly matching entry
falls back to its latest snapshot at or below the match, one prompt token is always left to
feed, the oldest entry goes first, and a prompt whose text extends an entry's text continues
from the entry's own ids."""
from types import SimpleNamespace

from moe_offload import Cached, PrefixIndex as PrefixCache


def _snap(n):
    return SimpleNamespace(n_past=n)


def test_longest_covered_prefix_is_taken_and_removed():
    c = PrefixCache(4)
    short, long_ = Cached("A", [1, 2]), Cached("B", [1, 2, 3, 4])
    c.put(short)
    c.put(long_)
    entry, n, snap, _ = c.take([1, 2, 3, 4, 5])
    assert (entry, n, snap) == (long_, 4, None)
    assert c.entries == [short]


def test_a_diverging_entry_rewinds_to_its_snapshot():
    c = PrefixCache(4)
    e = Cached("A", [1, 2, 3, 4, 5, 6], snaps=[_snap(2), _snap(4), _snap(6)])
    c.put(e)
    entry, n, snap, _ = c.take([1, 2, 3, 4, 9, 9])     # matches 4 tokens, then differs
    assert entry is e and n == 4 and snap.n_past == 4
    c.put(e)
    entry, n, snap, _ = c.take([1, 2, 3, 9])           # matches 3: the snapshot at 2
    assert n == 2 and snap.n_past == 2
    c.put(e)
    assert c.take([7, 8]) == (None, 0, None, [7, 8])        # nothing shared: nothing taken
    assert c.entries == [e]


def test_one_prompt_token_is_left_to_feed():
    c = PrefixCache(4)
    c.put(Cached("A", [1, 2, 3], snaps=[_snap(1)]))
    entry, n, snap, _ = c.take([1, 2, 3])              # the whole prompt is cached
    assert n == 1 and snap.n_past == 1              # rewind so the last token is fed again


def test_oldest_goes_first():
    c = PrefixCache(2)
    a, b, d = Cached("A", [1]), Cached("B", [2]), Cached("D", [3])
    assert c.put(a) is None and c.put(b) is None
    assert c.put(d) is a
    assert c.pop_oldest() is b and c.pop_oldest() is d and c.pop_oldest() is None


def _encode(text):
    return [ord(ch) for ch in text]


def test_a_prompt_whose_text_extends_an_entry_keeps_the_entry_ids():
    """The reply's ids (here 7, 8 spelling "xy") need not be how the text tokenizes again."""
    c = PrefixCache(4)
    e = Cached("A", [1, 2, 7, 8], text="ab" + "xy")
    c.put(e)
    prompt = _encode("abxy?!")                       # the canonical ids of the new text
    entry, n, snap, ids = c.take(prompt, "abxy?!", _encode)
    assert entry is e and n == 4 and snap is None
    assert ids == [1, 2, 7, 8] + _encode("?!")       # the cached ids, then the new text's


def test_text_that_does_not_extend_the_entry_falls_back_to_the_ids():
    c = PrefixCache(4)
    e = Cached("A", [97, 98, 7], snaps=[_snap(2)], text="abZ")
    c.put(e)
    entry, n, snap, ids = c.take(_encode("abc!"), "abc!", _encode)
    assert entry is e and n == 2 and snap.n_past == 2 and ids == _encode("abc!")
    c.put(e)
    entry, n, snap, ids = c.take(_encode("abZ"), "abZ", _encode)   # nothing new after it
    assert n == 2 and ids == _encode("abZ")


def test_a_continuation_longer_than_the_context_is_not_taken():
    c = PrefixCache(4)
    e = Cached("A", [1, 2, 7, 8], text="abxy")
    c.put(e)
    entry, n, snap, ids = c.take(_encode("abxy?!"), "abxy?!", _encode, max_len=6)
    assert (entry, n, ids) == (None, 0, _encode("abxy?!"))   # 6 ids would not fit under 6
    assert c.entries == [e]
    entry, n, snap, ids = c.take(_encode("abxy?!"), "abxy?!", _encode, max_len=7)
    assert entry is e and ids == [1, 2, 7, 8, 63, 33]


def test_a_reply_whose_text_does_not_come_back_keeps_its_prompt():
    """The last reply's text is not what the client sends back (cut inside a character, trimmed
    by the template): the entry's prompt still extends, so its ids and the rewind point at its
    end are kept -- not the first divergence of ids, which for a conversation that reused its
    replies so far (their generated ids kept) lies turns back, past the rewind points kept."""
    encode = lambda t: [ord(c) for c in t]   # noqa: E731
    # "abcd" was the last prompt; its "c" is an earlier reply, kept as the id generated (60)
    prompt_ids, reply_ids = encode("ab") + [60] + encode("d"), [50, 51]
    e = Cached("st", prompt_ids + reply_ids, [_snap(2), _snap(4)], text="abcdXY",
               prompt_text="abcd", n_prompt=4)
    cache = PrefixCache(2)
    cache.put(e)
    new = "abcdX?next"                       # the reply came back as "X?", not "XY"
    entry, n, snap, ids = cache.take(encode(new), new, encode)
    assert entry is e and n == 4 and snap.n_past == 4
    assert ids == prompt_ids + encode("X?next")
    # without the rewind point at the prompt's end the ids decide: they part at the earlier
    # reply, and the last rewind point below that is kept
    e.snaps = [_snap(2)]
    cache.put(e)
    entry, n, snap, ids = cache.take(encode(new), new, encode)
    assert n == 2 and snap.n_past == 2 and ids == encode(new)
