"""Pre-tokenizers of byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.

A pre-tokenizer splits text into words before BPE runs on each word alone. GGUF files do not
store the split pattern, only a name; the patterns below are the ones llama.cpp runs for those
names (its case-sensitive rewrites of the `(?i:'s|...)` contraction group in tokenizer.json).
This is the one place that maps names to patterns.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import GGUFError

# Qwen3.5: letter runs absorb combining marks, digits one by one.
QWEN35_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2/Qwen3: as qwen35 but letters only (a combining mark starts a punctuation word).
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3: as qwen2 but digits in groups of up to three.
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` name tokenizes: its split and llama.cpp's defaults for it."""

    name: str
    pattern: str                 # for the `regex` module (\p{..} classes)
    add_bos: bool = False        # default when the file has no tokenizer.ggml.add_bos_token
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)


PRETOKENIZERS: dict[str, PreTokenizer] = {p.name: p for p in (
    PreTokenizer("qwen35", QWEN35_SPLIT),
    PreTokenizer("qwen2", QWEN2_SPLIT),
    PreTokenizer("llama-bpe", LLAMA3_SPLIT, add_bos=True, ignore_merges=True),
)}

# Other names converters write for the same behaviour.
_ALIASES = {"deepseek-r1-qwen": "qwen2", "llama3": "llama-bpe", "llama-v3": "llama-bpe"}


def get_pretokenizer(name: str | None, where: str = "") -> PreTokenizer:
    """The pre-tokenizer registered as `name` (or an alias); GGUFError listing supported ones.
    name=None: the file names none (`tokenizer.ggml.pre` is missing). `where` (the file) starts
    the message when given."""
    at = f"{where}: " if where else ""
    names = ", ".join(sorted(PRETOKENIZERS) + sorted(_ALIASES))
    if name is None:
        # llama.cpp falls back to a generic split here and warns that quality suffers; a wrong
        # split gives wrong ids for most text, so this is an error
        raise GGUFError(f"{at}tokenizer.ggml.pre is missing, so the pre-tokenizer (how text is "
                        f"split before BPE) is unknown; the file was probably converted by an "
                        f"old converter: convert it again with a current llama.cpp "
                        f"(supported: {names})")
    found = PRETOKENIZERS.get(_ALIASES.get(name, name))
    if found is None:
        raise GGUFError(f"{at}unsupported pre-tokenizer tokenizer.ggml.pre = {name!r}; "
                        f"supported: {names}")
    return found
