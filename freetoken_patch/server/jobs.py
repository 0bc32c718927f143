"""What the routes and the engine pass each other -- a Job, the Failure it may receive, the two
refusals of a submit -- and what the engine keeps for each job it admitted (Active)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from moe_offload import SERVING, SamplingParams, TokenStream




class QueueFull(Exception):
    """The queue holds --queue requests already."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


@dataclass(frozen=True)
class Failure:
    """What a job receives instead of a DoneEvent when its sequence failed."""
    message: str
    status: int = 500


@dataclass(eq=False)
class Job:
    """One request: its prompt ids and sampling, and where its events go (an asyncio queue of
    the loop that waits for them: TokenEvent*, then DoneEvent or Failure)."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    n_cached: int = 0                 # prompt tokens taken from a cached prefix
    text: str | None = None           # the prompt's text (chat), when its ids encode it whole
    head_s: float = 0.0               # time to prefill the first turn apart (Engine._admit)
    encode: object = None             # text -> ids of the prompt's end (RenderedPrompt's
                                      # encode_suffix: client text kept out of control ids)
    constraint: object = None         # moe_offload TokenConstraint: the ids each draw may take
    echo_logprobs: int | None = None  # the prompt's own logprobs (completions' echo), top n
    prompt_logprobs: list | None = None   # ... the engine's answer: TokenLogprob of prompt[1:]
    token_logprobs: list = field(default_factory=list)   # the reply's TokenLogprob, in order
    n_generated: int = 0              # tokens generated, once done (the access log)
    error: str | None = None          # the failure's message (the access log)

    def echoed_logprobs(self) -> list:
        """A completion's echoed prompt as completion_logprobs takes it: the first id bare (it
        has no logprob), then the logprob of each later one."""
        return [self.prompt[0]] + list(self.prompt_logprobs or [])

    def __post_init__(self):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.events is None:
            self.events = asyncio.Queue()

    def cancel(self) -> None:
        """The client left: the engine drops the sequence at its next step."""
        self.cancelled = True

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:              # the loop is closed: nobody is listening
            self.cancelled = True


@dataclass(eq=False)
class Active:
    """An admitted job: its State, the ids in it, rewind points, and how far it got."""
    job: Job
    state: object
    history: list[int]                # ids already in the state when it started
    feed: list[int]                   # prompt ids this sequence prefills
    snaps: list
    gen: object = None                # interleaved: the generate() stream
    stream: TokenStream | None = None  # batched: sampling and stops, fed logits from outside
    fed: int = 0                      # batched: prompt ids of `feed` already prefilled
    cuts: list = field(default_factory=list)   # batched: keep a snapshot when `fed` reaches one
    sampled: list[int] = field(default_factory=list)
    done: bool = False

    def cached_tokens(self) -> list[int]:
        """The ids the state holds now (the last sampled id is never fed)."""
        return (self.history + self.feed + self.sampled)[:self.state.n_past]

    def cached_text(self, tokenizer) -> str | None:
        """The text of cached_tokens(): the prompt's and the fed reply ids' (None: unknown)."""
        fed = self.state.n_past - len(self.job.prompt)
        if self.job.text is None or tokenizer is None or fed < 0:
            return None
        return self.job.text + tokenizer.decode(self.sampled[:fed])


def with_snapshot(snaps: list, state) -> list:
    """`snaps` and a snapshot of `state` now, the oldest dropped past SERVING.snapshots."""
    return (snaps + [state.snapshot()])[-SERVING.snapshots:]
