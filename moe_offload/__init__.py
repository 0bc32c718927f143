"""moe_offload: the runtime — model execution, caches, expert placement, generation.

The offload runtime (a MoE model under a VRAM cap), the API the CLI, the server and the
FreeToken patch use:
  open_runtime(model, vram, policy=, ctx=, **options) -> OffloadRuntime
      .new_state(batch) / .prefill(tokens, state) / .decode(tokens, state) -> logits
      .decode_many(tokens, states) -> logits   one token for each of several sequences, one step
      .release(state)                               (max_sequences > 1) a state handed back
      .snapshot(state) / .restore(state, snap)      rewind points (prefix reuse; host RAM)
      .stats() -> RuntimeStats, .reset_stats(), .vram_peaks(), .report (LoadReport)
      .attach_recorder(RoutingRecorder) / .replay(trace)   routing recorded, or replayed
      .routing_counts(), .close() (or `with open_runtime(...) as rt:`)
  OffloadPolicy                every number of the offload policy (frozen; printed by bench)
  RuntimeOptions               where it runs and what it holds (vram, n_ctx, profile, ...)
  RuntimeStats, LoadReport, RoutingRecorder   what it reports
  OffloadError                 the package's exception (says what went wrong and the fix)
The model on one device, no cap:
  build_model, MODELS          LoadedModel -> model on a device; the registry of runnable archs
  Qwen35Moe                    the qwen35moe forward pass (forward / prefill / decode / new_state)
  ResidentExperts              the default experts[layer](x, ids, weights) -> y implementation
  State, Snapshot              per-sequence KV + conv + recurrent caches
  generate, Session            the token stream; model + state + tokenizer + chat template
  continue_ids                 a prompt's ids on top of a cache whose text it extends
  SamplingParams, GREEDY, Sampler   sampling (temperature, top-k/p, min-p, penalties, seed)
  TokenEvent, DoneEvent, Timings    what the stream yields
"""
from .errors import OffloadError
from .gen import (GREEDY, Cached, DoneEvent, PrefixIndex, Sampler, SamplingParams, Session, Timings,
                  TokenEvent, TokenStream, continue_ids, generate)
from .models import MODELS, Qwen35Moe, ResidentExperts, build_model
from .config import OffloadPolicy
from .gen import TokenReadback
from .offload.report import LoadReport, RoutingRecorder, RuntimeStats
from .offload.runtime import OffloadRuntime, RuntimeOptions, open_runtime
from .state import Snapshot, State

__all__ = ["OffloadError", "open_runtime", "OffloadRuntime", "OffloadPolicy", "RuntimeOptions",
           "RuntimeStats", "LoadReport", "RoutingRecorder", "MODELS", "build_model", "Qwen35Moe",
           "TokenReadback", "ResidentExperts", "State", "Snapshot", "generate", "Session", "SamplingParams",
           "GREEDY", "Sampler", "TokenEvent", "DoneEvent", "Timings", "continue_ids", "TokenStream", "PrefixIndex", "Cached"]
