"""The MTP (NextN) draft head of qwen35moe.

From the trunk's final-normed hidden state h_t of token t and the embedding of token t+1, one
full-attention + MoE block with its own weights (blk.{n_layer}) and its own KV cache guesses
token t+2:

    x = eh_proj · [rms_norm(emb(t+1)) ⊙ enorm ; rms_norm(h_t) ⊙ hnorm]     (embedding first)
    x = x + Attn(rms_norm(x) ⊙ attn_norm);  x = x + MoE(rms_norm(x) ⊙ post_attention_norm)
    g = rms_norm(x) ⊙ (shared_head_norm or output_norm);  logits = (shared_head_head or output) · g

The MTP row of h_t sits at position t of the MTP layer's KV (`State.mtp_k/v`, `State.mtp_past`
rows written): RoPE only sees differences of positions, so any fixed offset would do. To draft
further than one token the head is chained on itself: g (the same kind of vector as the trunk's
final-normed hidden state) stands in for h of the drafted token.

The block is the trunk model's own block stack (`Qwen35Moe.blocks`, one layer with attention
over the MTP KV), and its routed experts are an injected callable like any layer's: the
offload runtime can put them where it likes.
"""
from __future__ import annotations

import weakref

import torch

from native import ops
from native.ops import QTensor

from ..errors import OffloadError
from ..state import State
from . import cpu_plan
from .layers import embed_rows, rms_norm
from .weights import Experts, upload_mtp


def _mm(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    return ops.matmul(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


class MtpHead:
    """The NextN block beside a trunk model (Qwen35Moe or anything with its `blocks`,
    `_attention`, `embd`, `head`, `out_norm`). tensors: the block's weights keyed by the name after
    "blk.N." ("attn_q.weight", "nextn.eh_proj.weight", ...)."""

    def __init__(self, model, tensors: dict, experts: Experts):
        missing = [n for n in ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                               "attn_norm.weight", "post_attention_norm.weight") if n not in tensors]
        if missing:
            raise OffloadError(f"the MTP block lacks {', '.join(missing)}")
        self.model, self.config, self.L, self.experts = model, model.config, tensors, experts
        self.embd: QTensor = tensors.get("nextn.embed_tokens.weight", model.embd)
        self.head: QTensor = tensors.get("nextn.shared_head_head.weight", model.head)
        self.norm: torch.Tensor = tensors.get("nextn.shared_head_norm.weight", model.out_norm)
        self.device = model.device
        self._loops = weakref.WeakKeyDictionary()   # State -> its CPU plan (cpu_plan.mtp_plan_for)

    @classmethod
    def load(cls, loaded, model, experts_device: torch.device | str | None = None
             ) -> "MtpHead | None":
        """The file's MTP block on the model's device (experts on `experts_device`, default the
        same), or None when the file has none."""
        up = upload_mtp(loaded, model.device, experts_device)
        return None if up is None else cls(model, *up)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State,
                logits: str = "all", *, at: torch.Tensor | None = None,
                n_attn: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """hidden [B, T, H] (the trunk's final-normed states of positions p..p+T-1, p =
        state.mtp_past), tokens [B, T] (the tokens at p+1..p+T) -> (draft logits for p+2..p+T+1:
        [B, T, V] with logits="all", [B, 1, V] with "last", None with "none"; the head's normed
        states g [B, T, H]). Writes T MTP KV rows. For a captured graph: `at` (a device scalar)
        gives p on the device instead of the host's count, and `n_attn` (>= p + T) the KV rows
        attended, rows past each token's position masked."""
        c, L = self.config, self.L
        B, T = tokens.shape
        H, eps = c.n_embd, c.rms_eps
        state.add_mtp_kv()
        p = state.mtp_past
        if p + T > state.n_ctx:
            raise OffloadError(f"the MTP layer's KV holds {state.n_ctx} positions; {p + T} needed")
        e = embed_rows(self.embd, tokens)
        z = torch.cat((rms_norm(e.float(), L["nextn.enorm.weight"], eps),
                       rms_norm(hidden.reshape(B * T, H).float(), L["nextn.hnorm.weight"], eps)), -1)
        x = _mm(z, L["nextn.eh_proj.weight"]).contiguous()          # the residual stream [N, H]
        loop = cpu_plan.mtp_plan_for(self, state) \
            if B == 1 and at is None and 1 <= T <= cpu_plan.max_tokens() else None
        if loop is not None:   # the rest in one native call on the CPU, the same bits
            lg, g = loop(x, p, n_attn or p + T, logits)
            state.mtp_past = p + T
            return lg, g
        pos = torch.arange(T, device=self.device) + (p if at is None else at)
        n = n_attn or p + T

        def attention(L_, a):
            return self.model._attention(L_, a, state.mtp_k, state.mtp_v, pos, n)

        g = self.model.blocks(x, [(L, attention, self.experts)], self.norm, B, T).view(B, T, H)
        state.mtp_past = p + T
        if logits == "none":
            return None, g
        return _mm(g if logits == "all" else g[:, -1:], self.head), g


def greedy_drafts(head, hidden: torch.Tensor, tokens: torch.Tensor, state: State, k: int, *,
                  at: torch.Tensor | None = None, n_attn: int | None = None,
                  known=None) -> torch.Tensor:
    """k greedy draft ids [k] on the device, no host sync: head.forward on the trunk's hidden
    states it is owed (hidden [1, T, H], the tokens after them [1, T]), then k - 1 times on its
    own last state and draft (each argmax feeds the next call). state.mtp_past ends at p + T:
    the drafts' KV rows are provisional. `at`, `n_attn`: as MtpHead.forward's (a captured graph
    reads p on the device; the chained calls sit at p + T, p + T + 1, ...). known(ids): called
    once, before the call that drafts the last token, with the verify step's ids known by then
    ([t_n, d_1 .. d_{k-1}], on the device: t_n is tokens' last), so that work for them can run
    beside that call."""
    T = tokens.shape[1]

    def step(h, toks, offset):   # `at` and `n_attn` only when given: any head with forward() will do
        kw = {} if n_attn is None else {"n_attn": n_attn}
        if at is not None:
            kw["at"] = at + offset if offset else at
        return head.forward(h, toks, state, logits="last", **kw)

    base, out, g = state.mtp_past + T, [], None
    for i in range(k):
        if known is not None and i == k - 1:
            known(torch.cat([tokens[0, -1:]] + out))
        lg, g = step(hidden, tokens, 0) if i == 0 else step(g[:, -1:], out[-1][None], T + i - 1)
        out.append(lg[0, -1].argmax(-1, keepdim=True))
    state.mtp_past = base
    return torch.cat(out)
