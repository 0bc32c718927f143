"""A validated model: GGUF file + architecture config + weight handles keyed by GGUF name."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import GGUFError
from .gguf_file import GGUFFile, TensorInfo, open_gguf
from .quants import QUANT_TYPES, QuantType
from .registry import Architecture, TensorSpec, get_architecture


@dataclass(frozen=True)
class Weight:
    """A tensor's raw blocks, zero-copy from the file. The quant type travels with the handle."""

    name: str
    qtype: QuantType
    shape: tuple[int, ...]   # torch order: [..., rows, cols]; cols (last) holds the blocks
    data: np.ndarray         # uint8 [n_rows_total, row_bytes], memory-mapped

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


@dataclass
class LoadedModel:
    """What `open_model` returns: everything known about the file before any math happens."""

    file: GGUFFile
    arch: Architecture
    config: Any
    weights: dict[str, Weight]            # trunk tensors the architecture runs
    aside: dict[str, Weight]              # recognised but not run (MTP block)
    extras: list[TensorInfo]              # in the file, unknown to the schema
    problems: list[str] = field(default_factory=list)  # why it cannot run (empty: it can)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata

    def __getitem__(self, name: str) -> Weight:
        w = self.weights.get(name)
        if w is None:
            raise GGUFError(f"{self.file.path}: model has no tensor {name!r}")
        return w

    def get(self, name: str) -> Weight | None:
        return self.weights.get(name)


def _weight(f: GGUFFile, t: TensorInfo) -> Weight:
    return Weight(t.name, QUANT_TYPES[t.type_name], t.shape, f.data(t.name))


def _check(spec: TensorSpec, t: TensorInfo) -> str | None:
    if t.shape not in spec.shapes:
        want = " or ".join(_fmt_shape(s) for s in spec.shapes)
        return (f"tensor {t.name!r} has shape {_fmt_shape(t.shape)}, expected {want} "
                "from the metadata; the file's metadata and tensors disagree")
    q = QUANT_TYPES.get(t.type_name)
    if q is None:
        return (f"tensor {t.name!r} has type {t.type_name}, which ftpatch does not run; "
                f"re-quantize it to one of {', '.join(QUANT_TYPES)}")
    if not spec.matrix and q.family != "float":
        return f"tensor {t.name!r} is a vector stored as {t.type_name}; expected F32, F16 or BF16"
    return None


def open_model(path: str | os.PathLike, *, strict: bool = True) -> LoadedModel:
    """Parse and validate a model. With strict=False, problems are listed instead of raised."""
    f = open_gguf(path)
    name = f.get("general.architecture")
    if name is None:
        raise GGUFError(f"{f.path}: metadata key 'general.architecture' is missing, so the "
                        "model's kind is unknown; the file is damaged or not a model (a "
                        "vocabulary-only GGUF?)")
    if not isinstance(name, str):
        raise GGUFError(f"{f.path}: general.architecture is not text ({type(name).__name__}); "
                        "the file is damaged")
    shapes = {t.name: t.shape for t in f}
    try:
        arch = get_architecture(name)
        config = arch.parse_config(f.metadata, shapes)
    except GGUFError as e:   # the parsers do not know the file: name it here
        raise type(e)(f"{f.path}: {e}") from None
    problems: list[str] = []
    tokens = f.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > config.n_vocab:
        problems.append(f"tokenizer.ggml.tokens has {len(tokens):,} tokens but "
                        f"'token_embd.weight' has {config.n_vocab:,} rows; ids past the rows "
                        "would have no embedding")
    weights: dict[str, Weight] = {}
    slots: dict[str, dict[str, list[TensorSpec]]] = {}
    for spec in arch.tensor_schema(config):
        if spec.slot is not None:
            slots.setdefault(spec.slot, {}).setdefault(spec.group or "", []).append(spec)
            continue
        t = f.tensors.get(spec.name)
        if t is None:
            problems.append(f"tensor {spec.name!r} is missing (expected shape "
                            f"{_fmt_shape(spec.shape)}); the file is incomplete or not {arch.name}")
        elif (err := _check(spec, t)) is None:
            weights[t.name] = _weight(f, t)
        else:
            problems.append(err)
    for slot, groups in slots.items():
        present = [g for g, specs in groups.items() if all(s.name in f.tensors for s in specs)]
        if not present:
            names = " or ".join("+".join(s.name for s in specs) for specs in groups.values())
            problems.append(f"tensors {names} are missing; the file is incomplete")
            continue
        chosen = "fused" if "fused" in present else present[0]
        for spec in groups[chosen]:
            t = f.tensors[spec.name]
            if (err := _check(spec, t)) is None:
                weights[t.name] = _weight(f, t)
            else:
                problems.append(err)
    aside_prefix = arch.extra_prefixes(config)
    aside, extras = {}, []
    for t in f:
        if t.name in weights:
            continue
        if aside_prefix and t.name.startswith(aside_prefix) and t.type_name in QUANT_TYPES:
            aside[t.name] = _weight(f, t)
        elif not any(t.name in (s.name for s in g) for gs in slots.values() for g in gs.values()):
            extras.append(t)
    if strict and problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise GGUFError(f"{f.path}: {problems[0]}{more}")
    return LoadedModel(f, arch, config, weights, aside, extras, problems)


def mtp_weights(model: LoadedModel) -> dict[str, Weight]:
    """The first MTP / NextN block's weights (kept aside by open_model), checked against the
    architecture's MTP schema: {} when the file has none; GGUFError naming the first problem
    when it has a broken one. Optional NextN tensors are included when present."""
    schema = model.arch.mtp_schema
    if schema is None or not getattr(model.config, "n_nextn", 0):
        return {}
    specs = schema(model.config)
    prefix = specs[0].name[:specs[0].name.index(".", 4) + 1]     # "blk.N."
    found = {n: w for n, w in model.aside.items() if n.startswith(prefix)}
    tensors = model.file.tensors
    out, slots = {}, {}
    for spec in specs:
        if spec.slot is not None:
            slots.setdefault(spec.slot, {}).setdefault(spec.group or "", []).append(spec)
            continue
        if spec.name not in found:
            if spec.name.endswith("nextn.shared_head_norm.weight"):   # optional
                continue
            raise GGUFError(f"{model.file.path}: MTP tensor {spec.name!r} is missing")
        if (err := _check(spec, tensors[spec.name])) is not None:
            raise GGUFError(f"{model.file.path}: {err}")
        out[spec.name] = found[spec.name]
    for groups in slots.values():
        present = [g for g, ss in groups.items() if all(s.name in found for s in ss)]
        if not present:
            names = " or ".join("+".join(s.name for s in ss) for ss in groups.values())
            raise GGUFError(f"{model.file.path}: MTP tensors {names} are missing")
        for s in groups["fused" if "fused" in present else present[0]]:
            if (err := _check(s, tensors[s.name])) is not None:
                raise GGUFError(f"{model.file.path}: {err}")
            out[s.name] = found[s.name]
    H, V = model.config.n_embd, model.config.n_vocab
    for suffix in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"):
        name = prefix + suffix
        if name in found:
            if (err := _check(TensorSpec(name, ((V, H),), "embed"), tensors[name])) is not None:
                raise GGUFError(f"{model.file.path}: {err}")
            out[name] = found[name]
    return out
