"""Test helpers: build GGUF bytes by hand (for broken files) and rewrite synthetic models."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from loaders import open_gguf
from loaders.gguf_file import VALUE_TYPE_NAMES

_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_BY_NAME = {v: k for k, v in VALUE_TYPE_NAMES.items()}


def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def pack_value(vtype: int, value: Any, sub: int | None = None) -> bytes:
    if vtype == 8:
        return _s(value)
    if vtype == 9:
        assert sub is not None
        if sub == 9:  # array of arrays: value = list of (subtype, list)
            return struct.pack("<IQ", 9, len(value)) + b"".join(pack_array(st, v) for st, v in value)
        return pack_array(sub, value)
    return struct.pack("<" + _FMT[vtype], value)


def pack_array(sub: int, values: Iterable[Any]) -> bytes:
    values = list(values)
    body = b"".join(_s(v) if sub == 8 else struct.pack("<" + _FMT[sub], v) for v in values)
    return struct.pack("<IQ", sub, len(values)) + body


def build_gguf(kv: list[tuple[str, int, Any, int | None]],
               tensors: list[tuple[str, tuple[int, ...], int, bytes]],
               version: int = 3, alignment: int = 32, offsets: list[int] | None = None) -> bytes:
    """GGUF bytes: kv = [(key, vtype, value, subtype)], tensors = [(name, ne, type_id, data)]."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, vt, val, sub in kv:
        head += _s(key) + struct.pack("<I", vt) + pack_value(vt, val, sub)
    offs, pos = [], 0
    for _, _, _, data in tensors:
        offs.append(pos)
        pos += -(-len(data) // alignment) * alignment
    offsets = offsets or offs
    for (name, ne, tid, _), off in zip(tensors, offsets):
        head += _s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        head += struct.pack("<IQ", tid, off)
    head += b"\0" * (-len(head) % alignment)
    body = b""
    for _, _, _, data in tensors:
        body += data + b"\0" * (-len(data) % alignment)
    return head + body


def rewrite(src: str | Path, dst: str | Path, *, drop: Iterable[str] = (),
            rename: dict[str, str] | None = None, metadata: dict[str, Any] | None = None,
            drop_keys: Iterable[str] = (), replace: dict[str, tuple[tuple[int, ...], int, bytes]] | None = None,
            add: dict[str, tuple[tuple[int, ...], int, bytes]] | None = None) -> Path:
    """Copy a GGUF with changes. metadata values: (vtype name, value[, subtype name]).

    replace/add: name -> (ne, type_id, raw bytes).
    """
    f = open_gguf(src)
    drop, drop_keys = set(drop), set(drop_keys)
    rename = rename or {}
    kv = []
    for key, val in f.metadata.items():
        if key in drop_keys or (metadata and key in metadata):
            continue
        vt = f.value_types[key]
        if vt == 9:
            if isinstance(val, list):
                sub = 8 if (val and isinstance(val[0], str)) or not val else 9
            else:
                sub = {v: k for k, v in _NP.items()}[np.dtype(val.dtype).type]
                val = val.tolist()
            kv.append((key, 9, val, sub))
        else:
            kv.append((key, vt, val, None))
    for key, spec in (metadata or {}).items():
        vt = _BY_NAME[spec[0]]
        sub = _BY_NAME[spec[2]] if len(spec) > 2 else None
        kv.append((key, vt, spec[1], sub))
    tensors = []
    for t in f:
        if t.name in drop:
            continue
        name = rename.get(t.name, t.name)
        if replace and t.name in replace:
            ne, tid, data = replace[t.name]
        else:
            ne, tid, data = t.ne, t.type_id, f.data(t.name).tobytes()
        tensors.append((name, ne, tid, data))
    for name, (ne, tid, data) in (add or {}).items():
        tensors.append((name, ne, tid, data))
    out = Path(dst)
    out.write_bytes(build_gguf(kv, tensors, alignment=f.alignment))
    return out


def fused_gate_up(src: str | Path) -> tuple[dict, list[str]]:
    """(add, drop) for `rewrite`: every layer's gate and up expert banks as one fused
    ffn_gate_up_exps tensor (per expert: gate rows first, then up), as --fuse-gate-up-exps writes."""
    f = open_gguf(src)
    add, drop = {}, []
    layers = sorted({int(t.name.split(".")[1]) for t in f if t.name.endswith("ffn_gate_exps.weight")})
    for i in layers:
        g, u = f.tensors[f"blk.{i}.ffn_gate_exps.weight"], f.tensors[f"blk.{i}.ffn_up_exps.weight"]
        E, Fe = g.ne[2], g.ne[1]
        fused = np.concatenate([f.data(g.name).reshape(E, Fe, -1), f.data(u.name).reshape(E, Fe, -1)], 1)
        add[f"blk.{i}.ffn_gate_up_exps.weight"] = ((g.ne[0], 2 * Fe, E), g.type_id, fused.tobytes())
        drop += [g.name, u.name]
    return add, drop


def poison(src: str | Path, dst: str | Path, tensor: str, *, row: int | None = None,
           value: float = float("nan")) -> Path:
    """A copy of a model whose `tensor` decodes to `value` (NaN or Inf): an F32/F16 tensor's every
    value (or one row's), or a quantized tensor's fp16 block scales (every block of one row, or
    of all rows)."""
    import shutil

    from loaders.quants import QUANT_TYPES
    shutil.copyfile(src, dst)
    f = open_gguf(dst)
    t = f.tensors[tensor]
    rows = f.data(tensor)
    row_bytes = rows.shape[1]
    first, n = (0, rows.shape[0]) if row is None else (row, 1)
    q = QUANT_TYPES[t.type_name]
    with open(dst, "r+b") as out:
        for r in range(first, first + n):
            base = t.offset + r * row_bytes
            if q.family == "float":
                dt = {"F32": np.float32, "F16": np.float16}[q.name]
                out.seek(base)
                out.write(np.full(row_bytes // np.dtype(dt).itemsize, value, dt).tobytes())
            else:
                for b in range(row_bytes // q.block_bytes):
                    out.seek(base + b * q.block_bytes + q.d_offset)
                    out.write(np.array([value], np.float16).tobytes())
    return Path(dst)


def ftpatch_cmd(*args: str) -> list[str]:
    """`python -P -m freetoken_patch.cli ARGS`: -P keeps the working folder (a source tree whose
    native/ holds no built extension, in CI) off the child's import path; with child_env() the
    child imports the packages the tests import."""
    import sys
    return [sys.executable, "-P", "-m", "freetoken_patch.cli", *args]


def child_env(**extra: str) -> dict:
    """os.environ with PYTHONPATH = this process's import path (and `extra`)."""
    import os
    import sys
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def tagged_vocab(tags: Iterable[str] = ("<tool_call>", "</tool_call>")):
    """The built-in vocabulary with `tags` appended as user-defined tokens of their own, as
    Qwen3.5's GGUF vocabulary has <tool_call> and </tool_call> (the tests' copy of llama.cpp's
    Qwen3.5 vocabulary keeps only its regular tokens)."""
    from dataclasses import replace
    from loaders.vocab import USER_DEFINED, builtin_vocab
    v, tags = builtin_vocab(), list(tags)
    return replace(v, tokens=v.tokens + tags, token_types=np.concatenate(
        [v.token_types, [USER_DEFINED] * len(tags)]).astype(np.int32))


def write_vocab(path: str | Path, vocab) -> Path:
    """A vocabulary-only GGUF of `vocab` (what `ftpatch synth --vocab` copies a tokenizer from)."""
    from loaders.vocab import vocab_metadata
    kv = []
    for key, val in vocab_metadata(vocab).items():
        if isinstance(val, str):
            kv.append((key, 8, val, None))
        elif isinstance(val, np.ndarray):
            kv.append((key, 9, val.astype(np.int32).tolist(), 5))
        elif isinstance(val, list):
            kv.append((key, 9, val, 8))
        else:
            kv.append((key, 4, int(val), None))
    Path(path).write_bytes(build_gguf(kv, []))
    return Path(path)
