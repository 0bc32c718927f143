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
    pre: str = "qwen35"
    model: str = "gpt2"
    eos_id: int | None = None
    pad_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None
    extra_ids: dict[str, int] = field(default_factory=dict)  # other tokenizer.ggml.*_token_id

    def __len__(self) -> int:
        return len(self.tokens)

    def padded(self, n_vocab: int) -> "VocabSpec":
        """The same vocabulary padded with `[PAD{id}]` unused tokens to `n_vocab` entries."""
        n = len(self.tokens)
        if n_vocab < n:
            raise GGUFError(f"vocabulary of {n} tokens does not fit a model with {n_vocab} rows")
        if n_vocab == n:
            return self
        tokens = self.tokens + [f"[PAD{i}]" for i in range(n, n_vocab)]
        types = np.concatenate([self.token_types, np.full(n_vocab - n, UNUSED, np.int32)])
        return replace(self, tokens=tokens, token_types=types)


def vocab_from_metadata(md: Mapping[str, Any], where: str = "model") -> VocabSpec:
    """The tokenizer tables of a GGUF's metadata; a clear error when they are absent."""
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError(f"{where} has no tokenizer (no tokenizer.ggml.tokens), so it cannot read "
                        "text; give token ids instead where the command takes --tokens")
    model = md.get("tokenizer.ggml.model", "gpt2")
    types = md.get("tokenizer.ggml.token_type")
    types = np.full(len(tokens), NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    ids = {k[len("tokenizer.ggml."):-len("_token_id")]: int(v) for k, v in md.items()
           if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    return VocabSpec(
        tokens=list(tokens), token_types=types, merges=list(md.get("tokenizer.ggml.merges", [])),
        pre=md.get("tokenizer.ggml.pre", "default"), model=model,
        eos_id=ids.pop("eos", None), pad_id=ids.pop("padding", None), bos_id=ids.pop("bos", None),
        chat_template=md.get("tokenizer.chat_template"), extra_ids=ids)


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
                     chat_template=CHATML_TEMPLATE)
