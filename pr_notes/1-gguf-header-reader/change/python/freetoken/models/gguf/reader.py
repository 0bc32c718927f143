"""Shared GGUF access helpers: detection, metadata, and tensor enumeration.

The header is parsed here, with ``struct`` and ``numpy.frombuffer``: gguf-py's ``GGUFReader``
makes a numpy view for every value it meets, two per vocabulary token and merge, which is
millions for a 250k-token vocabulary and took tens of seconds in each FreeToken process.
Metadata is read into a plain dict keyed by the GGUF field name (``general.architecture``,
``gemma4.block_count`` ...), every value as gguf-py's ``ReaderField.contents()`` gives it;
tensors are indexed as ``GgufTensorInfo`` records (ggml dims, ggml type, and where the packed
bytes sit in the memory-mapped file). ``write_metadata_gguf`` keeps gguf-py for the byte
offsets it copies.
"""

import math
import mmap
from typing import NamedTuple


def _field_value(header, name: str) -> Any:
    return header.metadata.get(name)


@functools.cache
def _reader(model_path: str) -> GgufHeader:
    return _read_header(model_path)


@functools.cache
def _data(path: str) -> np.memmap:
    """The whole file as a read-only uint8 memmap; tensor bytes are slices of it."""
    return np.memmap(path, mode="r")


@functools.cache
def load_gguf_metadata(model_path: str) -> dict[str, Any]:
    """All GGUF KV metadata as ``{field_name: python_value}`` (arrays -> lists)."""
    return dict(_reader(model_path).metadata)


@functools.cache
def gguf_tensor_index(model_path: str) -> dict[str, GgufTensorInfo]:
    """Every tensor of every split, by name."""
    index: dict[str, GgufTensorInfo] = {}
    for path in gguf_split_paths(model_path):
        for t in _reader(path).tensors:
            index[t.name] = GgufTensorInfo(t.name, path, t.offset, t.nbytes, t.ggml_type, t.ne, model_path)
    return index
