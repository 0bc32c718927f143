"""Routing profiles for FreeToken's `--moe-cache-split profile:<path>`, written from the routing
our runtime recorded (`ftpatch bench --save-profile`: per layer, how often each expert was
chosen). FreeToken reads `{"model": name, "expert_counts": [L][E]}`, each row normalised on
load, and warns when `model` is not the start of a component of its `--model` path."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loaders.gguf_file import SPLIT_RE

from ..errors import CLIError


def read_routing(path: str | Path) -> tuple[np.ndarray, str]:
    """[L, E] choice counts and the model name from one of our routing profiles."""
    try:
        d = json.loads(Path(path).read_text())
        counts = np.asarray(d["counts"], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CLIError(f"{path}: not a routing profile of ours ({exc}); write one with "
                       "`ftpatch bench --save-profile`") from None
    if counts.ndim != 2 or (counts < 0).any():
        raise CLIError(f"{path}: counts must be [layers][experts] of non-negative integers")
    return counts, str(d.get("model") or "")


def model_name(model_path: str | Path) -> str:
    """The name FreeToken's check expects: the GGUF's stem without its split suffix."""
    name = Path(model_path).name
    m = SPLIT_RE.match(name)
    return m.group("stem") if m else name.removesuffix(".gguf")


def write_profile(counts: np.ndarray, out: str | Path, model: str = "") -> Path:
    """Write `counts` [L, E] (layers in FreeToken's MoE-layer order) as a FreeToken profile."""
    counts = np.asarray(counts)
    if counts.ndim != 2:
        raise CLIError(f"routing counts must be [layers][experts], got shape {counts.shape}")
    out = Path(out)
    out.write_text(json.dumps({"model": model, "expert_counts": counts.astype(int).tolist()}))
    return out


def convert(ours: str | Path, out: str | Path, model: str | None = None) -> Path:
    """One of our routing profiles -> FreeToken's format; `model` overrides the recorded name."""
    counts, recorded = read_routing(ours)
    return write_profile(counts, out, recorded if model is None else model)
