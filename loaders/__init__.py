"""loaders: bytes on disk -> a described, validated model. No math, no torch.

Public names:
  GGUFError                      the package's exception (message says what, where, fix)
  ChatTemplateError              its kind for templates that fail or pass a rendering limit
  GGUFFile, TensorInfo, open_gguf  header/metadata/tensor directory, zero-copy tensor bytes
  QuantType, QUANT_TYPES, quant_type, dequantize_reference, random_blocks  the ggml type table
  Architecture, TensorSpec, get_architecture, supported_architectures  the architecture registry
  LoadedModel, Weight, open_model  a validated model
  Tokenizer, StreamDecoder       byte-level BPE from tokenizer.ggml.*: encode, decode, streaming
  PreTokenizer, get_pretokenizer  the split patterns chosen by tokenizer.ggml.pre
  ChatTemplate, render_chat      tokenizer.chat_template rendered in a Jinja2 sandbox
  TemplateLimits                 what one render may use (time, sizes, nesting)
"""
from .chat_template import ChatTemplate, TemplateLimits, render_chat
from .errors import ChatTemplateError, GGUFError
from .gguf_file import GGUFFile, TensorInfo, open_gguf
from .model import LoadedModel, Weight, open_model
from .pretokenize import PreTokenizer, get_pretokenizer
from .quants import (QUANT_TYPES, QuantType, dequantize_reference, quant_type, random_blocks,
                     random_tensor)
from .registry import Architecture, TensorSpec, get_architecture, supported_architectures
from .tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "GGUFError", "ChatTemplateError", "TemplateLimits", "GGUFFile", "TensorInfo", "open_gguf", "LoadedModel", "Weight", "open_model",
    "QUANT_TYPES", "QuantType", "dequantize_reference", "quant_type", "random_blocks",
    "random_tensor", "Architecture", "TensorSpec", "get_architecture", "supported_architectures",
    "Tokenizer", "StreamDecoder", "PreTokenizer", "get_pretokenizer", "ChatTemplate", "render_chat",
]
