"""moe_offload: the runtime -- model execution, caches, expert placement, generation.

What the CLI, the server and the FreeToken patch use (nothing else of this package):

Running a model (backend.py):
  open_backend(loaded, device=, vram=, n_ctx=, mtp=, ...) -> Backend   the plain model on one
                          device, or the offload runtime under a VRAM cap; one interface
  Backend, Capabilities, as_backend                 new_state / release / prefill / decode /
                          decode_many / verify / draft / snapshot / restore / stats; `caps` says
                          what it can do
  open_runtime, OffloadRuntime, RuntimeOptions      the offload runtime itself (offload/runtime.py)
  RuntimeStats, LoadReport, RoutingRecorder         what the runtime reports
  OffloadError                                      the package's exception (says what and the fix)
  NonFiniteLogits                                   its kind for NaN/Inf logits (.position): bad weights
Generation (gen/) and speculative decoding (spec/):
  generate, Session, TokenStream, TokenEvent, DoneEvent, Timings, TokenReadback
  SamplingParams, GREEDY, Sampler, SAMPLING_RULES, sampling_problem, default_of
  PrefixIndex, Cached, continue_ids                 prefix reuse (the chat session's rule too)
  GrammarConstraint, TriggeredConstraint, ConstraintUnavailable, check_grammar, apply_mask,
  grammar_tokenizer                                 constrained decoding (and its index of a
                                                    vocabulary, built once)
  TokenLogprob, prompt_logprobs                     log probabilities (a stream's, a prompt's)
  SpeculativeDecoder, DraftPolicy, SpecStats
Policy and defaults (config.py): OffloadPolicy, DRAFT, SERVING, PREFILL, CONTEXT, DEFAULT_N_CTX,
  settings_dict
Memory before it is taken (memory.py): estimate_memory, check_host_memory, check_vram_memory,
  host_room (what this process may still take, and the limit that says so)
Planning (offload/placement.py): plan_sketch, expert_bytes_per_layer, is_expert_tensor,
  kv_bytes_per_token, recurrent_state_bytes, CUDA_CONTEXT_MEASURED, auto_context_under_cap,
  auto_kv_type (memory.py: auto_context_host); KV_TYPES (native.kv_cache: --kv-type's names)
Routing traces (instrument/trace.py): TraceParams, make_trace, routing_stats, trace_stats;
  save_profile (a routing profile for a warm start)
The model on one device: build_model, MODELS, Qwen35Moe, ResidentExperts, State, Snapshot
"""
from native.kv_cache import KV_TYPES

from .backend import Backend, Capabilities, PlainBackend, as_backend, open_backend
from .config import CONTEXT, DEFAULT_N_CTX, DRAFT, PREFILL, SERVING, OffloadPolicy, settings_dict
from .errors import NonFiniteLogits, OffloadError
from .gen import (DEFAULTS, GREEDY, SAMPLING_RULES, Cached, ConstraintUnavailable, DoneEvent,
                  GrammarConstraint, PrefixIndex, Sampler, SamplingParams, Session, Timings,
                  TokenEvent, TokenLogprob, TokenReadback, TokenStream, TriggeredConstraint, apply_mask,
                  check_grammar, continue_ids, default_of, generate, grammar_tokenizer,
                  prompt_logprobs,
                  sampling_problem)
from .instrument.trace import TraceParams, make_trace, routing_stats, trace_stats
from .memory import check_host as check_host_memory, check_vram as check_vram_memory
from .memory import estimate as estimate_memory, host_room
from .models import MODELS, Qwen35Moe, ResidentExperts, build_model
from .offload.expert_cache import save_profile
from .memory import auto_context_host
from .offload.placement import (CUDA_CONTEXT_MEASURED, auto_context_under_cap, auto_kv_type,
                                expert_bytes_per_layer, is_expert_tensor, kv_bytes_per_token,
                                plan_sketch, recurrent_state_bytes)
from .offload.report import LoadReport, RoutingRecorder, RuntimeStats
from .offload.runtime import OffloadRuntime, RuntimeOptions, open_runtime
from .spec import DraftPolicy, SpecStats, SpeculativeDecoder
from .state import Snapshot, State

__all__ = ["Backend", "Capabilities", "PlainBackend", "as_backend", "open_backend",
           "CONTEXT", "DEFAULT_N_CTX", "DRAFT", "PREFILL", "SERVING", "OffloadPolicy", "settings_dict",
           "OffloadError", "NonFiniteLogits", "DEFAULTS", "GREEDY", "SAMPLING_RULES", "Cached", "DoneEvent",
           "PrefixIndex", "Sampler", "SamplingParams", "Session", "Timings", "TokenEvent",
           "TokenReadback", "TokenStream", "continue_ids", "default_of", "generate",
           "sampling_problem", "ConstraintUnavailable", "GrammarConstraint", "TriggeredConstraint",
           "TokenLogprob",
           "apply_mask", "check_grammar", "grammar_tokenizer", "prompt_logprobs", "TraceParams", "make_trace", "routing_stats", "trace_stats",
           "MODELS", "Qwen35Moe", "ResidentExperts", "build_model", "save_profile",
           "expert_bytes_per_layer", "is_expert_tensor", "plan_sketch", "CUDA_CONTEXT_MEASURED",
           "kv_bytes_per_token", "recurrent_state_bytes", "auto_context_under_cap", "auto_kv_type",
           "KV_TYPES",
           "auto_context_host", "LoadReport",
           "RoutingRecorder", "RuntimeStats", "OffloadRuntime", "RuntimeOptions", "open_runtime",
           "DraftPolicy", "SpecStats", "SpeculativeDecoder", "Snapshot", "State", "estimate_memory",
           "check_host_memory", "check_vram_memory", "host_room"]
