"""The runtime's sequences: the States it hands out (one, or up to max_sequences, each beyond
the first made on demand with room taken from the expert cache), and what emptying one gives
back (its KV's memory, at the next decode step)."""
from __future__ import annotations

import torch

from native import offload_native as on

from ..errors import OffloadError
from ..state import State


class StatePool:
    """States by key (`states`, shared with the elastic VRAM plan, which sizes around them)."""

    def __init__(self, states: dict[int, State], opts, config, device: torch.device, vram):
        self.states, self.opts, self.config, self.device, self.vram = states, opts, config, device, vram
        self.in_use: set[int] = set()

    def new_state(self, batch: int = 1, n_ctx: int | None = None) -> State:
        """An emptied single-sequence state. With max_sequences = 1 it is always the same one
        (its KV budgeted at start; the captured graphs are bound to its buffers); with more, a
        state not handed out yet while fewer than max_sequences exist (room made in the cache),
        then the first one again: callers that hold several give back the ones they are done
        with (`release`)."""
        opts = self.opts
        n = n_ctx or opts.n_ctx
        if n > opts.n_ctx:
            raise OffloadError(f"a context of {n} needs more VRAM than was budgeted for "
                               f"{opts.n_ctx}; restart with --ctx {n}")
        if batch != 1:
            raise OffloadError("the offload runtime's states hold one sequence each; step several "
                               "together with decode_many")
        st = next((s for k, s in self.states.items() if k not in self.in_use), None)
        if st is None and len(self.states) < opts.max_sequences:
            st = self._add()
        if st is None:
            raise OffloadError(f"all {opts.max_sequences} sequences this runtime holds are in "
                               "use; release one, or open it with more (max_sequences, --parallel)")
        if opts.max_sequences > 1:
            self.in_use.add(self.key_of(st))
        self.empty(st)
        return st

    def release(self, state: State) -> None:
        """A state handed out by new_state is free again (its KV memory goes back to the cache)."""
        self.in_use.discard(self.key_of(state))
        self.empty(state)

    def key_of(self, state: State) -> int:
        for k, s in self.states.items():
            if s is state:
                return k
        raise OffloadError("this state does not belong to this runtime (use its new_state)")

    def _add(self) -> State:
        """One more sequence's state: its delta-net state from torch and its elastic KV, the
        cache shrunk first so both fit under the cap beside decode's headroom."""
        opts, first = self.opts, self.states[0]
        recurrent = first.recurrent_nbytes
        kv = first.kv_bytes(1) if first.elastic_kv else first.nbytes - recurrent
        self.vram.keep_free("another sequence", recurrent + kv + self.vram.decode_headroom)
        st = State(self.config, 1, opts.n_ctx, self.device, opts.kv_type, opts.policy.graph_bucket,
                   kv_alloc=on.ElasticBuffer if first.elastic_kv else None)
        st.snapshots_on_host = True
        self.states[len(self.states)] = st
        self.vram.cap_torch()
        return st

    def empty(self, st: State) -> None:
        st.reset()
        if st.elastic_kv and st.kv_rows > 1:   # an empty conversation: the KV's memory goes back
            torch.cuda.synchronize(self.device)   # to the cache at the next decode step
            st.map_kv(1)
            self.vram.cap_torch()
            self.vram.grow_pending = True

    def close(self) -> None:
        for st in self.states.values():
            st.close()
        self.states.clear()
