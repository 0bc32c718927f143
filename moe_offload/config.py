"""Every number of the offload policy, in one frozen object.

The runtime, the engine, the cache, the scheduler and placement read their choices from an
`OffloadPolicy`; `ftpatch bench --json` prints it and `bench --help` takes its defaults from it.
What a number means and why it is what it is stays beside it; how each was measured belongs in
docs/BENCHMARKS.md. Protocol constants shared with the kernels (selection limit, score fixed
point, stats columns) are not policy: they come from the native extension (native.offload_native).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import OffloadError

MiB = 1 << 20


@dataclass(frozen=True)
class OffloadPolicy:
    # -- where a layer's misses go (scheduler.py) ---------------------------------------------------
    fetch_fraction: float | None = None  # share of misses fetched over PCIe; None: q = p/(p+c) from rates
    cpu_rate_ema: float = 0.2            # weight of each new measurement of the CPU's expert rate
    cpu_spare_cores: int = 2             # cores the CPU pool leaves to the thread that launches GPU
                                         # work and to the driver: a pool on every core stalls each
                                         # call on a preempted thread (its rate fell 3-5x)
    guesses_in_split: bool = True        # a layer's guessed copies count in the link's share q:
                                         # the plan fetches q*(misses + guesses) - guesses of its
                                         # misses, the CPU takes the rest (without, four sequences'
                                         # guesses filled the link and left the CPU idle)
    observe_every: int = 16              # decode steps between folds of the worker's timings
    observe_min_experts: int = 8         # CPU experts a window needs before its rate is trusted
    # -- decode: guesses and copies (offload_experts.py) -------------------------------------------
    prefetch: bool = True                # guess layer L+1's experts during layer L
    prefetch_k: int | None = None        # experts guessed a token; None: prefetch_share of the top-k
    prefetch_share: float = 6 / 8        # default guesses a token, as a share of the top-k
    prefetch_min_fetch_share: float = 0.5  # guess only if the link takes >= this share of misses:
                                         # guesses put bytes on the link that the CPU could have
                                         # taken, which pays while the link has room (q 0.5-0.9 on
                                         # a PCIe gen5 host, by how fast the CPU measures), not
                                         # when it is the bottleneck (q ~0.37 at a laptop's 11.8
                                         # GB/s); decided at start-up and again whenever the CPU's
                                         # rate is re-measured: alone at start-up the CPU reads
                                         # faster than beside decode's copies
    prefetch_hysteresis: float = 0.05    # once guessing, it stops only below that share less this
    draft_guess_layers: int = 1          # while the MTP head drafts, the link idles: guess the verify
                                         # step's experts in this many first layers for its tokens
                                         # known so far, from their embeddings (layer 0 is the one
                                         # the per-layer guesses never reach; deeper, the residual
                                         # stream has moved away from the embedding); 0: off
    overlap_misses: bool = True          # resident experts compute while the misses cross PCIe
    fetch_blocks: int = 16               # grid of a PCIe copy: each block takes SM room from compute
    steps_in_flight: int = 2             # decode steps launched before the host waits for the oldest
    decode_tokens: int = 8               # most tokens a decode step (the pool kernel's limit)
    worker_timeout_s: float = 30.0       # the GPU gives up on the CPU's share of a layer after this
    # -- eviction (expert_cache.py; the kernels' score: native.offload_native.decayed_scores) -------
    score_decay: float = 0.99            # each choice of an expert weighs score_decay^age (decode steps)
    warm_pin_share: float = 0.25         # slots a routing profile's hottest experts keep for good
    # -- memory under the cap (runtime.py, placement.py) -------------------------------------------
    elastic: bool = True                 # the cache lends VRAM to prompts and the KV, takes it back
    graph_bucket: int = 256              # attention-length bucket per captured decode graph
    max_graphs: int = 64                 # captured steps kept before all are dropped (batches of
                                         # several sequences make a key per lengths' combination)
    prefill_chunk: int = 2048            # tokens per prefill chunk
    short_prompt: int = 64               # prompts of at most this many tokens run as decode steps of
                                         # decode_tokens each (experts fetched into the cache by the
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
