"""Byte-level BPE from a GGUF's `tokenizer.ggml.*` tables: text <-> token ids.

encode: split special tokens out (only when asked), split the rest into words with the
pre-tokenizer named by `tokenizer.ggml.pre`, map each word's UTF-8 bytes to GPT-2's printable
stand-ins, then merge adjacent pieces by merge rank (lowest first, leftmost on ties). Results are
cached per word, which is what makes ordinary text fast: most words repeat.
decode: normal tokens map back through the byte table; control, user-defined and unused tokens
are their text. `StreamDecoder` holds back incomplete UTF-8 so a stream never shows half a char.
"""
from __future__ import annotations

import codecs
import heapq
import operator
import os
import re
from itertools import chain, repeat
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import regex

from .errors import GGUFError
from .pretokenize import get_pretokenizer
from .vocab import CONTROL, UNUSED, USER_DEFINED, VocabSpec, bytes_to_unicode, vocab_from_metadata

# byte -> printable stand-in; also the str.translate table latin-1 text -> stand-ins
_BYTE_TO_CHAR = bytes_to_unicode()
_DECODE_TABLE = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}   # stand-in -> latin-1 char

# Texts that end a turn whatever the ids (llama.cpp also puts these in its end-of-generation set).
EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>")

_CACHE_MAX = 1 << 18    # words; cleared when full (1 MB of Python source has ~13k distinct)
_CACHE_WORD_MAX = 128   # longer words (whitespace runs, blobs) are not worth caching


class Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with a registered pre-tokenizer."""

    def __init__(self, vocab: VocabSpec, *, add_bos: bool | None = None, add_eos: bool = False):
        self.where = where = vocab.where     # the file, named in every message about it
        if vocab.model != "gpt2":
            raise GGUFError(f"{where}: tokenizer.ggml.model = {vocab.model!r:.60} is not "
                            "supported; supported: gpt2 (byte-level BPE)")
        self.vocab = vocab
        self.pre = get_pretokenizer(vocab.pre, where)
        self.tokens = vocab.tokens
        self.add_bos = self.pre.add_bos if add_bos is None else bool(add_bos)
        self.add_eos = bool(add_eos)
        self.bos_id, self.eos_id = vocab.bos_id, vocab.eos_id
        types = np.asarray(vocab.token_types)
        special = np.flatnonzero(np.isin(types, (CONTROL, USER_DEFINED))).tolist()
        raw = np.isin(types, (CONTROL, USER_DEFINED, UNUSED))   # decoded as plain text
        self._raw = set(np.flatnonzero(raw).tolist())
        # pieces BPE may produce: every token that is not special or unused (first id wins)
        normal = np.flatnonzero(~raw)[::-1].tolist()
        self._piece_id: dict[str, int] = dict(zip(map(self.tokens.__getitem__, normal), normal))
        self._byte_ids = [self._piece_id.get(_BYTE_TO_CHAR[b]) for b in range(256)]
        self._merges = _merge_table(vocab.merges, self._piece_id, len(self.tokens), where)
        self._special_id = {self.tokens[i]: i for i in special if self.tokens[i]}
        # control tokens (turn and role markup): chat prompts keep them out of client text
        self.control_texts = frozenset(
            self.tokens[i] for i in np.flatnonzero(types == CONTROL).tolist() if self.tokens[i])
        # user-defined tags a template writes (<think>, <tool_call>): one token each, not BPE
        self.markup_texts = frozenset(
            t for t in self._special_id if t not in self.control_texts
            and len(t) > 2 and t.startswith("<") and t.endswith(">"))
        self._specials = _SpecialFinder(self._special_id) if self._special_id else None
        self.longest_special = max(map(len, self._special_id), default=0)
        self._split = regex.compile(self.pre.pattern).findall
        self._cache = _WordCache(self._encode_word)
        self._bytes: list[bytes | None] = [None] * len(self.tokens)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_vocab(cls, vocab: VocabSpec, *, add_bos: bool | None = None,
                   add_eos: bool = False) -> "Tokenizer":
        """A tokenizer for `vocab`; `add_bos=None` takes the pre-tokenizer's default."""
        return cls(vocab, add_bos=add_bos, add_eos=add_eos)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], where: str = "model") -> "Tokenizer":
        """A tokenizer from a GGUF metadata table (honours tokenizer.ggml.add_bos/eos_token)."""
        vocab = vocab_from_metadata(md, where)
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            v = md.get(f"tokenizer.ggml.{key}")
            if v is not None and not (isinstance(v, int) and v in (0, 1)):
                raise GGUFError(f"{where}: tokenizer.ggml.{key} = {v!r:.40} is not a bool")
            flags[key] = None if v is None else bool(v)
        return cls(vocab, add_bos=flags["add_bos_token"], add_eos=bool(flags["add_eos_token"]))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """The tokenizer stored in the GGUF at `path` (file, shard or folder)."""
        from .gguf_file import open_gguf
        with open_gguf(path) as f:
            return cls.from_metadata(f.metadata, str(f.path))

    # -- facts --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, eot, eom and the known end-of-turn texts present."""
        ids = {self.eos_id, self.vocab.extra_ids.get("eot"), self.vocab.extra_ids.get("eom")}
        ids.update(self._special_id.get(t) for t in EOG_TEXTS)
        return frozenset(i for i in ids if i is not None and 0 <= i < len(self.tokens))

    @property
    def bos_token(self) -> str:
        """The BOS token's text ('' when the vocabulary has none), e.g. for chat templates."""
        return "" if self.bos_id is None else self.decode([self.bos_id])

    @property
    def eos_token(self) -> str:
        """The EOS token's text ('' when the vocabulary has none)."""
        return "" if self.eos_id is None else self.decode([self.eos_id])

    def token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text`, else of the normal piece `text`, or None."""
        found = self._special_id.get(text)
        return self._piece_id.get(text) if found is None else found

    # -- encode -------------------------------------------------------------------------------
    def encode(self, text: str | bytes, *, add_special: bool = False,
               parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special: BOS/EOS as the model asks; parse_special: text
        spelling a control or user-defined token (e.g. "<|im_end|>") becomes that token.

        Any input encodes (byte-level BPE has a token for every byte): `bytes` need not be
        UTF-8, and a str's lone surrogates (as `surrogateescape` leaves them) encode as the bytes
        they stand for, so decode(encode(b)) gives b back."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", "surrogateescape")
        elif not isinstance(text, str):
            raise GGUFError(f"encode() takes text (str or bytes), not {type(text).__name__}")
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self._needed(self.bos_id, "BOS", "add_bos_token"))
        if parse_special and self._specials is not None:
            pos = 0
            for start, end, name in self._specials.finditer(text):
                self._encode_plain(text[pos:start], out)
                out.append(self._special_id[name])
                pos = end
            self._encode_plain(text[pos:], out)
        else:
            self._encode_plain(text, out)
        if add_special and self.add_eos:
            out.append(self._needed(self.eos_id, "EOS", "add_eos_token"))
        return out

    def find_specials(self, text: str) -> Iterator[tuple[int, int, int]]:
        """(start, end, id) of each special token spelled in `text`, as encode(parse_special=
        True) splits them out: leftmost first, the longest at a position."""
        if self._specials is not None:
            get = self._special_id.__getitem__
            for start, end, name in self._specials.finditer(text):
                yield start, end, get(name)

    def pretokenize(self, text: str) -> list[str]:
        """The words BPE runs on, in order (special tokens are not split out here)."""
        return self._split(text)

    def _needed(self, tid: int | None, what: str, key: str) -> int:
        if tid is None:
            raise GGUFError(f"{self.where}: the model asks for a {what} token "
                            f"(tokenizer.ggml.{key}) but defines none; the file's tokenizer "
                            "metadata is incomplete")
        return tid

    def encode_plain_into(self, text: str, out: list[int]) -> None:
        """Append the ids of `text` (a str) to `out`, special-token text as plain text: encode()
        without its checks, for callers that tokenize a prompt in many pieces."""
        self._encode_plain(text, out)

    def _encode_plain(self, text: str, out: list[int]) -> None:
        if text:   # the hot loop runs in C: cache hits never enter Python code
            out.extend(chain.from_iterable(map(self._cache.__getitem__, self._split(text))))

    def _encode_word(self, word: str) -> tuple[int, ...]:
        raw = _utf8(word)
        if self.pre.ignore_merges:
            whole = self._piece_id.get(raw.decode("latin-1").translate(_BYTE_TO_CHAR))
            if whole is not None:
                return (whole,)
        ids = list(map(self._byte_ids.__getitem__, raw))
        if None in ids:
            byte = raw[ids.index(None)]
            raise GGUFError(f"{self.where}: byte 0x{byte:02x} has no token in the vocabulary; "
                            "it is not a complete byte-level BPE vocabulary")
        return tuple(_bpe(ids, self._merges, len(self.tokens)) if len(ids) > 1 else ids)

    # -- decode -------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (special tokens: their text in UTF-8)."""
        i = self._check_id(token_id)
        b = self._bytes[i]
        if b is None:
            text = self.tokens[i]
            b = text.encode("utf-8") if i in self._raw else _piece_to_bytes(text)
            self._bytes[i] = b
        return b

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        return b"".join(map(self.token_bytes, ids)).decode("utf-8", errors="replace")

    def _check_id(self, token_id: Any) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise GGUFError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < len(self.tokens):
            raise GGUFError(f"token id {i} is outside the vocabulary of {self.where} "
                            f"(0..{len(self.tokens) - 1})")
        return i

    def __repr__(self) -> str:
        return (f"Tokenizer({len(self.tokens)} tokens, {len(self._merges)} merges, "
                f"pre={self.pre.name!r}, {len(self._special_id)} special)")


class StreamDecoder:
    """Incremental decode: `push(id)` returns the text that is complete so far, holding back a
    trailing partial UTF-8 character; `flush()` returns what is left (U+FFFD if it was cut)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token (maybe '')."""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The held-back remainder; the decoder is ready for a new stream afterwards."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class _SpecialFinder:
    """Finds special tokens in text: leftmost first, the longest one at a position (so
    "<|im_end|>" wins over a shorter special it starts with). A regex alternation of every
    special does the same but takes seconds to compile for a vocabulary with 10^5 of them;
    this builds in linear time and tries only the lengths that occur after a possible first
    character."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        lengths: dict[str, set[int]] = {}
        for name in self.names:
            lengths.setdefault(name[0], set()).add(len(name))
        self.lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self.first = re.compile("[" + "".join(map(re.escape, sorted(lengths))) + "]")

    def finditer(self, text: str) -> Iterator[tuple[int, int, str]]:
        pos, search, names = 0, self.first.search, self.names
        while (m := search(text, pos)) is not None:
            i = m.start()
            for n in self.lengths[text[i]]:
                if text[i:i + n] in names:
                    yield i, i + n, text[i:i + n]
                    pos = i + n
                    break
            else:
                pos = i + 1


# -- BPE core ------------------------------------------------------------------------------------

class _WordCache(dict):
    """word -> its token ids, filled on first sight; emptied when full (bounded memory)."""

    def __init__(self, encode_word):
        super().__init__()
        self._encode_word = encode_word

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self._encode_word(word)
        if len(word) <= _CACHE_WORD_MAX:
            if len(self) >= _CACHE_MAX:
                self.clear()
            self[word] = ids
        return ids


def _merge_table(merges: list[str], piece_id: dict[str, int], n_vocab: int,
                 where: str) -> dict[int, int]:
    """left_id * n_vocab + right_id -> rank * n_vocab + merged_id: ints hash fast, and the value
    orders by rank. Merges naming a piece missing from the vocabulary could never apply (or name
    their result), so they are left out. Built in bulk: this runs once per 150k-merge load."""
    # one flat split, not 150k small lists (whose allocation keeps the GC busy)
    flat = "\n".join(merges).replace(" ", "\n").split("\n") if merges else []
    if len(flat) != 2 * len(merges) or not all(flat):   # a bad merge, or a piece with a newline
        pairs = [m.split(" ") for m in merges]
        bad = next((r for r, p in enumerate(pairs) if len(p) != 2 or not all(p)), None)
        if bad is not None:
            raise GGUFError(f"{where}: tokenizer.ggml.merges[{bad}] = {merges[bad]!r:.60} is "
                            "not two pieces 'a b'; the file's tokenizer is damaged")
        flat = [piece for p in pairs for piece in p]
    left, right = flat[0::2], flat[1::2]
    get = piece_id.get
    ia = np.fromiter(map(get, left, repeat(-1)), np.int64, len(left))
    ib = np.fromiter(map(get, right, repeat(-1)), np.int64, len(left))
    iab = np.fromiter(map(get, map(operator.add, left, right), repeat(-1)), np.int64, len(left))
    rank = np.flatnonzero((ia >= 0) & (ib >= 0) & (iab >= 0))[::-1]   # reversed: best rank wins
    keys = ia[rank] * n_vocab + ib[rank]
    return dict(zip(keys.tolist(), (rank * n_vocab + iab[rank]).tolist()))


def _bpe(syms: list[int], merges: dict[int, int], n: int) -> list[int]:
    """Merge adjacent pieces of one word, lowest rank first, leftmost first on equal ranks.

    A heap of candidate pairs over a linked list: O(len log len), so a 100k-byte word is fine.
    A candidate is stale once either side has changed (pieces only grow), checked on pop."""
    nxt = list(range(1, len(syms) + 1))
    nxt[-1] = -1
    prv = list(range(-1, len(syms) - 1))
    get = merges.get
    heap = []
    for i in range(len(syms) - 1):
        m = get(syms[i] * n + syms[i + 1])
        if m is not None:
            heap.append((m, i, syms[i], syms[i + 1]))
    heapq.heapify(heap)
    while heap:
        m, i, a, b = heapq.heappop(heap)
        j = nxt[i]
        if j < 0 or syms[i] != a or syms[j] != b:
            continue
        merged = m % n
        syms[i], syms[j] = merged, -1
        k = nxt[i] = nxt[j]
        if k >= 0:
            prv[k] = i
            m = get(merged * n + syms[k])
            if m is not None:
                heapq.heappush(heap, (m, i, merged, syms[k]))
        p = prv[i]
        if p >= 0:
            m = get(syms[p] * n + merged)
            if m is not None:
                heapq.heappush(heap, (m, p, syms[p], merged))
    return [s for s in syms if s >= 0]


def _utf8(text: str) -> bytes:
    """UTF-8 of `text`; lone surrogates give back the byte surrogateescape took (U+DC80..DCFF)
    or their 3-byte form, so no str fails to encode."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return b"".join(c.encode("utf-8", "surrogateescape" if 0xDC80 <= ord(c) <= 0xDCFF
                                 else "surrogatepass") for c in text)


def _piece_to_bytes(piece: str) -> bytes:
    try:
        return piece.translate(_DECODE_TABLE).encode("latin-1")
    except UnicodeEncodeError:   # a char outside the byte table: take it as plain UTF-8
        return b"".join(c.translate(_DECODE_TABLE).encode("latin-1") if ord(c) in _DECODE_TABLE
                        else c.encode("utf-8") for c in piece)
