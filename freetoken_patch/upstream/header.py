"""GGUF headers read without gguf-py's per-value views: the runtime patch's reader, and the
source of the reader in pr_notes/1-gguf-header-reader (the builder copies `SHARED` from here into
FreeToken's `models/gguf/reader.py`, so the patch and the pull request run the same code).

gguf-py's `GGUFReader` makes a numpy memmap view for every value it meets: two per token and
per merge of a vocabulary, several million for a 248k-token model, and opening such a file takes
seconds to tens of seconds, in every process FreeToken starts. `_read_header` reads the same bytes
with `struct` and `numpy.frombuffer` and gives each value as gguf-py's `ReaderField.contents()`
does, so the metadata FreeToken sees does not change (tests/freetoken_patch/upstream/test_header.py
holds it to gguf-py on every value type and nesting, split sets and llama.cpp's vocabulary file).

The hook (`hooks.HOOKS`, "lean-gguf-header") rebinds `freetoken.models.gguf.reader._reader`,
which every header read of FreeToken 0.2.1 goes through (metadata, config, tensor index, split
sets, the tokenizer's metadata), to `reader`: an object with the parts of `GGUFReader` that
0.2.1 uses (`fields[...].contents()`, `tensors`, `data`). Each parse is timed (`PARSES`, and one
log line) so that `ftpatch freetoken doctor` can say what it saw.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import struct
import time
from typing import Any, NamedTuple

import numpy as np
from freetoken.models.gguf.reader import GgufTensorInfo

# the definitions the pull request's reader.py takes from this module (prbuild's `take`)
SHARED = ("_GGUF_SCALARS", "_GGUF_STRING", "_GGUF_ARRAY", "_HeaderBytes", "GgufHeader", "_read_header")

# -- shared with the pull request: these definitions are copied into FreeToken's reader.py -----

# GGUF metadata value types (ggml's gguf.md): the scalars as numpy dtypes, then string and array
_GGUF_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_GGUF_STRING = 8
_GGUF_ARRAY = 9


class _HeaderBytes:
    """A cursor over a GGUF file's bytes; every read is bounds-checked, so a corrupt length fails here instead of allocating."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise ValueError(f"{self.path}: GGUF header ends early ({n} bytes wanted at offset {start} of {len(self.buf)})")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def raw(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return self.buf[start : start + n]

    def scalars(self, vtype: int, n: int) -> np.ndarray:
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos}")
        dtype = np.dtype(_GGUF_SCALARS[vtype])
        return np.frombuffer(self.buf, dtype, n, self.take(n * dtype.itemsize))

    def strings(self, n: int) -> list[str]:
        # the hot loop (a vocabulary's tokens and merges): one unpack and one slice per string
        if n * 8 > len(self.buf) - self.pos:
            raise ValueError(f"{self.path}: GGUF header ends early (an array of {n} strings at offset {self.pos})")
        buf, pos, unpack, out = self.buf, self.pos, struct.Struct("<Q").unpack_from, []
        try:
            for _ in range(n):
                size = unpack(buf, pos)[0]
                out.append(str(buf[pos + 8 : pos + 8 + size], "utf-8"))
                pos += 8 + size
        except struct.error:
            pos = len(buf) + 1
        if pos > len(buf):
            raise ValueError(f"{self.path}: GGUF header ends early (inside an array of {n} strings at offset {self.pos})")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return str(self.raw(), "utf-8")
        if vtype != _GGUF_ARRAY:
            return self.scalars(vtype, 1).tolist()[0]
        etype, n = self.u32(), self.u64()
        if etype == _GGUF_STRING:
            return self.strings(n)
        if etype != _GGUF_ARRAY:
            return self.scalars(etype, n).tolist()
        # arrays of arrays come out flat, as gguf-py gives them: as strings if the first leaf
        # (found through first elements, none empty) is a string, else as numbers, where a
        # string stands for its bytes and a number in a string list for its raw bytes
        kind, leaves = self.leaves(_GGUF_ARRAY, n, 0)
        if kind == _GGUF_STRING:
            return [str(raw, "utf-8") for _, raw in leaves]
        return [v for t, raw in leaves for v in (raw if t == _GGUF_STRING else np.frombuffer(raw, _GGUF_SCALARS[t]).tolist())]

    def leaves(self, etype: int, n: int, depth: int) -> tuple[int, list[tuple[int, bytes]]]:
        """The (type, raw bytes) leaves of an array of ``n`` elements of ``etype``, and its first leaf's type."""
        if depth > 64:
            raise ValueError(f"{self.path}: GGUF arrays nested more than 64 deep at offset {self.pos}")
        if n * (12 if etype == _GGUF_ARRAY else 1) > len(self.buf) - self.pos:
            raise ValueError(f"{self.path}: GGUF header ends early (an array of {n} elements at offset {self.pos})")
        kind, out = (etype if n else _GGUF_ARRAY), []
        for i in range(n):
            if etype == _GGUF_ARRAY:
                sub_kind, sub = self.leaves(self.u32(), self.u64(), depth + 1)
                kind, out = (sub_kind if i == 0 else kind), out + sub
            elif etype == _GGUF_STRING:
                out.append((etype, self.raw()))
            else:
                start = self.pos
                self.scalars(etype, 1)
                out.append((etype, bytes(self.buf[start : self.pos])))
        return kind, out


class GgufHeader(NamedTuple):
    """One GGUF file's metadata (``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``, then every key in file order) and tensor table."""

    path: str
    metadata: dict[str, Any]
    tensors: tuple[GgufTensorInfo, ...]


def _read_header(path: str) -> GgufHeader:
    """Parse the header of the GGUF file ``path``; the tensor data is not read."""
    from freetoken.third_party.gguf.constants import GGML_QUANT_SIZES

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path}: not a GGUF file (shorter than a GGUF header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _HeaderBytes(buf, path)
            if buf[:4] != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
            cur.take(4)
            version = cur.u32()
            if version not in (2, 3):
                endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
                raise ValueError(f"{path}: GGUF version {version} is not supported{endian}")
            n_tensors, n_kv = cur.u64(), cur.u64()
            # a key/value takes at least 13 bytes and a tensor entry 24: more than the file holds is corruption
            if n_kv * 13 + n_tensors * 24 > len(buf):
                raise ValueError(f"{path}: GGUF header claims {n_kv} keys and {n_tensors} tensors, more than the file holds")
            metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
            for _ in range(n_kv):
                key = str(cur.raw(), "utf-8")
                vtype = cur.u32()
                if key in metadata:
                    raise ValueError(f"{path}: duplicate GGUF key {key!r}")
                metadata[key] = cur.value(vtype)
                if key == "general.alignment" and vtype != 4:
                    raise ValueError(f"{path}: general.alignment is not a uint32")
            alignment = metadata.get("general.alignment", 32)
            if alignment <= 0 or alignment & (alignment - 1):
                raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
            raw_tensors = []
            for _ in range(n_tensors):
                name = str(cur.raw(), "utf-8")
                n_dims = cur.u32()
                if n_dims > 4:
                    raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions (GGML_MAX_DIMS is 4)")
                ne = tuple(cur.scalars(10, n_dims).tolist())
                raw_tensors.append((name, ne, cur.u32(), cur.u64()))
            data_start = -(-cur.pos // alignment) * alignment
            size = len(buf)
    tensors, seen = [], set()
    for name, ne, ggml_type, offset in raw_tensors:
        if name in seen:
            raise ValueError(f"{path}: duplicate tensor {name!r}")
        seen.add(name)
        if ggml_type not in GGML_QUANT_SIZES:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}")
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if block > 1 and (not ne or ne[0] % block):
            raise ValueError(f"{path}: tensor {name!r} rows of {ne[:1]} are not whole blocks of {block}")
        nbytes = math.prod(ne) * type_size // block
        if data_start + offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (a truncated download?)")
        tensors.append(GgufTensorInfo(name, path, data_start + offset, nbytes, ggml_type, ne, path))
    return GgufHeader(path, metadata, tuple(tensors))


# -- the runtime patch: what FreeToken 0.2.1 reads of a GGUFReader, from `_read_header` --------

PARSES: list[tuple[str, float]] = []   # (path, seconds) of every header this process parsed


class _Field(NamedTuple):
    value: Any

    def contents(self) -> Any:
        return self.value


class _Tensor(NamedTuple):
    """The attributes of gguf-py's ReaderTensor that FreeToken 0.2.1 reads (`data` aside)."""

    name: str
    tensor_type: int
    shape: np.ndarray        # ggml order, uint64, as gguf-py gives it
    n_elements: int
    n_bytes: int
    data_offset: int


class HeaderReader:
    """A GGUF file's header in the shape of gguf-py's `GGUFReader` as 0.2.1 uses it: `fields`
    (name -> an object whose `contents()` is the value), `tensors`, and `data` (the file as a
    uint8 memmap, opened on first use: only tensor reads need it)."""

    def __init__(self, path: str):
        from freetoken.third_party.gguf import GGMLQuantizationType
        t0 = time.perf_counter()
        header = _read_header(path)
        seconds = time.perf_counter() - t0
        PARSES.append((str(path), seconds))
        _log(f"ftpatch: GGUF header of {path} read in {seconds:.2f} s "
             f"({len(header.metadata) - 3} keys, {len(header.tensors)} tensors)")
        self.path = path
        self.fields = {name: _Field(v) for name, v in header.metadata.items()}
        self.tensors = [_Tensor(t.name, GGMLQuantizationType(t.ggml_type),
                                np.array(t.ne, dtype=np.uint64), math.prod(t.ne), t.nbytes,
                                t.offset) for t in header.tensors]

    @functools.cached_property
    def data(self) -> np.memmap:
        return np.memmap(self.path, mode="r")


@functools.cache
def reader(model_path: str) -> HeaderReader:
    """The replacement of `freetoken.models.gguf.reader._reader` (cached per path, as it is)."""
    return HeaderReader(model_path)


def _log(line: str) -> None:
    try:
        from freetoken.utils.logger import init_logger
        init_logger(__name__).info(line)
    except Exception:   # a logger that cannot start must not stop a model from loading
        pass
