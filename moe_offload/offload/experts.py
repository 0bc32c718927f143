"""Routed experts under a VRAM cap: the object the model calls, `experts[layer](x, ids, w)`.

Two paths, chosen by the number of tokens:
- decode (T <= max_tok, inside a decode step): decided on the device and capturable. The plan
  kernel splits the top-k into cache hits, PCIe fetches into slots, and CPU misses; the fetch
  kernel copies experts from the pinned host bank into their slots (on its own stream); the pool
  kernel computes the experts resident before the step meanwhile, then, once the copies have
  landed, the fetched and guessed ones; the CPU worker computes its share alongside; the wait
  kernel adds the CPU's sum. No host round trip.
- prefetch (decode; on while the link takes most misses, OffloadPolicy.prefetch_min_fetch_share):
  when layer L's experts start, a side stream applies layer L+1's router to L's input (the
  residual stream changes little from one layer to the next), gives the guessed experts slots
  (`prefetch` kernel) and copies them once L's own fetches are done, while L and L+1's mixer
  compute; layer L+1's plan then finds them resident. Guesses cost link bandwidth, so precision
  and recall are counted (stats prefetched / prefetch_hits).
- prefill (a chunk of many tokens): experts the chunk routes to but the cache lacks are streamed
  from the host bank into a double-buffered staging area (copies on a side stream, overlapped
  with compute) and computed there; the cache itself is untouched, so a long prompt does not
  flush the decode working set.

Legend: T tokens, H hidden, E experts, K top-k, F expert ff, L MoE layers.
"""
from __future__ import annotations

import contextlib

import torch

from native import offload_native as on
from native import ops
from native.ops import QTensor, _cuda

from ..errors import OffloadError
from .expert_cache import ExpertCache
from .host_bank import HostExpertBank
from ..models.layers import route_topk
from .placement import staging_bytes as two_staging_buffers
from ..config import OffloadPolicy
from .scheduler import Scheduler

MAX_FETCH = on.MAX_SELECTIONS  # the plan kernel's selection limit (T * K); fetch lists hold it


class OffloadEngine:
    """Shared state of the offloaded experts of every layer (one per runtime)."""

    def __init__(self, cache: ExpertCache, bank: HostExpertBank, scheduler: Scheduler, *,
                 top_k: int, hidden: int, ff: int, policy: OffloadPolicy = OffloadPolicy(),
                 link_gbps: float | None = None):
        if _cuda is None:
            from native import build_info
            raise OffloadError(build_info.unusable or "the offload runtime needs the CUDA extension "
                               "(native._cuda), and this install has none: reinstall where nvcc "
                               "or an NVIDIA driver is present (docs/INSTALL.md)")
        self.cache, self.bank, self.scheduler = cache, bank, scheduler
        dev = cache.device
        self.device, self.top_k, self.hidden, self.ff = dev, top_k, hidden, ff
        self.max_tok = max(1, min(ops.DECODE_MAX_TOKENS, MAX_FETCH // top_k))
        self.timeout_s = policy.worker_timeout_s
        L = cache.n_layer
        self.step = torch.zeros((), dtype=torch.int32, device=dev)
        self.host_step = 0
        self.max_in_flight = policy.steps_in_flight
        self.error = torch.zeros((), dtype=torch.int32, device=dev)
        self.fetch_list = torch.zeros(1 + 2 * MAX_FETCH, dtype=torch.int32, device=dev)
        self.moe_scratch = torch.empty(on.moe_scratch_bytes(self.max_tok, top_k, ff, hidden),
                                       dtype=torch.uint8, device=dev)
        self.exchange = on.ExchangeBuffers.allocate(L, self.max_tok, top_k, hidden, pin=True)
        self._ex = {t: self.exchange.as_dict(t) for t in range(1, self.max_tok + 1)}
        self.tables = on.CacheTablesPtrs(cache.slot_of_expert, cache.expert_of_slot,
                                         cache.slot_last_use, cache.slot_pinned,
                                         cache.expert_freq, cache.n_slots, cache.stats,
                                         cache.cpu_pending, cache.expert_score,
                                         cache.expert_seen, cache.score_decay).as_dict()
        layers = []
        for layer in range(L):   # the CPU reads its own copy where the bank made one
            layers.append({**dict(zip(("gate", "up", "down"), bank.cpu_bank_args(layer))),
                           "ff": ff, "n_experts": cache.n_expert})
        self.worker = on.make_worker(self._ex[self.max_tok], layers, self.timeout_s)
        self.in_step = False   # inside decode_step(): the model's expert calls decode
        self.trace: torch.Tensor | None = None    # [N, L, K] ids replayed instead of the router's
        self.record: torch.Tensor | None = None   # [N, L, K] int32: the ids each decode step used
        # the step's row of trace and record, chosen once a step on the device (begin_device_step);
        # the record is written on its own stream, off the step's critical path
        self._trace_rows: torch.Tensor | None = None  # [max_tok, L, K] this step's replayed ids
        # trace rows by position (replay(by_position=True)): the stepped sequence's device
        # position (set by the runtime before a single-sequence step); token t of a step at
        # position p routes by row (p + t) mod N, so a verify step of T tokens routes each as
        # the decode step at its position would, whatever the steps before it were
        self.trace_by_position = False
        self.position: torch.Tensor | None = None
        self._tok_offsets = torch.arange(self.max_tok, device=dev)
        self._record_row: torch.Tensor | None = None  # [1] the record's row for this step
        self.record_stream = torch.cuda.Stream(dev)
        self._record_forked = False
        # prefill staging: two buffers of `staging_experts` experts each (per the largest
        # layout), allocated by the first prefill that streams (ensure_staging); an elastic
        # runtime frees them after a prompt so that decode's cache can use the memory
        self._staging_shape = (policy.staging_experts, max(lay.expert_bytes for lay in bank.layouts))
        self.staging: list[torch.Tensor] | None = None
        self.copy_stream = torch.cuda.Stream(dev)
        self.prefill_streamed = torch.zeros(L, dtype=torch.int64)  # experts streamed per layer
        # prefetch (set_predictor): per layer, the list (count, (expert, slot)...) of the experts
        # guessed for it one layer back, and two events: slots taken, bytes copied
        self.predict = None
        self.prefetch_k = top_k        # experts a token guessed one layer ahead
        self.prefetch_lists = torch.zeros((L, 1 + 2 * MAX_FETCH), dtype=torch.int32, device=dev)
        # guesses made while the MTP head drafts (guess_while_drafting), for the verify step
        self.draft_lists = torch.zeros((L, 1 + 2 * MAX_FETCH), dtype=torch.int32, device=dev)
        self.prefetch_stream = torch.cuda.Stream(dev)
        self._guessed = [torch.cuda.Event() for _ in range(L)]      # tables updated
        self._prefetched = [torch.cuda.Event() for _ in range(L)]   # copied
        self._fetched = [torch.cuda.Event() for _ in range(L)]
        # a layer's misses are fetched on their own stream while the experts resident before the
        # step compute (plan -> pair_slots: row 0 resident, row 1 fetched or guessed, computed
        # once the copies land); False: wait for every copy, then one pool call
        self.overlap_misses = policy.overlap_misses
        # the experts guessed for a layer count in the link's share of its copies (the plan
        # kernel reads the layer's prefetch list count)
        self.guesses_in_split = policy.guesses_in_split
        self.fetch_stream = torch.cuda.Stream(dev)
        self.fetch_blocks = policy.fetch_blocks
        self.pair_slots = torch.full((2, MAX_FETCH), -1, dtype=torch.int32, device=dev)
        # an emulated slower host-to-GPU link (--link-gbps): every copy above books it
        self.link = on.LinkClock(dev, link_gbps) if link_gbps else None

    def set_predictor(self, predict, k: int | None = None) -> None:
        """predict(layer, x [T, H]) -> router logits [T, E] of `layer`, or None: no prefetch.
        k experts per token are guessed one layer ahead (default top_k)."""
        if predict is None:
            self.predict = None
            return
        k = self.top_k if k is None else k
        most = MAX_FETCH // self.max_tok
        if not 1 <= k <= most:
            raise OffloadError(f"prefetch_k {k}: guess 1..{most} experts a token one layer ahead")
        self.predict, self.prefetch_k = predict, k

    def _guessing(self, L: int) -> bool:
        """Whether layer L+1's experts are guessed during layer L (never while replaying a
        trace: the router cannot guess replayed ids)."""
        return (self.predict is not None and self.trace is None and 0 <= L
                and L + 1 < self.cache.n_layer)

    @property
    def staging_bytes(self) -> int:
        """The two prefill staging buffers' size, allocated or not."""
        n, b = self._staging_shape
        return two_staging_buffers(b, n)

    def ensure_staging(self) -> None:
        if self.staging is None:
            self.staging = [torch.empty(self._staging_shape, dtype=torch.uint8, device=self.device)
                            for _ in range(2)]

    def release_staging(self) -> bool:
        """Drop the staging buffers (after their last copies and computations); True if there
        were any. The memory goes back to torch's cache: the caller's empty_cache frees it."""
        if self.staging is None:
            return False
        torch.cuda.current_stream().wait_stream(self.copy_stream)
        self.staging = None
        return True

    # -- decode step bracket (host side) ------------------------------------------------------------
    def arm(self, n_tok: int) -> None:
        """Before launching a decode step: the worker will follow step host_step + 1. The host
        does not wait for a step to finish before launching the next (the GPU would idle while
        it caught up); it waits only to keep at most `max_in_flight` steps in flight."""
        if self.host_step >= self.max_in_flight:   # before arming: an error leaves none armed
            self.worker.wait_step(self.host_step + 1 - self.max_in_flight)
        self.host_step += 1
        self.worker.begin_step(self.host_step, n_tok)

    def settle(self) -> None:
        """Wait for the CPU work of every step launched; surface the worker's first error and
        the wait kernel's (a sync point: callers are about to read results anyway)."""
        self.worker.wait_step()
        self.check()

    @contextlib.contextmanager
    def decode_step(self):
        """The body of one decode step (eager or being captured): the model's expert calls take
        the decode path inside it, bracketed by begin_device_step / end_device_step."""
        self.in_step = True
        try:
            self.begin_device_step()
            yield
            self.end_device_step()
        finally:
            self.in_step = False

    def begin_device_step(self) -> None:
        """First thing a (captured) decode step does on the device: the step counter, and the
        rows of the trace and the record this step uses (one choice a step, not one a layer)."""
        on.step_begin(self.step)
        if self.trace is None:
            self._trace_rows = None
        elif self.trace_by_position and self.position is not None:
            rows = (self.position + self._tok_offsets) % self.trace.shape[0]
            self._trace_rows = self.trace.index_select(0, rows)
        else:   # one row a step; token t of a step reads its own segment of the trace, rows
            # t * N / max_tok further on, so B sequences stepped together route as B independent
            # conversations would: each with its own recent experts, sharing only the popular ones
            N = self.trace.shape[0]
            rows = (self._step_row(self.trace) + self._tok_offsets * (N // self.max_tok)) % N
            self._trace_rows = self.trace.index_select(0, rows)
        self._record_row = None if self.record is None else self._step_row(self.record)
        self._record_forked = False   # whether this step has work on the record's stream

    def end_device_step(self) -> None:
        """Last thing a (captured) decode step does: join the record's stream (a captured graph
        must end on the stream it began on)."""
        if self._record_forked:
            torch.cuda.current_stream().wait_stream(self.record_stream)
        self._record_row, self._record_forked = None, False

    def check(self) -> None:
        err = int(self.error.item())
        if err:
            self.error.zero_()
            raise OffloadError(f"the CPU worker did not answer MoE layer {err - 1} in "
                               f"{self.timeout_s:.0f} s; the decode step was abandoned")

    # -- per layer -----------------------------------------------------------------------------------
    def _step_row(self, table: torch.Tensor) -> torch.Tensor:
        """Row (step - 1) mod N of a [N, ...] device table, chosen on the device."""
        return ((self.step.long() - 1) % table.shape[0]).view(1)

    def decode_layer(self, L: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One MoE layer of a decode step, all on the device (capturable): x [T, H], the router's
        ids [T, K] and weights [T, K] -> y [T, H].
          prefetch  side stream     layer L+1's router on x -> slots for its guesses (prefetch kernel)
          plan      plan kernel     each selection: hit | fetch over PCIe | CPU (the scheduler's split)
          fetch     fetch stream    the planned copies, host bank -> slots; then L+1's guesses
          hits      pool kernel(s)  resident experts at once; fetched and guessed ones once landed
          CPU       wait_add kernel the worker's sum over this layer's CPU misses, added to y"""
        T = x.shape[0]
        if self._trace_rows is not None:   # a replayed trace: same scheduler and kernels, its ids
            ids = self._trace_rows[:T, L]
        ids32, w, x = ids.to(torch.int32).contiguous(), w.float().contiguous(), x.contiguous()
        main = torch.cuda.current_stream()
        if self._record_row is not None:
            self._record_ids(L, ids32, main)
        guessed = self._guessing(L - 1)
        if guessed:   # this layer's guesses took their slots: the plan sees them as resident
            main.wait_event(self._guessed[L])
        self._guess_ahead(L, x, main)                                             # prefetch
        on.plan(self.tables, self._ex[T], L, ids32, w, x, self.step,              # plan
                self.scheduler.fetch_fraction, self.fetch_list, self.pair_slots,
                guessed=self.prefetch_lists[L] if guessed and self.guesses_in_split else None)
        self._fetch_planned(L, T, main)                                           # fetch
        self._copy_guesses(L)
        y = torch.empty_like(x)                                                   # hits
        if self.overlap_misses:   # resident before the step: at once, beside the copies
            self._pool(L, x, self.pair_slots[0], None, w, y, accumulate=False)
        main.wait_event(self._fetched[L])
        if guessed:
            main.wait_event(self._prefetched[L])
        if self.overlap_misses:   # fetched and guessed: once their bytes have landed
            self._pool(L, x, self.pair_slots[1], None, w, y, accumulate=True)
        else:
            self._pool(L, x, ids32, self.cache.slot_of_expert[L], w, y, accumulate=False)
        on.wait_add(self._ex[T], L, self.step, self.cache.cpu_pending, y, self.timeout_s,  # CPU
                    self.error)
        return y

    def _fetch_planned(self, L: int, T: int, main) -> None:
        """The plan's copies into layer L's slots: on the fetch stream (overlap), else in line."""
        pool = self.cache.pools[L]
        fetcher = self.fetch_stream if self.overlap_misses else main
        if fetcher is not main:
            fetcher.wait_stream(main)
        with torch.cuda.stream(fetcher):
            if pool.shape[0]:
                on.fetch(self.fetch_list, self.bank.banks[L], pool, min(MAX_FETCH, T * self.top_k),
                         self.fetch_blocks, self.link, on.LinkClock.FETCH)
            self._fetched[L].record(fetcher)

    def _record_ids(self, L: int, ids32: torch.Tensor, main) -> None:
        """record[step row, L] = the first token's ids, on the record's stream (joined by
        end_device_step)."""
        rs = self.record_stream
        rs.wait_stream(main)
        self._record_forked = True
        ids32.record_stream(rs)   # ids32's memory must not be reused on main before rs has read it
        with torch.cuda.stream(rs):
            self.record[:, L].index_copy_(0, self._record_row, ids32[:1])

    def _pool(self, L: int, x, ids, soe, w, y, *, accumulate: bool) -> None:
        """y (+)= the experts of the pairs whose slot (soe[ids], or ids themselves: slot ids) is
        in layer L's pool; the others contribute nothing."""
        pool = self.cache.pools[L]
        on.pool_moe_ffn(x, ids, w, self.bank.layouts[L].banks(pool.data_ptr(), pool.shape[1]),
                        pool.shape[0], y, self.moe_scratch, top_k=self.top_k, ff=self.ff,
                        slot_of_expert=soe, n_experts=self.cache.n_expert, accumulate=accumulate)

    def _guess_ahead(self, L: int, x: torch.Tensor, main) -> None:
        """On the side stream: layer L+1's router on x -> slots for its guessed experts, leaving
        room for its own misses (T*K slots)."""
        if not self._guessing(L):
            return
        side = self.prefetch_stream
        side.wait_stream(main)
        x.record_stream(side)  # x's memory must not be reused on main before the side has read it
        T = x.shape[0]
        with torch.cuda.stream(side):
            self._guess_slots(L + 1, x, T * self.top_k, self.step, self.prefetch_lists[L + 1])
            self._guessed[L + 1].record(side)

    def _guess_slots(self, layer: int, x: torch.Tensor, reserve: int, step: torch.Tensor,
                     listed: torch.Tensor) -> None:
        """Slots in `layer` for the prefetch_k experts its router picks for each row of x [T, H],
        marked used at `step` and listed in `listed` for _copy_listed (prefetch kernel; `reserve`
        evictable slots left for the layer's own misses)."""
        guess, _ = route_topk(self.predict(layer, x), self.prefetch_k)
        on.prefetch(self.tables, layer, guess.to(torch.int32).reshape(-1), reserve, step, listed)

    def _copy_listed(self, layer: int, listed: torch.Tensor, most: int) -> None:
        """Copy the experts `listed` (at most `most`) into their slots of `layer`."""
        if self.cache.pools[layer].shape[0]:
            on.fetch(listed, self.bank.banks[layer], self.cache.pools[layer], most,
                     self.fetch_blocks, self.link, on.LinkClock.PREFETCH)

    def _copy_guesses(self, L: int) -> None:
        """On the side stream, after layer L's own fetches (they are on its critical path): copy
        the experts guessed for layer L+1, which waits for them before its second pool kernel."""
        if not self._guessing(L):
            return
        side = self.prefetch_stream
        side.wait_event(self._fetched[L])
        with torch.cuda.stream(side):
            self._copy_listed(L + 1, self.prefetch_lists[L + 1],
                              min(MAX_FETCH, self.max_tok * self.prefetch_k))
            self._prefetched[L + 1].record(side)

    # -- while the MTP head drafts (speculative decoding) -------------------------------------------
    def guess_while_drafting(self, ids: torch.Tensor, inputs, n_verify: int) -> None:
        """Drafting leaves the link idle: on the side stream, guess the experts of the first
        layers of the verify step for its tokens known so far, ids [N] (inputs(): the stand-ins
        of those layers' MoE inputs, one [N, H] a layer), and copy them. Their slots carry the
        verify step's number, so its plans count them as guesses and do not evict them; the
        guesses leave slots for the step's own misses (n_verify tokens). The caller joins the
        side stream (join_draft_guesses) before the verify step."""
        side = self.prefetch_stream
        side.wait_stream(torch.cuda.current_stream())
        ids.record_stream(side)   # ids' memory stays ids' until the side stream has read it
        with torch.cuda.stream(side):
            verify_step = self.step + 1
            for L, x in enumerate(inputs()):
                self._guess_slots(L, x, n_verify * self.top_k, verify_step, self.draft_lists[L])
                self._copy_listed(L, self.draft_lists[L], min(MAX_FETCH, x.shape[0] * self.prefetch_k))

    def join_draft_guesses(self) -> None:
        """The verify step follows the copies guess_while_drafting queued."""
        torch.cuda.current_stream().wait_stream(self.prefetch_stream)

    def prefill_layer(self, L: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cache, lay = self.cache, self.bank.layouts[L]
        E, stream = cache.n_expert, torch.cuda.current_stream()
        w = w.float().contiguous()
        x = x.contiguous()
        counts = torch.bincount(ids.reshape(-1), minlength=E)
        cache.expert_freq[L].add_(counts.to(torch.int32))
        cache.observe_chunk(L, counts, x.shape[0], self.step)
        soe = cache.slot_of_expert[L]
        slot_ids = soe[ids]                                               # [T, K] int32, -1 = miss
        y = torch.zeros_like(x)
        n_slots = cache.slots[L]
        if n_slots:   # only the usable slots: an elastic pool's tail may have no memory behind it
            self._moe_bank(x, slot_ids, w, cache.pools[L][:n_slots], lay, y)
        missing_dev = torch.unique(ids[slot_ids < 0])                     # sorted
        missing = missing_dev.tolist()                                    # one sync per layer
        if not missing:
            return y
        self.prefill_streamed[L] += len(missing)
        host = self.bank.banks[L]
        self.ensure_staging()
        self.copy_stream.wait_stream(stream)  # staging buffers are free once earlier work is done
        n_stage = self.staging[0].shape[0]
        groups = [missing[i:i + n_stage] for i in range(0, len(missing), n_stage)]
        ready = [torch.cuda.Event() for _ in groups]
        free = [torch.cuda.Event() for _ in range(2)]
        stage_map = torch.full((E,), -1, dtype=torch.int32, device=self.device)

        whole_rows = self.staging[0].shape[1] == lay.expert_bytes

        def copy(gi: int) -> None:
            buf = self.staging[gi % 2]
            with torch.cuda.stream(self.copy_stream):
                if gi >= 2:
                    self.copy_stream.wait_event(free[gi % 2])
                # consecutive experts are adjacent in the bank: one copy a run (with 60% of a
                # layer missing, runs average ~2.5 experts; each copy costs ~10 us of host time)
                grp, j = groups[gi], 0
                if self.link is not None:
                    self.link.mark(on.LinkClock.STAGING)
                while j < len(grp):
                    r = 1
                    while whole_rows and j + r < len(grp) and grp[j + r] == grp[j] + r:
                        r += 1
                    buf[j:j + r, :lay.expert_bytes].copy_(host[grp[j]:grp[j] + r], non_blocking=True)
                    j += r
                if self.link is not None:
                    self.link.hold(on.LinkClock.STAGING, len(grp) * lay.expert_bytes)
                ready[gi].record(self.copy_stream)

        copy(0)
        for gi, grp in enumerate(groups):
            if gi + 1 < len(groups):
                copy(gi + 1)
            stream.wait_event(ready[gi])
            stage_map.fill_(-1)
            i0 = gi * n_stage
            stage_map[missing_dev[i0:i0 + len(grp)]] = torch.arange(
                len(grp), dtype=torch.int32, device=self.device)
            self._moe_bank(x, stage_map[ids], w, self.staging[gi % 2], lay, y)
            free[gi % 2].record(stream)
        return y

    def _moe_bank(self, x, slot_ids, w, pool, lay, y) -> None:
        """y += experts over a slot pool for every (token, k) whose slot id is >= 0."""
        S = pool.shape[0]
        views = [QTensor(pool[:, p.offset:p.offset + p.nbytes].view(S, p.rows, -1), p.qtype,
                         (S, p.rows, p.cols)) for p in (lay.gate, lay.up, lay.down)]
        y.add_(ops.moe_ffn(x, *views, slot_ids.to(torch.int32), w))
