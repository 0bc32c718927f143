"""loaders: bytes on disk -> a described, validated model. No math, no torch.

Public names:
  GGUFError                      the package's exception (message says what, where, fix)
  GGUFFile, TensorInfo, open_gguf  header/metadata/tensor directory, zero-copy tensor bytes
  QuantType, QUANT_TYPES, quant_type, dequantize_reference, random_blocks  the ggml type table
  Architecture, TensorSpec, get_architecture, supported_architectures  the architecture registry
  LoadedModel, Weight, open_model  a validated model
"""
from .errors import GGUFError
from .gguf_file import GGUFFile, TensorInfo, open_gguf
from .model import LoadedModel, Weight, open_model
from .quants import (QUANT_TYPES, QuantType, dequantize_reference, quant_type, random_blocks,
                     random_tensor)
from .registry import Architecture, TensorSpec, get_architecture, supported_architectures

__all__ = [
    "GGUFError", "GGUFFile", "TensorInfo", "open_gguf", "LoadedModel", "Weight", "open_model",
    "QUANT_TYPES", "QuantType", "dequantize_reference", "quant_type", "random_blocks",
    "random_tensor", "Architecture", "TensorSpec", "get_architecture", "supported_architectures",
]
