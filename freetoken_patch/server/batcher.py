"""The batched mode's step, owned by the engine: every sequence that is decoding advances by one
token in one `model.decode_many` call (a layer's experts read, or fetched, once for the batch),
and a newcomer's prompt goes in by pieces, one a step, so a prompt does not stall the running
streams: `prefill_chunk` tokens, or, for a prompt the backend runs as decode-sized steps, as
many as fill the step beside the decoding rows (`Backend.prompt_piece`,
`Backend.decode_many_with_prompt`: under a cap one step for both). Each sequence samples from
its own row with its own TokenStream (moe_offload's, generate()'s own): seed, penalties and
stops as alone.

A step's States go in one fixed order (the order they were first seen in), and with run_ahead
(on a GPU) the next step is queued on the drawn ids before the host reads them, as generate()
does for one sequence. The batcher reports back through its engine: `fail`,
`finished`, `retire`, and the engine's counters."""
from __future__ import annotations

import time
from collections import deque

import torch

from moe_offload import TokenEvent, TokenReadback, TokenStream

from .jobs import Active, Job, with_snapshot


class Batcher:
    """The batched step of `engine`'s sequences; run_ahead: queue the next step before the
    host reads this one's ids."""

    def __init__(self, engine, run_ahead: bool):
        self.engine, self.model = engine, engine.model
        self.run_ahead = run_ahead
        self.ahead: dict = {}          # sequence -> its logits [1, V] from the step queued ahead
        self.readback = TokenReadback(self.model.device).many
        self._state_order: dict[int, int] = {}

    def admit(self, job: Job, state, history: list[int], snaps: list, cuts: list[int]
              ) -> Active:
        """A newcomer: its prompt goes in by chunks, between decode steps; `cuts` are where
        its prompt keeps rewind points (Engine._rewind_points), a chunk ending at each."""
        seq = Active(job, state, history, job.prompt[len(history):], snaps,
                     cuts=[c - len(history) for c in cuts if c > len(history)])
        seq.stream = TokenStream(job.params, self.model.device, self.engine.tokenizer,
                                 job.prompt, len(seq.feed), constraint=job.constraint)
        return seq

    def forget(self) -> None:
        """A step failed as a whole: no logits queued ahead are valid any more."""
        self.ahead.clear()

    def step(self, ring: deque) -> None:
        """One decode step of every sequence with a token to feed, with the next piece of the
        first newcomer still prefilling beside them (Backend.decode_many_with_prompt); with no
        one decoding, that newcomer's whole prompt first. Finished and cancelled ones leave.

        The step's sequences go in one fixed order (their States', so a batch's rows do not
        move as requests come and go). With run_ahead, the step after this one is queued on
        the ids drawn here before the host reads them whenever only an end-of-generation id
        could end a sequence there and no newcomer is prefilling (its piece goes in the next
        step); its logits wait in `ahead`, and a sequence that did end leaves with that id in
        its State (cached_tokens counts it)."""
        pre = next(self._prefilling(ring), None)
        if pre is not None and not self._live(ring):   # no one waits: the prompt at once
            self._prefill_chunk(pre, alone=True)
            pre = None
        live = self._live(ring)
        if pre is not None and live and all(s in self.ahead for s in live):
            self._prefill_chunk(pre)   # every row comes from the step queued ahead: the piece
            pre = None                 # in a step of its own
        if live:
            with self.engine.timed("decode"):
                rows = self._logits(live, pre)
                if rows is not None:
                    hold = next(self._prefilling(ring), None) is not None
                    self._sample(live, rows, hold)
        for s in [s for s in ring if s.done or s.job.cancelled]:
            self.ahead.pop(s, None)
            ring.remove(s)
            self.engine.retire(s)

    @staticmethod
    def _prefilling(ring: deque):
        """The newcomers whose prompt is not all in yet, first come first."""
        return (s for s in ring if not s.job.cancelled and s.fed < len(s.feed))

    def _live(self, ring: deque) -> list:
        """The sequences with a token to feed, in their States' order."""
        return sorted((s for s in ring if not s.done and not s.job.cancelled
                       and s.stream.pending is not None), key=lambda s: self._order(s.state))

    def _order(self, state) -> int:
        """A State's place in every batch: the order it was first seen in."""
        return self._state_order.setdefault(id(state), len(self._state_order))

    def _logits(self, live: list, rider: Active | None = None) -> list | None:
        """Each sequence's logits [1, V] for its pending id: from the step queued ahead where
        there is one, else from one decode_many step of the others, with the next piece of
        `rider`'s prompt beside them; None if that step failed."""
        rows = {s: self.ahead.pop(s) for s in live if s in self.ahead}
        feed = [s for s in live if s not in rows]
        if feed:
            self.engine.batch_size = len(feed)
            try:
                ids = torch.tensor([s.stream.pending for s in feed], device=self.model.device)
                states = [s.state for s in feed]
                if rider is None:
                    logits = self.model.decode_many(ids, states)                # [B, V]
                else:
                    end = self._piece_end(rider, beside=len(feed))
                    piece = torch.tensor([rider.feed[rider.fed:end]], device=self.model.device)
                    t0 = time.perf_counter()
                    logits, first = self.model.decode_many_with_prompt(ids, states, piece,
                                                                       rider.state)
            except Exception as e:   # noqa: BLE001 -- every state of the step may be half-written
                for s in feed + ([rider] if rider is not None else []):
                    self.engine.fail(s, e)
                return None
            if rider is not None:
                self._fed(rider, end, first, time.perf_counter() - t0)
            rows.update((s, logits[i:i + 1]) for i, s in enumerate(feed))
        return [rows[s] for s in live]

    def _sample(self, live: list, rows: list, hold: bool = False) -> None:
        """Draw every sequence's next id on the device; queue the next step on them if all may
        run ahead and nothing holds it (`hold`: a newcomer's piece goes in that step); then
        read the ids (one wait for all) and pass on what follows."""
        drawn = []
        for s, row in zip(live, rows):
            try:
                drawn.append(s.stream.draw(row))
            except Exception as e:   # noqa: BLE001 -- this request fails, the others go on
                self.engine.fail(s, e)
                drawn.append(None)
        keep = [(s, t) for s, t in zip(live, drawn) if t is not None]
        if not keep:
            return
        n_free = [s.state.n_free for s, _ in keep]   # before a step queued ahead takes a row
        ids = torch.stack([t.reshape(1) for _, t in keep]).reshape(-1)
        ahead = None
        if self.run_ahead and not hold and all(s.stream.may_run_ahead(n)
                                               for (s, _), n in zip(keep, n_free)):
            def queue_next():
                try:
                    self.engine.batch_size = len(keep)
                    return self.model.decode_many(ids, [s.state for s, _ in keep])
                except Exception as e:   # noqa: BLE001 -- reported after this step's ids go out
                    return e
            host, ahead = self.readback(ids, queue_next)
        else:
            host = ids.tolist()
        for (s, _), tok, n in zip(keep, host, n_free):
            try:
                events = s.stream.take(int(tok), n)
            except Exception as e:   # noqa: BLE001
                self.engine.fail(s, e)
                continue
            self._emit(s, events)
        if isinstance(ahead, Exception):   # every state of that step may be half-written
            for s, _ in keep:
                if not s.done:
                    self.engine.fail(s, ahead)
        elif ahead is not None:
            for i, (s, _) in enumerate(keep):
                if not s.done:
                    self.ahead[s] = ahead[i:i + 1]

    def _prefill_chunk(self, seq: Active, alone: bool = False) -> None:
        """Feed the next piece of a newcomer's prompt in a step of its own; at the prompt's end,
        sample its first token. `alone`: no other sequence is waiting for a decode step, so
        the rest of the prompt goes in at once, in the model's own prefill chunks (under a cap
        each chunk streams the cold experts once)."""
        eng = self.engine
        end = self._piece_end(seq, alone)
        t0 = time.perf_counter()
        try:
            ids = torch.tensor([seq.feed[seq.fed:end]], device=self.model.device)
            kw = {} if alone else {"chunk": eng.prefill_chunk}
            logits = self.model.prefill(ids, seq.state, **kw)       # [1, V]
        except Exception as e:   # noqa: BLE001 -- reported to the request, the engine goes on
            eng.fail(seq, e)
            return
        finally:
            took = time.perf_counter() - t0
            eng.busy_s["prefill"] += took
        self._fed(seq, end, logits, took)

    def _piece_end(self, seq: Active, alone: bool = False, beside: int = 0) -> int:
        """Where the next piece of seq's prompt ends: Backend.prompt_piece's size beside
        `beside` decoding sequences (the whole rest when alone), or its next rewind point."""
        start = seq.fed
        end = len(seq.feed) if alone else start + self.model.prompt_piece(
            len(seq.feed) - start, self.engine.prefill_chunk, beside)
        return min([end] + [c for c in seq.cuts if start < c < end])

    def _fed(self, seq: Active, end: int, logits: torch.Tensor, took: float) -> None:
        """seq's prompt is in up to `end` (logits [1, V]: its last position's, `took` seconds):
        a snapshot at a rewind point, and at the prompt's end its first token sampled."""
        seq.stream.prefilled(end - seq.fed, took)
        self.engine.prefilled_tokens += end - seq.fed
        seq.fed = end
        if end in seq.cuts or end == len(seq.feed):   # a rewind point, or the prompt's end
            if not (seq.snaps and seq.snaps[-1].n_past == seq.state.n_past):
                seq.snaps = with_snapshot(seq.snaps, seq.state)
        if end == len(seq.feed):
            self._push(seq, logits)

    def _push(self, seq: Active, logits: torch.Tensor) -> None:
        """Sample the sequence's next token from its logits [1, V] and pass on what follows."""
        try:
            events = seq.stream.push(logits, seq.state.n_free)
        except Exception as e:   # noqa: BLE001 -- this request fails, the others go on
            self.engine.fail(seq, e)
            return
        self._emit(seq, events)

    def _emit(self, seq: Active, events: list) -> None:
        for ev in events:
            if isinstance(ev, TokenEvent):
                seq.sampled.append(ev.token)
            else:
                seq.done = True
                seq.sampled = list(ev.tokens)   # with an end-of-generation id, which the State
                self.engine.finished(seq, ev)  # holds if a step ran ahead on it
            seq.job.put(ev)
