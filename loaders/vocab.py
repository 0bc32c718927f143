"""Vocabulary tables as GGUF stores them (`tokenizer.ggml.*`): read, pad, and the built-in one.

The built-in vocabulary lets the embedded default model (and CI) run with no downloads: the 256
byte-level tokens, merges learned from a small corpus that ships with the package, and the
ChatML special tokens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .errors import GGUFError

# token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@dataclass(frozen=True)
class VocabSpec:
    tokens: list[str]
    token_types: np.ndarray          # int32 per token
    merges: list[str]                # "a b", rank = index
    pre: str | None = "qwen35"       # None: the file names no pre-tokenizer
    model: str = "gpt2"
    eos_id: int | None = None
    pad_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None
    extra_ids: dict[str, int] = field(default_factory=dict)  # other tokenizer.ggml.*_token_id
    where: str = "the vocabulary"    # the file it came from, for messages

    def __len__(self) -> int:
        return len(self.tokens)

    def padded(self, n_vocab: int) -> "VocabSpec":
        """The same vocabulary padded with `[PAD{id}]` unused tokens to `n_vocab` entries."""
        n = len(self.tokens)
        if n_vocab < n:
            raise GGUFError(f"{self.where}: the vocabulary of {n:,} tokens does not fit a model "
                            f"with {n_vocab:,} embedding rows")
        if n_vocab == n:
            return self
        tokens = self.tokens + [f"[PAD{i}]" for i in range(n, n_vocab)]
        types = np.concatenate([self.token_types, np.full(n_vocab - n, UNUSED, np.int32)])
        return replace(self, tokens=tokens, token_types=types)


def _kind(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of {v.dtype}"
    if isinstance(v, list):
        return "an array of arrays" if v and not isinstance(v[0], str) else "an array of strings"
    return f"a {type(v).__name__}"


def _str_list(md: Mapping[str, Any], key: str, where: str) -> list[str] | None:
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or (v and not isinstance(v[0], str)):
        raise GGUFError(f"{where}: {key} is {_kind(v)}, expected an array of strings")
    return v


def _numbers(md: Mapping[str, Any], key: str, where: str, n: int, kinds: str) -> np.ndarray | None:
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, np.ndarray) or v.dtype.kind not in kinds:
        raise GGUFError(f"{where}: {key} is {_kind(v)}, expected an array of numbers")
    if len(v) != n:
        raise GGUFError(f"{where}: {key} has {len(v):,} entries but tokenizer.ggml.tokens has "
                        f"{n:,}; the file's tokenizer is damaged")
    return v


def _text(md: Mapping[str, Any], key: str, where: str, default: str | None) -> str | None:
    v = md.get(key, default)
    if v is not None and not isinstance(v, str):
        raise GGUFError(f"{where}: {key} is {_kind(v)}, expected a string")
    return v


def vocab_from_metadata(md: Mapping[str, Any], where: str = "model") -> VocabSpec:
    """The tokenizer tables of a GGUF's metadata; a clear error when they are absent or do not
    agree (types and lengths are checked here, so a Tokenizer can trust them)."""
    tokens = _str_list(md, "tokenizer.ggml.tokens", where)
    if tokens is None:
        raise GGUFError(f"{where} has no tokenizer (no tokenizer.ggml.tokens), so it cannot read "
                        "text; give token ids instead where the command takes --tokens")
    if not tokens:
        raise GGUFError(f"{where}: tokenizer.ggml.tokens is empty")
    n = len(tokens)
    model = _text(md, "tokenizer.ggml.model", where, "gpt2")
    types = _numbers(md, "tokenizer.ggml.token_type", where, n, "iu")
    types = np.full(n, NORMAL, np.int32) if types is None else types.astype(np.int32)
    _numbers(md, "tokenizer.ggml.scores", where, n, "iuf")
    merges = _str_list(md, "tokenizer.ggml.merges", where) or []
    ids = {}
    for k, v in md.items():
        if k.startswith("tokenizer.ggml.") and k.endswith("_token_id"):
            if not isinstance(v, int) or isinstance(v, bool):
                raise GGUFError(f"{where}: {k} is {_kind(v)}, expected a token id")
            if 0 <= v < n:   # as llama.cpp: an id outside the vocabulary is ignored
                ids[k[len("tokenizer.ggml."):-len("_token_id")]] = v
    return VocabSpec(
        tokens=list(tokens), token_types=types, merges=list(merges),
        pre=_text(md, "tokenizer.ggml.pre", where, None), model=model,
        eos_id=ids.pop("eos", None), pad_id=ids.pop("padding", None), bos_id=ids.pop("bos", None),
        chat_template=md.get("tokenizer.chat_template"), extra_ids=ids, where=where)


def read_vocab(path: str | Path) -> VocabSpec:
    from .gguf_file import open_gguf
    f = open_gguf(path)
    return vocab_from_metadata(f.metadata, str(f.path))


def vocab_metadata(v: VocabSpec) -> dict[str, Any]:
    """The `tokenizer.*` keys to write for `v` (values as Python/numpy objects)."""
    md: dict[str, Any] = {"tokenizer.ggml.model": v.model, "tokenizer.ggml.pre": v.pre,
                          "tokenizer.ggml.tokens": v.tokens,
                          "tokenizer.ggml.token_type": np.asarray(v.token_types, np.int32),
                          "tokenizer.ggml.merges": v.merges}
    if v.pre is None:
        del md["tokenizer.ggml.pre"]
    for key, val in (("eos", v.eos_id), ("padding", v.pad_id), ("bos", v.bos_id),
                     *v.extra_ids.items()):
        if val is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = int(val)
    if v.chat_template:
        md["tokenizer.chat_template"] = v.chat_template
    return md


# -- the built-in vocabulary ------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BUILTIN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BUILTIN_USER_DEFINED = ("<think>", "</think>")
_CORPUS = Path(__file__).with_name("data") / "corpus.txt"


@functools.cache
def builtin_vocab(n_merges: int = 1500) -> VocabSpec:
    """Byte tokens + merges learned from the packaged corpus + ChatML specials."""
    from .bpe_train import train_byte_bpe  # deferred: only synth needs it
    b2u = bytes_to_unicode()
    text = _CORPUS.read_text(encoding="utf-8") if _CORPUS.exists() else ""
    merges = train_byte_bpe(text, n_merges) if text else []
    tokens = [b2u[b] for b in range(256)] + ["".join(m.split(" ")) for m in merges]
    specials = list(BUILTIN_SPECIALS) + list(BUILTIN_USER_DEFINED)
    types = [NORMAL] * len(tokens) + [CONTROL] * len(BUILTIN_SPECIALS) + \
        [USER_DEFINED] * len(BUILTIN_USER_DEFINED)
    base = len(tokens)
    return VocabSpec(tokens=tokens + specials, token_types=np.asarray(types, np.int32),
                     merges=merges, pre="qwen35", eos_id=base + 2, pad_id=base,
                     chat_template=CHATML_TEMPLATE, where="the built-in vocabulary")
