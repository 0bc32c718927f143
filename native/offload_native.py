"""native.offload_native: the offload runtime's native entry points, thin and checked once.

GPU side (native._cuda): page-locking host memory, and the device-side decode-step kernels
(plan, fetch, wait/add; see csrc/offload_exchange.h for the protocol). CPU side (native._cpu):
the worker thread that computes the misses the GPU hands it. Plus the expert-pool MoE kernel.
Every launch is asynchronous on the current CUDA stream and safe to capture in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import NativeError
from .ops import _cpu, _cuda


def _need(ext, what: str):
    if ext is None:
        raise NativeError(f"{what} needs the native extension, which is not built or not usable")
    return ext


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


# ---- page-locked host memory ------------------------------------------------------------------

def pin_host(t: torch.Tensor) -> None:
    """Page-lock a contiguous CPU tensor's memory and map it for the GPU (same address: UVA)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise NativeError("pin_host needs a contiguous CPU tensor")
    _need(_cuda, "pinning host memory").pin_host(t.data_ptr(), t.numel() * t.element_size())


def unpin_host(t: torch.Tensor, missing_ok: bool = False) -> None:
    try:
        _need(_cuda, "unpinning host memory").unpin_host(t.data_ptr())
    except Exception:
        if not missing_ok:
            raise


class _CudaMemory:
    """A CUDA array-interface descriptor: lets torch wrap memory it did not allocate (it keeps a
    reference to `owner`, so the memory outlives every tensor that views it)."""

    def __init__(self, addr: int, shape: tuple[int, ...], owner) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "|u1",
                                         "data": (addr, False), "version": 3, "strides": None}


def device_view(addr: int, shape: tuple[int, ...], owner) -> torch.Tensor:
    """A uint8 CUDA tensor over `addr`: device memory we mapped, or page-locked host memory
    (pin_host: the GPU reads it over PCIe at the same address)."""
    return torch.as_tensor(_CudaMemory(addr, shape, owner), device="cuda")


def host_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA view of a pinned (pin_host) contiguous CPU tensor: torch kernels launched on it read
    the host memory over PCIe (zero-copy); same shape, dtype uint8 rows."""
    return device_view(t.data_ptr(), tuple(t.view(torch.uint8).shape), t)


# ---- elastic device memory ----------------------------------------------------------------------

def elastic_supported() -> bool:
    return _cuda is not None and torch.cuda.is_available() and _cuda.vmm_supported()


def elastic_chunk() -> int:
    """Bytes an elastic buffer maps at a time (the driver's granularity)."""
    return int(_need(_cuda, "elastic device memory").vmm_granularity())


def mapped_size(nbytes: int, chunk: int) -> int:
    """Memory an elastic buffer maps to back `nbytes`: whole chunks, at least one."""
    return max(1, -(-int(nbytes) // chunk)) * chunk


class ElasticBuffer:
    """Device memory that grows and shrinks in place: `capacity` bytes of address space reserved
    at once, physical memory mapped behind its first `mapped` bytes in chunks of the driver's
    granularity (csrc/cuda/vmm.cu). `view` is a uint8 tensor over the whole range; only its first
    `mapped` bytes may be touched. Not thread-safe; the caller makes sure no kernel reads the
    tail it unmaps (synchronize first)."""

    def __init__(self, capacity: int, initial: int = 0):
        self.chunk = elastic_chunk()
        self.capacity = -(-max(1, capacity) // self.chunk) * self.chunk
        self.addr = int(_cuda.vmm_reserve(self.capacity))
        self._handles: list[int] = []       # one per mapped chunk, in address order
        try:
            self.resize(max(initial, 1))    # torch needs a mapped first byte to wrap the range
            self.view = device_view(self.addr, (self.capacity,), self)
        except BaseException:
            self.close()
            raise

    @property
    def mapped(self) -> int:
        return len(self._handles) * self.chunk

    def resize(self, nbytes: int) -> int:
        """Map or unmap chunks so that at least `nbytes` (at most `capacity`, at least one chunk)
        are backed; returns the mapped size."""
        want = min(self.capacity, mapped_size(nbytes, self.chunk))
        while self.mapped < want:
            off = self.mapped
            self._handles.append(int(_cuda.vmm_map(self.addr + off, self.chunk)))
        while self.mapped > want:
            h = self._handles.pop()
            _cuda.vmm_unmap(self.addr + self.mapped, self.chunk, h)
        return self.mapped

    def __del__(self) -> None:   # unreachable: no view of it is left
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        while self._handles:
            h = self._handles.pop()
            _cuda.vmm_unmap(self.addr + self.mapped, self.chunk, h)
        if self.addr:
            _cuda.vmm_free(self.addr, self.capacity)
            self.addr = 0


# ---- shared descriptors ---------------------------------------------------------------------------

# ---- protocol constants (csrc/offload_exchange.h, exported by both extensions) ----------------------

def _protocol(name: str, fallback):
    """A constant the kernels and Python share, as the extension states it (the CPU extension is
    always built; the fallback, the header's value, only serves a tree with no extension)."""
    for ext in (_cpu, _cuda):
        if ext is not None and hasattr(ext, name):
            return getattr(ext, name)
    return fallback


MAX_SELECTIONS = int(_protocol("MAX_SELECTIONS", 64))   # T * K a layer's plan takes; list length
STATS_COLUMNS = tuple(_protocol("STATS_COLUMNS", ("hits", "fetched", "cpu", "prefetch_hits",
                                                  "prefetched")))   # CacheTables::stats, in order
SCORE_ONE = int(_protocol("SCORE_ONE", 1 << 16))        # one choice, in the score's fixed point
SCORE_STEPS = int(_protocol("SCORE_STEPS", 1024))       # decay table length: older counts as 0
OUTPUT_DTYPES = dict(_protocol("OUTPUT_DTYPES", {"F32": 0, "F16": 1, "BF16": 30}))  # dequantize's
LINK_WORDS = dict(_protocol("LINK_WORDS", {"free_at": 0, "mark": 1, "marks": 3, "ns_per_byte": 4,
                                            "bytes": 5, "words": 8}))   # the emulated link's words
SCORE_MAX = 1 << 30   # scores seeded from the host stop here (int32, with room for decode's adds)


# ---- the eviction score: the kernels' definition (offload_exchange.h) in one numpy/torch mirror -----
# An expert's score counts its choices lately, each weighing decay^age (age in decode steps), in
# fixed point (SCORE_ONE = one choice); the cache evicts the smallest score first, then the least
# recently used. The decay is a policy number (OffloadPolicy.score_decay); the kernels read it as
# a table, so that they and this mirror agree bit for bit.

def score_decay_table(decay: float) -> "np.ndarray":
    """[SCORE_STEPS] int32: round(decay^age * SCORE_ONE)."""
    import numpy as np
    return np.round(decay ** np.arange(SCORE_STEPS) * SCORE_ONE).astype(np.int32)


def decayed_scores(score, seen, step, table):
    """Scores last updated at steps `seen`, as of `step` (the kernels' decayed_score): numpy
    arrays or scalars, or torch tensors on any device (no host sync); int64 results."""
    if any(isinstance(v, torch.Tensor) for v in (score, seen, step, table)):
        score, seen, step, table = (v.long() if isinstance(v, torch.Tensor) else int(v)
                                    for v in (score, seen, step, table))
    else:
        import numpy as np
        score, seen, step, table = (np.asarray(v, dtype=np.int64) for v in (score, seen, step, table))
    age = step - seen
    kept = (score * table[age.clip(0, SCORE_STEPS - 1)]) >> 16
    return kept * (age < SCORE_STEPS)


@dataclass
class CacheTablesPtrs:
    """Addresses of an ExpertCache's device tables (see csrc/offload_exchange.h)."""

    slot_of_expert: torch.Tensor
    expert_of_slot: torch.Tensor
    slot_last_use: torch.Tensor
    slot_pinned: torch.Tensor
    expert_freq: torch.Tensor
    n_slots: torch.Tensor
    stats: torch.Tensor
    cpu_pending: torch.Tensor
    expert_score: torch.Tensor    # [L, E] int32, fixed point
    expert_seen: torch.Tensor     # [L, E] int32, step of the score's last update
    score_decay: torch.Tensor     # [SCORE_STEPS] int32 (score_decay_table)

    def as_dict(self) -> dict[str, int]:
        d = {k: ptr(getattr(self, k)) for k in ("slot_of_expert", "expert_of_slot",
                                                 "slot_last_use", "slot_pinned", "expert_freq",
                                                 "n_slots", "stats", "cpu_pending",
                                                 "expert_score", "expert_seen", "score_decay")}
        d["n_experts"] = self.slot_of_expert.shape[1]
        d["max_slots"] = self.expert_of_slot.shape[1]
        return d


@dataclass
class ExchangeBuffers:
    """The page-locked host area both engines share (one row per MoE layer)."""

    gpu_flag: torch.Tensor   # [L] int32
    cpu_flag: torch.Tensor   # [L] int32
    cpu_ids: torch.Tensor    # [L, Tmax, K] int32
    cpu_w: torch.Tensor      # [L, Tmax, K] f32
    x_host: torch.Tensor     # [L, Tmax, H] f32
    y_host: torch.Tensor     # [L, Tmax, H] f32

    @classmethod
    def allocate(cls, n_layer: int, max_tok: int, top_k: int, hidden: int, pin: bool) -> "ExchangeBuffers":
        def z(*shape, dtype):
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t
        i32, f32 = torch.int32, torch.float32
        return cls(z(n_layer, dtype=i32), z(n_layer, dtype=i32),
                   z(n_layer, max_tok, top_k, dtype=i32), z(n_layer, max_tok, top_k, dtype=f32),
                   z(n_layer, max_tok, hidden, dtype=f32), z(n_layer, max_tok, hidden, dtype=f32))

    def as_dict(self, n_tok: int) -> dict[str, int]:
        L, max_tok, K = self.cpu_ids.shape
        return {"gpu_flag": ptr(self.gpu_flag), "cpu_flag": ptr(self.cpu_flag),
                "cpu_ids": ptr(self.cpu_ids), "cpu_w": ptr(self.cpu_w),
                "x_host": ptr(self.x_host), "y_host": ptr(self.y_host), "n_tok": n_tok,
                "max_tok": max_tok, "top_k": K, "hidden": self.x_host.shape[2]}


# ---- device-side decode step (native._cuda) ------------------------------------------------------

def step_begin(step: torch.Tensor) -> None:
    _need(_cuda, "offload").offload_step_begin(ptr(step), _stream())


def plan(tables: dict, exchange: dict, layer: int, ids32: torch.Tensor, w: torch.Tensor,
         x: torch.Tensor, step: torch.Tensor, fetch_fraction: torch.Tensor,
         fetch_list: torch.Tensor, pair_slots: torch.Tensor | None = None,
         guessed: torch.Tensor | None = None) -> None:
    """pair_slots (int32 [2, 64], optional) gets each selection's slot if its bytes were resident
    before this step (row 0), or if it is fetched by this plan or was guessed this step (row 1:
    copies may be in flight), else -1: slot ids for two moe_ffn_pool calls. `guessed` (int32 on
    the device, its first element read; a prefetch list will do) counts the experts this step's
    guesses copied into the layer: they take their part of the link's share (plan_reference)."""
    _need(_cuda, "offload").offload_plan(tables, exchange, layer, ptr(ids32), ptr(w), ptr(x),
                                         ptr(step), ptr(fetch_fraction), ptr(guessed),
                                         ptr(fetch_list), ptr(pair_slots), _stream())


def prefetch(tables: dict, layer: int, guess32: torch.Tensor, reserve: int, step: torch.Tensor,
             prefetch_list: torch.Tensor) -> None:
    """Slots for layer `layer`'s guessed experts (int32, flat) not yet resident -> prefetch_list,
    leaving `reserve` evictable slots for the layer's own misses."""
    _need(_cuda, "offload").offload_prefetch(tables, layer, ptr(guess32), guess32.numel(), reserve,
                                             ptr(step), ptr(prefetch_list), _stream())


def fetch(fetch_list: torch.Tensor, host_bank: torch.Tensor, pool: torch.Tensor,
          max_fetch: int, blocks: int = 16, link: "LinkClock | None" = None, which: int = 0) -> None:
    """Copy the listed experts into their slots with a grid of `blocks` blocks (more: more PCIe
    reads in flight, fewer SM slots left to the kernels running beside the copy). With `link`,
    the copy takes as long as the emulated link would make it (mark slot `which`: one a stream)."""
    ext = _need(_cuda, "offload")
    if link is not None:
        link.mark(which)
    ext.offload_fetch(ptr(fetch_list), ptr(host_bank), ptr(pool), host_bank.shape[1], pool.shape[1],
                      max_fetch, _stream(), blocks)
    if link is not None:
        link.hold(which, host_bank.shape[1], count=fetch_list)


class LinkClock:
    """An emulated host-to-GPU link of `gbps` GB/s (10^9 bytes a second) that every copy of the
    offload path books: the copy's stream is held until the link, shared by all copies, would have
    carried its bytes (csrc/offload_exchange.h, LinkWord). The real copy still runs at the real
    link's speed inside the booking, so the emulation is right while the real link is faster."""

    FETCH, PREFETCH, STAGING = 0, 1, 2   # mark slots: one per stream that copies

    def __init__(self, device: torch.device, gbps: float):
        if not gbps > 0:
            raise NativeError(f"an emulated link of {gbps} GB/s: give a rate above 0")
        self.words = torch.zeros(LINK_WORDS["words"], dtype=torch.int64, device=device)
        self.set_rate(gbps)

    def set_rate(self, gbps: float) -> None:
        self.gbps = float(gbps)
        bits = torch.tensor([1.0 / self.gbps], dtype=torch.float64).view(torch.int64)
        self.words[LINK_WORDS["ns_per_byte"]] = bits.to(self.words.device)[0]

    def mark(self, which: int) -> None:
        _need(_cuda, "offload").offload_link_mark(ptr(self.words), which, _stream())

    def hold(self, which: int, bytes_each: int, count: torch.Tensor | None = None) -> None:
        """After a copy: book count[0] * bytes_each bytes (bytes_each when count is None)."""
        _need(_cuda, "offload").offload_link_hold(ptr(self.words), which, ptr(count), int(bytes_each),
                                                  _stream())

    def bytes_booked(self) -> int:
        return int(self.words[LINK_WORDS["bytes"]].item())


def link_schedule_reference(copies: list[tuple[int, int]], gbps: float) -> list[int]:
    """What LinkClock makes of copies [(start mark ns, bytes)] booked in that order: the ns at which
    each one's stream is released (the hold kernel's arithmetic)."""
    free, out = 0, []
    for mark, nbytes in copies:
        free = max(free, mark) + int(nbytes * (1.0 / gbps)) if nbytes > 0 else free
        out.append(free if nbytes > 0 else mark)
    return out


def wait_add(exchange: dict, layer: int, step: torch.Tensor, cpu_pending: torch.Tensor,
             y: torch.Tensor, timeout_s: float, error: torch.Tensor) -> None:
    _need(_cuda, "offload").offload_wait_add(exchange, layer, ptr(step), ptr(cpu_pending), ptr(y),
                                             int(timeout_s * 1e9), ptr(error), _stream())


# ---- expert FFNs over slot pools and host banks ------------------------------------------------------
# A bank is (type id, address, expert stride) for each of gate, up and down (host_bank.ExpertLayout
# .banks), experts laid out from one address: cache slots, staging rows, a host bank.

def moe_scratch_bytes(n_tok: int, top_k: int, ff: int, hidden: int) -> int:
    """Scratch pool_moe_ffn needs for n_tok tokens of top_k experts of width ff, hidden wide."""
    return int(_need(_cuda, "the expert-pool kernel").moe_scratch_bytes(n_tok, top_k, ff, hidden))


def pool_moe_ffn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, banks, n_slots: int,
                 y: torch.Tensor, scratch: torch.Tensor, *, top_k: int, ff: int,
                 slot_of_expert: torch.Tensor | None = None, n_experts: int = 0,
                 accumulate: bool = False) -> None:
    """y [T, H] (+)= the experts of a slot pool for every (token, k) whose slot -- slot_of_expert
    [ids] (n_experts of them), or ids themselves when it is None -- lies in [0, n_slots); the
    others contribute nothing. x, y f32 [T, H], ids int32 [T, K] (K = top_k), w f32 [T, K],
    all contiguous."""
    T, H = x.shape
    ext = _need(_cuda, "the expert-pool kernel")
    ext.moe_ffn_pool(x.data_ptr(), T, H, ff, ids.data_ptr(), w.data_ptr(), top_k,
                     ptr(slot_of_expert), n_experts if slot_of_expert is not None else n_slots,
                     n_slots, *(v for b in banks for v in b), y.data_ptr(), 0, scratch.data_ptr(),
                     scratch.numel(), _stream(), accumulate)


def cpu_available() -> bool:
    return _cpu is not None


def host_moe_ffn(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, banks, n_experts: int,
                 y: torch.Tensor, *, ff: int) -> None:
    """The CPU worker's kernel on host banks: y [T, H] = sum_k w * expert_ids(x); ids < 0 skip.
    CPU tensors: x, y f32 [T, H], ids int32 [T, K], w f32 [T, K]."""
    T, H = x.shape
    _need(_cpu, "the CPU expert kernel").moe_ffn(
        x.data_ptr(), T, H, ff, n_experts, ids.data_ptr(), w.data_ptr(), ids.shape[-1],
        *(v for b in banks for v in b), y.data_ptr(), 0)


# ---- the decisions of plan and prefetch, in numpy (the kernels' reference; tests compare) -------

_NEVER = 2**63 - 1   # LLONG_MAX: a slot used this step or pinned is never a victim


@dataclass
class LayerTablesRef:
    """One layer's residency tables as numpy arrays (int32 or int64), updated in place."""

    slot_of_expert: "np.ndarray"   # [E]
    expert_of_slot: "np.ndarray"   # [S]
    slot_last_use: "np.ndarray"    # [S]
    slot_pinned: "np.ndarray"      # [S]
    expert_freq: "np.ndarray"      # [E]
    n_slots: int
    expert_score: "np.ndarray | None" = None   # [E] (None: zeros)
    expert_seen: "np.ndarray | None" = None    # [E] (None: zeros)
    decay: "np.ndarray" = field(kw_only=True)  # [SCORE_STEPS] score_decay_table(policy's decay)

    def __post_init__(self):
        import numpy as np
        E = len(self.slot_of_expert)
        if self.expert_score is None:
            self.expert_score = np.zeros(E, np.int64)
        if self.expert_seen is None:
            self.expert_seen = np.zeros(E, np.int64)

    def score(self, e: int, step: int) -> int:
        return int(decayed_scores(self.expert_score[e], self.expert_seen[e], step, self.decay))

    def keys(self, step: int) -> list[int]:
        """How evictable each usable slot is, smaller first: free, then the smallest score,
        then the least recently used; _NEVER for slots used this step or pinned."""
        out = []
        for s in range(self.n_slots):
            old = int(self.expert_of_slot[s])
            if self.slot_pinned[s] or self.slot_last_use[s] >= step:
                out.append(_NEVER)
            else:
                out.append(-2**63 if old < 0 else self.victim_key(s, old, step))
        return out

    def victim_key(self, s: int, e: int, step: int) -> int:
        """Order of occupied evictable slots (smaller goes first): expert e's score, then the
        slot's last use."""
        return (self.score(e, step) << 32) | int(self.slot_last_use[s])   # C++ victim_key

    def assign(self, want: list[int], keys: list[int], step: int) -> list[tuple[int, int]]:
        """Slots of smallest key (ties: lower slot) for `want` in turn, evicting their experts."""
        done = []
        for e in want:
            s = min(range(len(keys)), key=lambda i: (keys[i], i), default=None)
            if s is None or keys[s] == _NEVER:
                break
            old = int(self.expert_of_slot[s])
            if old >= 0:
                self.slot_of_expert[old] = -1
            self.expert_of_slot[s], self.slot_of_expert[e], self.slot_last_use[s] = e, s, step
            keys[s] = _NEVER
            done.append((e, s))
        return done


def plan_reference(t: LayerTablesRef, ids: list[int], step: int,
                   fetch_fraction: tuple[float, float], guessed: int = 0) -> dict:
    """What offload_plan decides for one layer's selections `ids` (T*K, flat): the fetch list
    [(expert, slot)], the CPU's experts (-1 elsewhere), pair_slots [2][T*K], hits, prefetch hits.
    A hit whose slot is already used this step was guessed this step (its copy may be in flight).
    Of nm unique misses, q * (nm + guessed) - guessed are fetched (rounded; at least `least`, at
    most nm): the link's share q = fetch_fraction[0] counts the `guessed` experts this step's
    guesses already copied into the layer, so the link and the CPU finish together."""
    import numpy as np
    slots = [int(t.slot_of_expert[e]) for e in ids]
    kind = [2 if s < 0 else 1 if t.slot_last_use[s] >= step else 0 for s in slots]
    for e, s in zip(ids, slots):
        t.expert_freq[e] += 1
        if s >= 0:
            t.slot_last_use[s] = step
    for e in dict.fromkeys(ids):   # each chosen expert's score: decayed, plus its choices now
        t.expert_score[e] = t.score(e, step) + ids.count(e) * SCORE_ONE
        t.expert_seen[e] = step
    misses: list[int] = []
    for e, k in zip(ids, kind):
        if k == 2 and e not in misses:
            misses.append(e)
    misses.sort(key=lambda e: -int(t.expert_freq[e]))   # stable: ties keep their order
    q, least = np.float32(fetch_fraction[0]), int(np.float32(fetch_fraction[1]))
    g = np.float32(guessed)
    nf = int(np.floor(q * (np.float32(len(misses)) + g) - g + np.float32(0.5)))
    nf = min(max(nf, min(len(misses), least), 0), len(misses))
    fetched = t.assign(misses[:nf], t.keys(step), step)
    slot = [int(t.slot_of_expert[e]) for e in ids]
    return {"fetch": fetched,
            "cpu_ids": [e if k == 2 and s < 0 else -1 for e, k, s in zip(ids, kind, slot)],
            "pair_slots": [[s if k == 0 else -1 for k, s in zip(kind, slot)],
                           [s if k != 0 else -1 for k, s in zip(kind, slot)]],
            "hits": sum(k != 2 for k in kind), "prefetch_hits": sum(k == 1 for k in kind)}


def prefetch_reference(t: LayerTablesRef, guess: list[int], reserve: int, step: int) -> list[tuple[int, int]]:
    """What offload_prefetch decides: slots for the guessed experts not resident (unique, in
    order), leaving `reserve` evictable slots; the list [(expert, slot)]."""
    keys = t.keys(step)
    cap = min(sum(k != _NEVER for k in keys) - reserve, MAX_SELECTIONS)
    want: list[int] = []
    for e in guess:
        if len(want) >= cap:
            break
        if 0 <= e < len(t.slot_of_expert) and t.slot_of_expert[e] < 0 and e not in want:
            want.append(e)
    return t.assign(want, keys, step)


# ---- CPU worker (native._cpu) ---------------------------------------------------------------------

def make_worker(exchange: dict, layers: list[dict], timeout_s: float = 30.0):
    """A native OffloadWorker; `layers[L]` = {gate: (type_id, addr, stride), up, down, ff, n_experts}."""
    return _need(_cpu, "the CPU offload worker").OffloadWorker(exchange, layers, int(timeout_s * 1000))
