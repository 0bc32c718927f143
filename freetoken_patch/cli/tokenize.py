"""`ftpatch tokenize MODEL TEXT`: how a model's tokenizer splits a text, one token per line."""
from __future__ import annotations

import argparse
import json

from .inputs import read_stdin

DESCRIPTION = """\
Tokenize TEXT with the tokenizer stored in MODEL (byte-level BPE from tokenizer.ggml.*) and
print one token per line: its id and the repr of its piece. A piece that is not whole UTF-8
(part of a multi-byte character) is shown as bytes. Input bytes that are not UTF-8 are
tokenized as the bytes they are.
"""

EPILOG = """\
examples:
  ftpatch tokenize model.gguf "Hello, world"
  ftpatch tokenize model.gguf "<|im_start|>user" --special
  echo "from stdin" | ftpatch tokenize model.gguf - --json
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenize` on the CLI's subparsers."""
    s = subparsers.add_parser("tokenize", help="show the token ids and pieces of a text",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", help="GGUF file, any shard of a split set, or a folder")
    s.add_argument("text", help="the text to tokenize ('-' reads standard input)")
    s.add_argument("--special", action="store_true",
                   help="read special-token text such as <|im_end|> as that one token, and add "
                        "BOS/EOS where the model asks for them")
    s.add_argument("--json", action="store_true",
                   help='print one JSON object: {"ids": [...], "pieces": [...], ...}; pieces '
                        "that are not whole UTF-8 carry \\xNN escapes")


def run(args: argparse.Namespace) -> int:
    """Tokenize and print; errors surface as GGUFError (the CLI prints one line)."""
    from loaders.tokenizer import Tokenizer
    text = read_stdin() if args.text == "-" else args.text
    tok = Tokenizer.from_gguf(args.model)
    ids = tok.encode(text, add_special=args.special, parse_special=args.special)
    raw = [tok.token_bytes(i) for i in ids]
    if args.json:
        print(json.dumps({"model": str(args.model), "n_tokens": len(ids), "ids": ids,
                          "pieces": [b.decode("utf-8", errors="backslashreplace") for b in raw]},
                         ensure_ascii=False))
        return 0
    width = len(str(len(tok) - 1))
    for i, b in zip(ids, raw):
        print(f"{i:>{width}}  {_shown(b)}")
    return 0


def _shown(piece: bytes) -> str:
    try:
        return repr(piece.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(piece)


COMMANDS = {"tokenize": (add_parser, run)}
