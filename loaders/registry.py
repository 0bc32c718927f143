"""The architecture registry: one place that knows which `general.architecture` values we run.

An architecture contributes a config parser (metadata -> frozen dataclass) and a tensor schema
(GGUF names -> expected shapes, per layer kind). Unknown names fail listing what exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import GGUFError


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the architecture expects. `shape` is torch order ([out, in] for a linear)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]  # accepted shapes (e.g. [H] or [1, H])
    role: str                            # embed | output | norm | attn | ssm | router | experts | shared_expert
    matrix: bool = True                  # 2-D+ weight: any quant type; else a float vector
    group: str | None = None             # alternatives: exactly one group of a slot must be present
    slot: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0]


@dataclass(frozen=True)
class Architecture:
    name: str
    parse_config: Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]]], Any]
    tensor_schema: Callable[[Any], list[TensorSpec]]
    extra_prefixes: Callable[[Any], tuple[str, ...]]  # names kept aside (e.g. the MTP block)
    mtp_schema: Callable[[Any], list[TensorSpec]] | None = None  # the MTP block, when runnable


_ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    if arch.name in _ARCHITECTURES:
        raise ValueError(f"architecture {arch.name!r} registered twice")
    _ARCHITECTURES[arch.name] = arch
    return arch


def supported_architectures() -> list[str]:
    _load_builtin()
    return sorted(_ARCHITECTURES)


def get_architecture(name: str | None) -> Architecture:
    _load_builtin()
    arch = _ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise GGUFError(f"unsupported architecture {name!r}; supported: "
                        f"{', '.join(sorted(_ARCHITECTURES))}")
    return arch


def _load_builtin() -> None:
    from .archs import qwen35moe  # noqa: F401  (registers itself)
