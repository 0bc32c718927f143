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
  ChatTemplate, render_chat      tokenizer.chat_template rendered in a Jinja2 sandbox (in a
                                 separate process under OS limits for a model's template)
  RenderedPrompt                 ChatTemplate.render_prompt's result: the prompt's text and ids
  TemplateLimits                 what one render may use (time, sizes, nesting, memory)

Each name is imported on first use: the chat-template worker process imports this package for
its sandbox alone, without numpy and the rest.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "GGUFError": "errors", "ChatTemplateError": "errors",
    "GGUFFile": "gguf_file", "TensorInfo": "gguf_file", "open_gguf": "gguf_file",
    "LoadedModel": "model", "Weight": "model", "open_model": "model",
    "QUANT_TYPES": "quants", "QuantType": "quants", "dequantize_reference": "quants",
    "quant_type": "quants", "random_blocks": "quants", "random_tensor": "quants",
    "Architecture": "registry", "TensorSpec": "registry", "get_architecture": "registry",
    "supported_architectures": "registry",
    "Tokenizer": "tokenizer", "StreamDecoder": "tokenizer",
    "PreTokenizer": "pretokenize", "get_pretokenizer": "pretokenize",
    "ChatTemplate": "chat_template", "RenderedPrompt": "chat_template",
    "render_chat": "chat_template", "TemplateLimits": "template_sandbox",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loaders' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .chat_template import ChatTemplate, RenderedPrompt, render_chat
    from .errors import ChatTemplateError, GGUFError
    from .gguf_file import GGUFFile, TensorInfo, open_gguf
    from .model import LoadedModel, Weight, open_model
    from .pretokenize import PreTokenizer, get_pretokenizer
    from .quants import (QUANT_TYPES, QuantType, dequantize_reference, quant_type,
                         random_blocks, random_tensor)
    from .registry import Architecture, TensorSpec, get_architecture, supported_architectures
    from .template_sandbox import TemplateLimits
    from .tokenizer import StreamDecoder, Tokenizer
