"""Log probabilities of tokens, as OpenAI's `logprobs` reports them: the model's own
distribution (log-softmax of the raw logits, before penalties, filters, temperature or a
constraint's mask), the chosen id's and the n likeliest."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SERVING


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()    # the n likeliest (id, logprob), likeliest first


def logprob_rows(logits: torch.Tensor, chosen: torch.Tensor, n_top: int) -> torch.Tensor:
    """logits [B, V], chosen ids [B] -> [B, 1 + 2 n_top] float32 on their device: the chosen
    id's logprob, then the top n's logprobs, then their ids (as floats: exact below 2**24)."""
    lp = torch.log_softmax(logits.float(), -1)
    out = [lp.gather(-1, chosen.reshape(-1, 1).to(lp.device))]
    if n_top:
        vals, ids = lp.topk(min(n_top, lp.shape[-1]), dim=-1)
        out += [vals, ids.float()]
    return torch.cat(out, -1)


def unpack(row, token: int, n_top: int) -> TokenLogprob:
    """One row of logprob_rows (a list of floats) -> TokenLogprob."""
    k = (len(row) - 1) // 2 if n_top else 0
    top = tuple((int(row[1 + k + i]), float(row[1 + i])) for i in range(k))
    return TokenLogprob(int(token), float(row[0]), top)


def prompt_logprobs(backend, state, ids: list[int], n_top: int,
                    chunk: int = SERVING.echo_chunk) -> list[TokenLogprob]:
    """Prefill ids[:-1] into `state` (on top of what it holds) with every position's logits, a
    chunk at a time (memory: chunk x vocabulary floats), and return the logprob of each of
    ids[1:] given the ids before it. The last id is left for the caller to feed (its logits
    are the first generated token's)."""
    out: list[TokenLogprob] = []
    dev = backend.device
    feed = ids[:-1]
    for s in range(0, len(feed), chunk):
        part = feed[s:s + chunk]
        logits = backend.prefill(torch.tensor([part], device=dev), state, all_logits=True)[0]
        nxt = ids[s + 1:s + 1 + len(part)]
        rows = logprob_rows(logits[:len(nxt)], torch.tensor(nxt, device=logits.device), n_top)
        out += [unpack(r, t, n_top) for r, t in zip(rows.tolist(), nxt)]
    return out
