"""Every policy number and default of moe_offload, in frozen objects, each with its reason.

  OffloadPolicy     the offload runtime: where misses go, guesses, eviction, memory under the cap
  DraftSettings     speculative decoding: drafts a step, the MTP head's backlog, the adaptive policy
  ServingSettings   a server's engine: rewind points, prompt chunks between decode steps
  PREFILL           the model's own prefill numbers (the delta rule's chunk), DEFAULT_N_CTX
  CONTEXT           --ctx auto: the expert cache's share kept under a cap, host RAM kept free

`ftpatch bench --json` prints them (`as_dict`); `bench --help` takes its defaults from them. How a
number was measured belongs in docs/BENCHMARKS.md, not here. Protocol constants shared with the
kernels (selection limit, score fixed point, stats columns, a decode step's most tokens) are not
policy: they come from the native extension (native.offload_native, native.ops).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import OffloadError

MiB = 1 << 20

DEFAULT_N_CTX = 4096   # a context when none is asked for (capped by the model's trained length)


@dataclass(frozen=True)
class OffloadPolicy:
    # -- where a layer's misses go (scheduler.py) ---------------------------------------------------
    fetch_fraction: float | None = None  # share of misses fetched over PCIe; None: q = p/(p+c) from rates
    cpu_rate_ema: float = 0.2            # weight of each new measurement of the CPU's expert rate
    cpu_spare_cores: int = 2             # cores the CPU pool leaves to the thread that launches GPU
                                         # work and to the driver (a pool on every core stalls each
                                         # call on a preempted thread)
    guesses_in_split: bool = True        # a layer's guessed copies count in the link's share q:
                                         # the plan fetches q*(misses + guesses) - guesses of its
                                         # misses, the CPU takes the rest (else guesses can fill
                                         # the link and leave the CPU idle)
    observe_every: int = 16              # decode steps between folds of the worker's timings
    observe_min_experts: int = 8         # CPU experts a window needs before its rate is trusted
    # -- decode: guesses and copies (offload_experts.py) -------------------------------------------
    prefetch: bool = True                # guess layer L+1's experts during layer L
    prefetch_k: int | None = None        # experts guessed a token; None: prefetch_share of the top-k
    prefetch_share: float = 6 / 8        # default guesses a token, as a share of the top-k
    prefetch_min_fetch_share: float = 0.5  # guess only if the link takes >= this share of misses:
                                         # guesses put bytes on the link that the CPU could have
                                         # taken, which pays while the link has room, not when it
                                         # is the bottleneck; decided again whenever the CPU's
                                         # rate is re-measured
    prefetch_hysteresis: float = 0.05    # once guessing, it stops only below that share less this
    draft_guess_layers: int = 1          # while the MTP head drafts, the link idles: guess the verify
                                         # step's experts in this many first layers for its tokens
                                         # known so far, from their embeddings (layer 0 is the one
                                         # the per-layer guesses never reach; deeper, the residual
                                         # stream has moved away from the embedding); 0: off
    overlap_misses: bool = True          # resident experts compute while the misses cross PCIe
    fetch_blocks: int = 16               # grid of a PCIe copy: each block takes SM room from compute
    steps_in_flight: int = 2             # decode steps launched before the host waits for the oldest
    worker_timeout_s: float = 30.0       # the GPU gives up on the CPU's share of a layer after this
    # -- eviction (expert_cache.py; the kernels' score: native.offload_native.decayed_scores) -------
    score_decay: float = 0.99            # each choice of an expert weighs score_decay^age (decode steps)
    warm_pin_share: float = 0.25         # slots a routing profile's hottest experts keep for good
    # -- memory under the cap (runtime.py, placement.py) -------------------------------------------
    elastic: bool = True                 # the cache lends VRAM to prompts and the KV, takes it back
    graph_bucket: int = 256              # attention-length bucket per captured decode graph
    max_graphs: int = 64                 # captured steps kept before all are dropped (batches of
                                         # several sequences make a key per lengths' combination)
    prefill_chunk: int = 2048            # tokens per prefill chunk: the workspace the plan
                                         # reserves (a chunk reads the cache a tile at a time, so
                                         # the workspace does not grow with the context)
    short_prompt: int = 64               # prompts of at most this many tokens run as decode steps of
                                         # 8 tokens each (experts fetched into the cache by the
                                         # plan kernel, no host sync) instead of the prefill path, whose
                                         # fixed host cost (a sync and a copy call per run of experts a
                                         # layer) dominates a short prompt; 0 turns it off
    staging_experts: int = 32            # experts per prefill staging buffer (two are kept)
    context_margin: int = 192 * MiB      # above the measured CUDA context, for kernels loaded later
    late_load_margin: int = 48 * MiB     # ... once a capture has loaded decode's kernels (measured again)
    decode_graphs: int = 96 * MiB        # pools of the captured decode graphs (one per bucket)
    decode_extra: int = 64 * MiB         # torch's other decode needs: the eager warm-up, logits, sampling
    capture_slack: float = 1.25          # a later capture may need this much more than the first did
    capture_extra: int = 16 * MiB        # ... and this much beside
    sample_bytes_per_logit: int = 64     # sampling a row of logits outside the graph: softmax,
                                         # sort (values, int64 indices, scratch), cumsum, masks

    def __post_init__(self):
        if self.fetch_fraction is not None and not 0.0 <= self.fetch_fraction <= 1.0:
            raise OffloadError(f"fetch_fraction {self.fetch_fraction}: give a share in [0, 1]")
        if self.prefetch_k is not None and self.prefetch_k < 1:
            raise OffloadError(f"prefetch_k {self.prefetch_k}: guess at least 1 expert a token, "
                               "or turn guessing off (prefetch=False, --no-prefetch)")
        if self.draft_guess_layers < 0:
            raise OffloadError(f"draft_guess_layers {self.draft_guess_layers}: guess 0 (off) or "
                               "more first layers of a verify step while drafting")
        if not 0.0 < self.score_decay < 1.0:
            raise OffloadError(f"score_decay {self.score_decay}: give a factor in (0, 1)")

    @property
    def decode_headroom(self) -> int:
        """What torch keeps free beside the grown cache until a capture has been measured."""
        return self.decode_graphs + self.decode_extra

    def capture_headroom(self, measured: int) -> int:
        """What torch keeps free beside the cache once a capture was measured to need `measured`."""
        return int(measured * self.capture_slack) + self.capture_extra

    def sampling_workspace(self, vocab: int, rows: int) -> int:
        """What torch needs free to sample `rows` rows of logits at once; at least two of the
        allocator's 20 MiB segments (it serves every 1-10 MB request from one)."""
        return max(rows * vocab * self.sample_bytes_per_logit, 40 * MiB)

    def cpu_threads(self, cores: int) -> int:
        """The CPU pool's size under the offload runtime on a machine of `cores` cores."""
        return max(1, cores - self.cpu_spare_cores)

    def guesses(self, top_k: int) -> int:
        """Experts guessed a token one layer ahead."""
        return self.prefetch_k if self.prefetch_k is not None else max(1, int(self.prefetch_share * top_k))

    def with_(self, **changes) -> "OffloadPolicy":
        """A copy with some numbers changed (None values are ignored: 'the default')."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DraftSettings:
    """Speculative decoding (spec/). The adaptive policy's numbers: spec/policy.py's DraftPolicy
    docstring says how each estimate moves."""

    k_max: int = 3              # drafts a step at most (a verify step of 4 positions)
    backlog: int = 64           # trunk hidden states the MTP head may owe before they are written
    backlog_chunk: int = 8      # owed rows written a call: one decode-sized step of the head
    ema: float = 0.1            # a step cost's weight per step since it last moved
    accept_ema: float = 0.03    # the acceptance's EMA, slow: a fast one dips below break-even by chance
    a0: float = 0.6             # the acceptance assumed before any draft was judged
    a0_weight: int = 8          # ... counted as this many judged drafts
    prior_slope: float = 0.25   # an unmeasured k's cost: plain's x (1 + prior_slope k) ...
    prior_draft: float = 0.05   # ... + k draft calls of this share of a plain step (optimistic)
    probe_every: int = 16       # plain steps before a k = 1 probe while drafting does not pay
    probe_max: int = 256        # the probes' gap doubles while they are refused, up to this
    warm: int = 4               # a cost is the median of its first `warm` samples
    fold: int = 3               # then moves by the median of each `fold` samples
    plain_every: int = 64       # drafted steps between re-measures of plain decoding
    stale_weight: float = 0.5   # the most a rarely measured cost moves at once
    remeasure_steps: int = 5    # plain steps a re-measure takes (queued steps count from the 2nd)
    min_gain: float = 0.02      # drafting must be expected to beat plain decoding by this much

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ServingSettings:
    """A server's engine (freetoken_patch.server)."""

    snapshots: int = 4          # rewind points kept per cached sequence (each copies the recurrent state)
    prefill_chunk: int = 256    # prompt tokens a newcomer feeds between two batched decode steps
    prefill_chunk_under_cap: int = 1024   # ... under a VRAM cap, where each chunk streams the cold experts
    echo_chunk: int = 256       # prompt tokens a chunk when their logprobs are asked for (echo): a
                                # chunk's logits are chunk x vocabulary floats (250 MB at 248K)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ContextSettings:
    """`--ctx auto` (serve's and chat's default): the largest context that fits, up to the
    model's trained length (memory.auto_context_host, placement.auto_context_under_cap)."""

    expert_share: float = 0.5   # under --vram a full context's KV (and the prefill workspace that
                                # attends over it) may shrink the expert cache to this share of
                                # its room at the default context, no further: the cache is what
                                # decode speed rests on, and an agent's context is mostly unused
                                # until late in a session (the KV is mapped as it fills)
    host_keep: int = 2 << 30    # host RAM (or, on a plain GPU, VRAM) left to everything else
    host_keep_share: float = 0.1   # ... or this share of what is available, whichever is more
    step: int = 1024            # an auto context is a multiple of this (or the trained length)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefillSettings:
    """The model's prompt path."""

    delta_chunk: int = 128      # tokens a chunk of the delta rule: its loop over chunks is
                                # sequential, so fewer, larger chunks launch less
    default_chunk: int = 512    # tokens a prompt chunk of the plain model
    attention_tile_bytes: int = 128 << 20  # a chunk's attention reads the cache in tiles whose
                                # f32 scores, and whose rows as f32, take about this much
                                # (attention.attention_tiled): the workspace follows the chunk, not
                                # the context

    def attention_tile(self, n_tokens: int, n_head: int, kv_row_values: int) -> int:
        """Cache rows a chunk of n_tokens attends at a time: a multiple of 256 whose f32 scores
        (n_tokens * n_head a row) and whose K and V rows dequantized (kv_row_values each: kv
        heads * head dim) each take about attention_tile_bytes. The second bound is a decode
        token's: one query's scores are small, but its float copy of a long cache is not."""
        by_scores = self.attention_tile_bytes // (4 * max(1, n_tokens) * n_head)
        by_rows = self.attention_tile_bytes // (4 * 2 * max(1, kv_row_values))
        return max(256, min(by_scores, by_rows) // 256 * 256)

    def as_dict(self) -> dict:
        return asdict(self)


DRAFT = DraftSettings()
SERVING = ServingSettings()
PREFILL = PrefillSettings()
CONTEXT = ContextSettings()


def settings_dict(policy: "OffloadPolicy | None" = None) -> dict:
    """Every number of this file (the offload policy given, or the default one), for JSON."""
    return {"offload": (policy or OffloadPolicy()).as_dict(), "draft": DRAFT.as_dict(),
            "serving": SERVING.as_dict(), "prefill": PREFILL.as_dict(),
            "context": CONTEXT.as_dict(),
            "default_n_ctx": DEFAULT_N_CTX}
