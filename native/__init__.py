"""native: quantized math (C++ CPU and CUDA kernels) behind one Python API, `native.ops`.

Public names (imported lazily, so `import native.errors` does not load torch):
    ops                   the module: dequantize, matmul, moe_ffn, supported_types, QTensor
    QTensor               raw ggml blocks of a weight on one device
    dequantize, matmul, moe_ffn, supported_types
    NativeError           the package's exception
"""
from __future__ import annotations

import importlib

from .errors import NativeError

__all__ = ["ops", "QTensor", "dequantize", "matmul", "moe_ffn", "supported_types", "NativeError"]


def __getattr__(name: str):
    if name == "ops":
        return importlib.import_module(".ops", __name__)
    if name in __all__:
        return getattr(importlib.import_module(".ops", __name__), name)
    raise AttributeError(f"module 'native' has no attribute {name!r}")
