"""moe_offload: the runtime — model execution, caches, expert placement, generation.

Public names:
  OffloadError                 the package's exception (says what went wrong and the fix)
  build_model, MODELS          LoadedModel -> model on a device; the registry of runnable archs
  Qwen35Moe                    the qwen35moe forward pass (forward / prefill / decode / new_state)
  ResidentExperts              the default experts[layer](x, ids, weights) -> y implementation
  State, Snapshot              per-sequence KV + conv + recurrent caches
  generate, Session            the token stream; model + state + tokenizer + chat template
  SamplingParams, GREEDY, Sampler   sampling (temperature, top-k/p, min-p, penalties, seed)
  TokenEvent, DoneEvent, Timings    what the stream yields
"""
from .errors import OffloadError
from .generate import (GREEDY, DoneEvent, Sampler, SamplingParams, Session, Timings, TokenEvent,
                       generate)
from .models import MODELS, Qwen35Moe, ResidentExperts, build_model
from .state import Snapshot, State

__all__ = ["OffloadError", "MODELS", "build_model", "Qwen35Moe", "ResidentExperts", "State",
           "Snapshot", "generate", "Session", "SamplingParams", "GREEDY", "Sampler", "TokenEvent",
           "DoneEvent", "Timings"]
