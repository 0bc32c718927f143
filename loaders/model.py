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


# -- values that cannot be ------------------------------------------------------------------------

_F16_EXP, _F32_EXP, _BF16_EXP = 0x7C00, 0x7F800000, 0x7F80   # all-ones exponent: Inf or NaN


def _nonfinite_in(w: Weight, rows: slice) -> bool:
    """Whether rows `rows` of `w` hold a NaN/Inf value (float types) or block scale (quantized:
    the fp16 scales every block multiplies by; MXFP4's E8M0 exponent 0xFF)."""
    raw = np.ascontiguousarray(w.data[rows]).reshape(-1)
    q = w.qtype
    if q.name == "F32":
        return bool(((raw.view("<u4") & _F32_EXP) == _F32_EXP).any())
    if q.name == "F16":
        return bool(((raw.view("<u2") & _F16_EXP) == _F16_EXP).any())
    if q.name == "BF16":
        return bool(((raw.view("<u2") & _BF16_EXP) == _BF16_EXP).any())
    blocks = raw.reshape(-1, q.block_bytes)
    if q.name == "MXFP4":
        return bool((blocks[:, 0] == 0xFF).any())
    for off in (q.d_offset, q.m_offset):
        if off is not None:
            d = np.ascontiguousarray(blocks[:, off:off + 2]).view("<u2")
            if ((d & _F16_EXP) == _F16_EXP).any():
                return True
    return False


def nonfinite_weights(model: LoadedModel, budget_s: float = 10.0) -> tuple[list[str], bool]:
    """Weights whose stored values (F32/F16/BF16) or block scales (quantized types; IQ1_M's
    scattered scale is not read) are NaN or Inf: where a model's NaN logits usually come from.
    -> (their names, whether every weight was read within `budget_s` seconds)."""
    import time
    t_end = time.monotonic() + budget_s
    found: list[str] = []
    for w in [*model.weights.values(), *model.aside.values()]:
        n = w.data.shape[0]
        step = max(1, (64 << 20) // max(1, w.data.shape[1] if w.data.ndim > 1 else 1))
        for r0 in range(0, n, step):
            if time.monotonic() > t_end:
                return found, False
            if _nonfinite_in(w, slice(r0, r0 + step)):
                found.append(w.name)
                break
    return found, True
