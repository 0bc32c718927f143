"""`--model` as a person gives it: any shard of a split GGUF set, or the folder holding one model.

FreeToken reads a split set from its first shard (the metadata is there) and a folder only as a
Hugging Face or FTW checkpoint. This rewrites the argument to the first shard before FreeToken's
parser sees it, using our GGUF loader's resolution; everything else passes untouched."""
from __future__ import annotations

import os
from pathlib import Path

from loaders import GGUFError
from loaders.gguf_file import SPLIT_RE, split_paths

from . import hooks

MODEL_FLAGS = ("--model", "--model-path")


def _checkpoint_folder(p: Path) -> bool:
    # a Hugging Face snapshot or a FreeToken FTW folder: FreeToken's to read, not ours
    return any((p / name).is_file() for name in ("config.json", "freetoken_weight.json",
                                                 "source_metadata.gguf"))


def resolve_model_path(value: str) -> str:
    """The path FreeToken should be given for `value` (unchanged unless it is a GGUF shard or
    a folder of GGUF files)."""
    p = Path(os.path.expanduser(value))
    if p.is_dir():
        # a multimodal projector (mmproj-*.gguf, FreeToken's --mmproj) often sits beside the model
        models = sorted(x for x in p.glob("*.gguf") if not x.name.startswith("mmproj"))
        if _checkpoint_folder(p) or not models:
            return value
        names = {m.group("stem") if (m := SPLIT_RE.match(x.name)) else x.name for x in models}
        if len(names) > 1:
            raise GGUFError(f"{p}: folder holds more than one model ({', '.join(sorted(names))}); "
                            "name the file")
        p = models[0]
    elif not (p.is_file() and SPLIT_RE.match(p.name)):
        return value
    return str(split_paths(p)[0])


def rewrite_argv(argv: list[str]) -> list[str]:
    """argv with the --model / --model-path value resolved (both spellings, `=` or not)."""
    out = list(argv)
    for i, a in enumerate(out):
        for flag in MODEL_FLAGS:
            if a == flag and i + 1 < len(out):
                out[i + 1] = resolve_model_path(out[i + 1])
            elif a.startswith(flag + "="):
                out[i] = f"{flag}={resolve_model_path(a[len(flag) + 1:])}"
    return out


def parse_args(args, run_shell: bool = False, prog: str | None = None):
    """FreeToken's `server.args.parse_args`, after resolving the model path."""
    try:
        args = rewrite_argv(list(args))
    except GGUFError as e:
        raise SystemExit(f"{prog or 'ft serve'}: error: {e}") from None
    return hooks.original("freetoken.server.args", "parse_args")(args, run_shell, prog=prog)
