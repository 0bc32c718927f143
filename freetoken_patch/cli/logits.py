"""`ftpatch logits`: run a model over a prompt on one device and save the logits of every
position."""
from __future__ import annotations

import argparse

from ..errors import CLIError
from .model_args import (add_model_args, check_fits, check_memory, kv_type_for, nonfinite_error,
                         open_model_named, parse_device)

DESCRIPTION = """\
Run MODEL over a prompt and save the logits of every position: float32 [n_tokens, n_vocab],
row i = the next-token logits after token i, as a numpy .npy file written at exactly the path
given.
"""

EPILOG = """\
examples:
  ftpatch logits model.gguf --prompt "The capital of France is" --out logits.npy
  ftpatch logits model.gguf --tokens 9707,11,1879 --out logits.npy --device cuda
"""


def add_parser(sub) -> None:
    s = sub.add_parser("logits", help="save the logits of every prompt position (.npy)",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="text, tokenized by the model's tokenizer")
    src.add_argument("--tokens", metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    s.add_argument("--out", required=True, metavar="FILE.npy", help="where to write the logits")


def _parse_ids(text: str, n_vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise CLIError(f"--tokens {text!r}: write token ids as integers separated by commas, "
                       "e.g. --tokens 1,2,3") from None
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        raise CLIError(f"--tokens: id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    return ids


def check_out(path: str) -> None:
    """--out must name a file in a folder that exists (checked before the model runs)."""
    import os
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"--out {path} is a folder; give a file name, e.g. {os.path.join(path, 'logits.npy')}")
    if not os.path.isdir(folder):
        raise CLIError(f"--out {path}: the folder {folder} does not exist; create it first")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from loaders.tokenizer import Tokenizer
    from moe_offload import build_model
    device = parse_device(args.device)
    check_out(args.out)
    loaded = open_model_named(args.model)
    c = loaded.config
    if args.tokens is not None:
        ids = _parse_ids(args.tokens, c.n_vocab)
    else:
        tok = Tokenizer.from_metadata(loaded.metadata, str(args.model))
        ids = tok.encode(args.prompt, add_special=True, parse_special=True)
    n_ctx = check_fits(ids, args, c.n_ctx_train)
    kv = kv_type_for(args, loaded, n_ctx)
    check_memory(loaded, device, n_ctx, logits_rows=2 * len(ids), kv_type=kv)  # logits + copy
    model = build_model(loaded, device)
    with torch.inference_mode():
        logits = model.prefill(torch.tensor([ids], device=device), model.new_state(1, n_ctx, kv),
                               all_logits=True)[0]
    out = logits.float().cpu().numpy()
    bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
    if bad.size:
        raise nonfinite_error(loaded, int(bad[0]))
    with open(args.out, "wb") as f:    # np.save(path) would add .npy to a name without it
        np.save(f, out)
    print(f"wrote logits float32 [{out.shape[0]}, {out.shape[1]}] to {args.out}")
    return 0


COMMANDS = {"logits": (add_parser, run)}
