"""Per-sequence state of a qwen35moe model: KV cache for attention layers, conv + recurrent
state for gated delta-net layers.

Everything is allocated once for `n_ctx` positions and updated in place, so buffer addresses
never change (a CUDA graph can capture a decode step); on the CPU the KV's pages are taken from
the OS only as positions are written. The B rows of a batch advance together:
they share one position counter. With `kv_alloc` (the offload runtime, B = 1) the KV rows are
address space reserved for n_ctx positions with memory mapped only behind the first `kv_rows`:
`map_kv` grows or shrinks that as the conversation does, the addresses staying put.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from native import kv_cache, ops

from .config import DEFAULT_N_CTX
from .errors import OffloadError



def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from calloc'd pages (numpy), which the OS maps only when written, so a
    large --ctx costs host memory as the conversation reaches it, not up front."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for d in shape:
        n *= d
    raw = np.zeros(n * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


def table_columns(config) -> dict[tuple[str, int], int]:
    """Where each buffer's address sits in a State's row: K and V of every attention layer, conv
    and ssm of every delta-net layer (the position comes after them)."""
    names = [(n, i) for i in range(config.n_layer)
             for n in (("conv", "ssm") if config.recurrent[i] else ("k", "v"))]
    return {key: col for col, key in enumerate(names)}


class StateTable:
    """The rows of B single-sequence States (`State.row`) stacked into one device table [B, W]:
    what a batched step reaches the States' buffers and positions through when its captured graph
    must be bound to the table, not to the States (ops.SeqTable). The graph keeps its own copy of
    the table, rewritten before each replay, so one graph runs any B States."""

    def __init__(self, rows: torch.Tensor, like: "State"):
        self.rows, self.like = rows, like   # like: one of the States (shapes, dtypes, columns)

    @staticmethod
    def stack(states) -> torch.Tensor:
        """The States' rows as one table [B, W] (one launch, no host sync)."""
        return torch.stack([st.row for st in states])

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    def buffers(self, name: str, layer: int, rows=None) -> ops.SeqTable:
        """The `name` ("k", "v", "conv", "ssm") of `layer` of the States at `rows` (default
        all; a row may repeat: a prompt's tokens, each an entry on its State's cache)."""
        W, col = self.rows.shape[1], self.like.columns[name, layer]
        rows = range(self.batch) if rows is None else rows
        return ops.SeqTable(self.rows, tuple(b * W + col for b in rows),
                            getattr(self.like, name)[layer])

    def positions(self) -> list[torch.Tensor]:
        """Each State's position: [1] views of the table's last column."""
        return [self.rows[b, -1:] for b in range(self.batch)]


@dataclass
class Snapshot:
    """What `restore` needs to rewind to `n_past` (KV rows before it are never rewritten)."""

    n_past: int
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    mtp_past: int = 0                      # MTP rows written (mtp.py), and the trunk's hidden
    mtp_hidden: torch.Tensor | None = None  # states still owed to it


class State:
    """Caches of B sequences on one device.

    k, v[layer]  [B, n_ctx, Hkv, X]       attention layers, head rows of `kv_type`
                                          (native.kv_cache: X = d values, or d's blocks);
                                          rows >= n_past are garbage
    conv[layer]  [B, C, Kc-1] f32         delta-net raw projections of the last Kc-1 tokens
    ssm[layer]   [B, Hv, dk, dv] f32      delta-net state S (key dim i, value dim c)
    n_past       host int: tokens already in the cache (no device sync to read it)
    pos          [] int64 on the device, equal to n_past (advanced in place inside a step)
    row          [W] int64 on the device: the buffers' addresses, then pos (StateTable)
    """

    def __init__(self, config, batch: int = 1, n_ctx: int | None = None,
                 device: torch.device | str = "cpu", kv_type="f32",
                 attn_bucket: int = 1, kv_alloc=None):
        """kv_type: a native.kv_cache type, its name ("f32", "f16", "q8_0", "q4_0") or a float
        dtype. kv_alloc(capacity bytes) -> a buffer like offload_native.ElasticBuffer (`view`,
        `chunk`, `capacity`, `mapped`, `resize(nbytes)`, `close()`): one per K and V tensor, B
        must be 1."""
        try:
            self.kv_type = kv_cache.kv_type(kv_type)
            width = self.kv_type.row_width(config.head_dim)
        except ValueError as e:
            raise OffloadError(str(e)) from None
        kv_dtype = self.kv_type.storage
        c = config
        self.config = c
        self.batch = int(batch)
        self.n_ctx = int(n_ctx or min(c.n_ctx_train, DEFAULT_N_CTX))
        if self.batch < 1 or self.n_ctx < 1:
            raise OffloadError(f"state needs batch >= 1 and n_ctx >= 1, got {batch} and {n_ctx}")
        self.device = torch.device(device)
        self.attn_bucket = max(1, int(attn_bucket))  # round attended length up (graph capture)
        B, f32 = self.batch, dict(dtype=torch.float32, device=self.device)
        kv_shape = (B, self.n_ctx, c.n_head_kv, width)
        self._kv_bufs: list = []
        self._kv_row = c.n_head_kv * self.kv_type.row_bytes(c.head_dim)   # bytes a position
        if self.device.type == "cpu":   # before anything is taken: a refusal names the key
            from .memory import check_state
            check_state(c, B, self.n_ctx, self._kv_row)
        if kv_alloc is None:
            try:
                self.k = {i: _zeros(kv_shape, kv_dtype, self.device) for i in c.attention_layers}
                self.v = {i: _zeros(kv_shape, kv_dtype, self.device) for i in c.attention_layers}
            except (MemoryError, torch.OutOfMemoryError, ValueError, RuntimeError):
                # ValueError / RuntimeError: a size no array dimension holds (numpy, torch)
                total = 2 * len(c.attention_layers) * B * self.n_ctx * self._kv_row
                raise OffloadError(
                    f"a KV cache for {self.n_ctx:,} positions needs {total / 2**30:.1f} GiB "
                    f"({2 * len(c.attention_layers) * self._kv_row:,} bytes a position) and "
                    f"{self.device} cannot provide it; lower --ctx") from None
        else:
            if B != 1:
                raise OffloadError("an elastic KV cache holds one sequence (batch 1)")
            self.k, self.v = {}, {}
            try:
                for i in c.attention_layers:
                    for kv in (self.k, self.v):
                        buf = kv_alloc(self.n_ctx * self._kv_row)
                        self._kv_bufs.append(buf)
                        kv[i] = buf.view[:self.n_ctx * self._kv_row].view(kv_dtype).view(kv_shape)
                        buf.view[:buf.mapped].zero_()
            except BaseException:
                self.close()
                raise
        self.conv = {i: torch.zeros(B, c.ssm_conv_dim, c.ssm_d_conv - 1, **f32)
                     for i in c.recurrent_layers}
        self.ssm = {i: torch.zeros(B, c.ssm_n_v_heads, c.ssm_d_state, c.ssm_head_v_dim, **f32)
                    for i in c.recurrent_layers}
        self.n_past = 0
        # this state's row of a StateTable: its buffers' addresses, then its position (`pos` is
        # a view of that last entry, so the row always holds the current position)
        self.columns = table_columns(c)
        addrs = [getattr(self, name)[i].data_ptr() for (name, i) in self.columns]
        self.row = torch.tensor(addrs + [0], dtype=torch.int64).to(self.device)
        self.pos = self.row[-1]
        self.snapshots_on_host = False   # snapshot() into host RAM (set by the offload runtime)
        # speculative decoding (models/mtp.py, generate.SpeculativeDecoder): the MTP layer's KV,
        # its rows written, the trunk's hidden states [m, H] it has not yet seen (positions
        # mtp_past..n_past-1), and the delta-net state after each token of a verify step
        self.mtp_k: torch.Tensor | None = None
        self.mtp_v: torch.Tensor | None = None
        self.mtp_past = 0
        self.mtp_hidden: torch.Tensor | None = None
        self.steps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps_taken = 0   # tokens of the last forward still in the cache, states kept

    # -- elastic KV ---------------------------------------------------------------------------

    @property
    def elastic_kv(self) -> bool:
        return bool(self._kv_bufs)

    @property
    def kv_rows(self) -> int:
        """Positions with memory behind them (n_ctx when the KV is not elastic)."""
        if not self._kv_bufs:
            return self.n_ctx
        return min(self.n_ctx, min(b.mapped for b in self._kv_bufs) // self._kv_row)

    @property
    def kv_mapped(self) -> int:
        """Device bytes the elastic KV maps now (0 when it is not elastic)."""
        return sum(b.mapped for b in self._kv_bufs)

    def kv_bytes(self, rows: int) -> int:
        """Device bytes the elastic KV maps to back `rows` positions."""
        from native.offload_native import mapped_size
        return sum(min(mapped_size(rows * self._kv_row, b.chunk), b.capacity) for b in self._kv_bufs)

    def map_kv(self, rows: int) -> None:
        """Back `rows` positions (at least one chunk, at most n_ctx) with memory, giving back what
        lies beyond; newly mapped rows are zeroed (attention multiplies masked rows by 0)."""
        for b in self._kv_bufs:
            old = b.mapped
            b.resize(min(rows, self.n_ctx) * self._kv_row)
            if b.mapped > old:
                b.view[old:b.mapped].zero_()

    def close(self) -> None:
        """Give back an elastic KV's memory and address space (the state is unusable after)."""
        for b in self._kv_bufs:
            b.close()
        self._kv_bufs = []

    # -- speculative decoding ------------------------------------------------------------------

    def add_mtp_kv(self) -> None:
        """The MTP layer's KV [B, n_ctx, Hkv, X] (one full-attention layer of the trunk's KV
        type; allocated whole)."""
        if self.mtp_k is None:
            c, B = self.config, self.batch
            shape = (B, self.n_ctx, c.n_head_kv, self.kv_type.row_width(c.head_dim))
            self.mtp_k = _zeros(shape, self.kv_type.storage, self.device)
            self.mtp_v = _zeros(shape, self.kv_type.storage, self.device)

    def keep_steps(self, depth: int) -> None:
        """From now on, a forward of 2..depth+1 tokens keeps the delta-net state after each of
        its first `depth` tokens (the state after the last is the live one), so that `rewind`
        can go back to any of them: a verify step's rejected drafts cost no recomputation.
        depth 0 stops it. The buffers are allocated once (fixed addresses for graph capture)."""
        c, B, f32 = self.config, self.batch, dict(dtype=torch.float32, device=self.device)
        if depth <= 0:
            self.steps = {}
        elif not self.steps or next(iter(self.steps.values()))[0].shape[0] < depth:
            self.steps = {i: (torch.zeros(depth, B, c.ssm_conv_dim, c.ssm_d_conv - 1, **f32),
                              torch.zeros(depth, B, c.ssm_n_v_heads, c.ssm_d_state,
                                          c.ssm_head_v_dim, **f32))
                          for i in c.recurrent_layers}
        self.steps_taken = 0

    def rewind(self, n: int) -> None:
        """Drop the last n tokens of the last forward (n < its length): KV rows beyond are
        garbage anyway; the delta-net state goes back to the one kept after its token T-1-n."""
        if n <= 0:
            return
        t = self.steps_taken - 1 - n
        if t < 0:
            raise OffloadError(f"cannot rewind {n} tokens: the last forward kept "
                               f"{self.steps_taken} states")
        # one multi-tensor copy, not 2 launches a layer (60 on the 35B: ~0.3 ms of host time)
        dst = [d for i in self.steps for d in (self.conv[i], self.ssm[i])]
        src = [s[t] for pair in self.steps.values() for s in pair]
        torch._foreach_copy_(dst, src)
        self.n_past -= n
        self.pos.sub_(n)
        self.steps_taken -= n   # a later rewind goes further back from here

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def n_free(self) -> int:
        return self.n_ctx - self.n_past

    def check_room(self, n_new: int) -> None:
        """Fail with a clear message when n_new more tokens do not fit the context."""
        if n_new > self.n_free:
            raise OffloadError(
                f"{self.n_past + n_new} tokens do not fit the context of {self.n_ctx} "
                f"({self.n_past} already used, {n_new} new); shorten the prompt or raise the "
                "context size (--ctx)")

    def attn_len(self, n_new: int) -> int:
        """How many cache rows the next step attends to (n_past + n_new, rounded up to the
        bucket so a captured graph sees a fixed shape; extra rows are masked)."""
        return self.rows_attended(self.n_past + n_new)

    def rows_attended(self, n: int) -> int:
        """n cache rows rounded up to the attention bucket (at most n_ctx): what a captured step
        attends to when its last token sits at row n - 1."""
        return min(self.n_ctx, -(-n // self.attn_bucket) * self.attn_bucket)

    def advance(self, n: int) -> None:
        self.n_past += n
        self.pos.add_(n)

    def reset(self) -> None:
        """Back to an empty sequence (buffers are kept and zeroed in place)."""
        for t in (*self.conv.values(), *self.ssm.values()):
            t.zero_()
        self.n_past = 0
        self.pos.zero_()
        self.mtp_past, self.mtp_hidden, self.steps_taken = 0, None, 0

    def snapshot(self) -> Snapshot:
        """A copy of the small recurrent part; with the KV rows below n_past it is the whole state.
        With `snapshots_on_host` (the offload runtime's states) the copy lives in page-locked host
        RAM: ~63 MB a snapshot on a 35B-A3B, which a VRAM cap has no room for."""
        keep = self._host_copy if self.snapshots_on_host and self.device.type == "cuda" else torch.clone
        return Snapshot(self.n_past, {i: keep(t) for i, t in self.conv.items()},
                        {i: keep(t) for i, t in self.ssm.items()}, self.mtp_past,
                        None if self.mtp_hidden is None else self.mtp_hidden.clone())

    @staticmethod
    def _host_copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    def restore(self, snap: Snapshot) -> None:
        """Rewind to a snapshot taken from this state (valid while its KV rows were not rewritten
        by a rewind further back followed by new tokens)."""
        for i, t in snap.conv.items():
            self.conv[i].copy_(t)
        for i, t in snap.ssm.items():
            self.ssm[i].copy_(t)
        self.n_past = snap.n_past
        self.pos.fill_(snap.n_past)
        self.mtp_past, self.mtp_hidden = snap.mtp_past, snap.mtp_hidden
        self.steps_taken = 0

    @property
    def recurrent_nbytes(self) -> int:
        """Bytes of one copy of the delta-net state (conv + ssm of every recurrent layer): what a
        snapshot or a kept step costs."""
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values()))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state for n_ctx positions (an elastic KV maps less: kv_mapped)."""
        ts = (*self.k.values(), *self.v.values(), *self.conv.values(), *self.ssm.values(),
              *(t for t in (self.mtp_k, self.mtp_v) if t is not None),
              *(t for pair in self.steps.values() for t in pair))
        return sum(t.numel() * t.element_size() for t in ts)
