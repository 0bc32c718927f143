"""Captured steps: the one path by which the runtime turns a step into a CUDA graph and replays
it. A decode step is some thousand kernels; launched from Python they would cost several
times their GPU time, replayed as a graph one launch.

A graph is bound to the buffers it was captured on (the States', the inputs' copies), so it is
keyed by what it is bound to (`GraphKey`). A runtime of several sequences hands a step its
States through a table that is one of the inputs (state.StateTable): its graphs are keyed by
the batch size and the longest attended bucket only, and run whichever States the table names.
Capturing costs many steps: it is counted and timed (`captures`, `capture_s`; speculative
decoding's cost estimates skip steps that captured), and the memory it took is measured so
decode keeps that much free beside the expert cache."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class GraphKey:
    """What a captured step is bound to and shaped by."""
    kind: str                    # "decode" (one token a State), "verify", "draft", "mtp_rows"
    states: tuple[int, ...]      # id() of its States, in order; () when a table passes them
    tokens: int                  # tokens a State
    attended: tuple[int, ...]    # KV rows attended, a State each (the MTP layer's for the head);
                                 # through a table, the most any of them attends
    detail: tuple = ()           # verify: (keeps delta-net steps, their depth); draft: (k,
                                 # guesses); through a table, the number of States first
    guesses: bool = False        # the step guesses the next layer's experts (holds those kernels)


class GraphCache:
    """The captured steps of one runtime, their memory pool, and the cost of capturing them."""

    def __init__(self, device: torch.device, vram, engine, max_graphs: int):
        self.device, self.vram, self.engine, self.max_graphs = device, vram, engine, max_graphs
        self._graphs: dict[GraphKey, tuple] = {}
        self._sizes: set = set()        # decode-step sizes (and modes) captured so far
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0               # graphs captured so far
        self.capture_s = 0.0            # host wall time those captures took

    def replay(self, key: GraphKey, inputs: list, run: Callable, *, step_size=None,
               warm_up: Callable[[list], None] | None = None,
               around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
               before_replay: Callable[[], None] | None = None, bounded: bool = False):
        """run(*inputs) as the graph captured for `key` (captured now if new), replayed on these
        inputs (tensors are copied into the graph's own, ints filled into device scalars) ->
        the graph's outputs (its own tensors: callers clone what they keep).

        Capturing: warm_up(copies) runs it eagerly first (lazy inits, the allocator), the capture
        runs inside around(). A decode step (`step_size`: its tokens, and anything else that
        changes which kernels it runs) is warmed up, and the memory outside torch re-measured,
        only for a size not captured before: its kernels are loaded.
        bounded: all graphs are dropped first once max_graphs are kept (batched steps: a key
        per batch size, attended bucket and guessing mode)."""
        g = self._graphs.get(key)
        if g is None:
            if bounded and len(self._graphs) >= self.max_graphs:
                self.drop()
            new_size = step_size is None or step_size not in self._sizes
            g = self._graphs[key] = self._capture(
                inputs, run, warm_up if new_size else None, around,
                remeasure=step_size is not None and new_size)
            if step_size is not None:
                self._sizes.add(step_size)
        graph, copies, out = g
        for c, x in zip(copies, inputs):
            if isinstance(x, torch.Tensor):
                c.copy_(x)
            else:
                c.fill_(x)
        if before_replay is not None:
            before_replay()
        graph.replay()          # not waited for: the next step's launch queues behind it
        return out

    def _capture(self, inputs: list, run, warm_up, around, remeasure: bool):
        copies = [x.clone() if isinstance(x, torch.Tensor)
                  else torch.full((), x, dtype=torch.long, device=self.device) for x in inputs]
        t0 = time.perf_counter()
        self.vram.before_capture()
        self.vram.reset_torch_peak()
        if warm_up is not None:
            warm_up(copies)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool), around():
            out = run(*copies)
        self.captures += 1
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.vram.after_capture(torch.cuda.max_memory_reserved(self.device)
                                - torch.cuda.memory_reserved(self.device), remeasure=remeasure)
        self.capture_s += time.perf_counter() - t0
        return g, copies, out

    def drop(self, new_kernels: bool = False) -> None:
        """The next steps capture anew (in a new pool: a pool whose graphs are all gone cannot be
        captured into again); `new_kernels`: they run kernels no step has run yet (recording,
        replayed routing, guesses), so each size is warmed up again before its capture."""
        if new_kernels:
            self._sizes.clear()
        self.engine.settle()
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None
