"""CPU forwards of a few tokens in one native call (native/csrc/cpu/decode_loop.cpp).

Qwen35Moe.forward on the CPU makes about ten kernel calls a layer from Python, with tensors
allocated between them. For a few tokens of one sequence (B = 1, T <= MAX_TOKENS: a decode
token, a speculative verify step of T = k+1, a short prompt) `native._cpu.DecodePlan` runs the
whole forward -- every layer, the final norm and the head -- in one call with the GIL released,
calling the same kernels in the same order with the same arguments, so its logits (and, with
hidden=True, the final-normed hidden states) are the per-op path's bits. The T rows go through
the norms, projections, router and experts together; the mixers take them as the per-op path
does: attention all T in one call, the delta-net all T in one call, or with kept steps
(State.keep_steps, 2 <= T <= depth+1) one token at a time, the conv/ssm states after each of the
first T-1 written to State.steps. A plan is built once per (model, State) from the raw pointers
of the weights and of the State's conv/ssm/KV tensors, and kept while the State lives; the kept
steps' pointers follow State.steps (set_steps when it is another dict).
Qwen35Moe.decode_many (a token for each of B single-sequence States) runs in one call as well:
`DecodePlan.run_many` over the States' plans mirrors its per-op path (`plan_many_for`). So does
the MTP draft head's block after its input projection (`mtp_plan_for`: a one-layer plan of the
MTP block over the State's MTP KV, `DecodePlan.run_hidden` from the residual stream MtpHead
computes; its norms and eh_proj stay torch's).

`plan_for` returns None wherever the per-op path must run: another device, a batch, step
kernels off (`instrument.switches.STEP_KERNELS`), native kernels off, experts other than the plain
host-resident `ResidentExperts`, a weight or state the CPU kernels do not take as they stand
(then the per-op path would not call them either); Qwen35Moe.forward takes the per-op path for
T > MAX_TOKENS as well.
`instrument.switches.CPU_PLAN = False` (env FTPATCH_DECODE_LOOP=0) forces the per-op path: tests
and A/B timings.
"""
from __future__ import annotations

import operator

import torch

from native import ops
from native.errors import NativeError
from native.ops import QTensor

from ..instrument import switches
from . import layers
from .names import ATTN_IN, ROUTER, SHEXP_IN, SSM_IN
from .weights import ResidentExperts


def max_tokens() -> int:
    """The most tokens of one sequence a native call takes (0: an extension without run_tokens)."""
    return getattr(getattr(ops._cpu, "DecodePlan", None), "MAX_TOKENS", 0)


class _PerOp(Exception):
    """Something the plan does not mirror: the per-op path runs."""


class DecodeLoop:
    """One (model, State)'s native plan; call it with tokens [1, T] (T <= MAX_TOKENS) -> (logits
    [1, T (1 with last_only), V], the final-normed hidden states [1, T, H] or None)."""

    def __init__(self, plan, keep: list, n_vocab: int, n_embd: int, step_shapes: dict):
        self.plan, self.n_vocab, self.n_embd = plan, n_vocab, n_embd
        self._keep = keep                 # what the plan points to, kept alive
        self._step_shapes = step_shapes   # layer -> the shapes of one kept (conv, ssm) state
        self._steps = None                # the State.steps the plan points to (kept alive here)

    def follow_steps(self, steps: dict) -> bool:
        """Point the plan at State.steps (another dict than last time: keep_steps reallocated or
        dropped them); False if they are not what the plan can write (the per-op path runs)."""
        if steps is self._steps:
            return True
        depth = next(iter(steps.values()))[0].shape[0] if steps else 0
        ptrs = []
        for i in range(len(self._step_shapes)):
            shapes = self._step_shapes[i]
            if shapes is None or not depth:
                ptrs.append((0, 0))
                continue
            pair = steps.get(i)
            if pair is None or not all(
                    t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                    and tuple(t.shape) == (depth, *shape) for t, shape in zip(pair, shapes)):
                return False
            ptrs.append((pair[0].data_ptr(), pair[1].data_ptr()))
        self.plan.set_steps(ptrs, depth)
        self._steps = steps
        return True

    def __call__(self, tokens: torch.Tensor, state, keep: bool = False, last_only: bool = False,
                 hidden: bool = False):
        T = tokens.shape[-1]
        logits = torch.empty(1, 1 if last_only else T, self.n_vocab, dtype=torch.float32)
        h = torch.empty(1, T, self.n_embd, dtype=torch.float32) if hidden else None
        self.plan.run_tokens(tokens.reshape(-1).tolist(), state.n_past, state.attn_len(T), keep,
                             last_only, logits.data_ptr(), 0 if h is None else h.data_ptr())
        return logits, h


class MtpLoop:
    """An MtpHead's plan for one State: call it with its residual stream x [T, H] (after eh_proj)
    -> (logits [1, T or 1, V] or None, the head's normed states g [1, T, H])."""

    def __init__(self, plan, keep: list, n_vocab: int, n_embd: int):
        self.plan, self._keep, self.n_vocab, self.n_embd = plan, keep, n_vocab, n_embd

    def __call__(self, x: torch.Tensor, pos: int, n_attn: int, logits: str):
        T = x.shape[0]
        lg = None if logits == "none" else \
            torch.empty(1, T if logits == "all" else 1, self.n_vocab, dtype=torch.float32)
        g = torch.empty(1, T, self.n_embd, dtype=torch.float32)
        self.plan.run_hidden(x.data_ptr(), T, pos, n_attn, logits != "all",
                             0 if lg is None else lg.data_ptr(), g.data_ptr())
        return lg, g


def mtp_plan_for(head, state) -> MtpLoop | None:
    """The plan of MtpHead `head`'s block on `state`'s MTP KV (state.add_mtp_kv first), built on
    first use; None: use the per-op path."""
    model = head.model
    if not (switches.CPU_PLAN and switches.STEP_KERNELS and max_tokens()
            and hasattr(ops._cpu.DecodePlan, "run_hidden") and model.device.type == "cpu"
            and state.batch == 1 and state.mtp_k is not None):
        return None
    # a plan holds this extension's, these experts' and this KV's pointers
    key = (ops._cpu, head.experts, state.mtp_k, state.mtp_v)
    return _plan_of(head._loops, state, key, lambda: _build(model, state, head))


class ManyLoop:
    """decode_many's native call over its States' plans: tokens [B] -> logits [B, V]."""

    def __init__(self, loops: list[DecodeLoop]):
        self.loops = loops

    def __call__(self, tokens: torch.Tensor, states) -> torch.Tensor:
        logits = torch.empty(len(states), self.loops[0].n_vocab, dtype=torch.float32)
        ops._cpu.DecodePlan.run_many([loop.plan for loop in self.loops], tokens.tolist(),
                                     [st.n_past for st in states], [st.attn_len(1) for st in states],
                                     logits.data_ptr())
        return logits


def plan_many_for(model, states) -> ManyLoop | None:
    """decode_many's loop over `states` (one plan each, see loop_for); None: use the per-op path
    (also where any state's token would take it, or for more states than a call takes)."""
    plan = getattr(ops._cpu, "DecodePlan", None)
    if not (hasattr(plan, "run_many") and len(states) <= plan.MAX_SEQUENCES):
        return None
    loops = [plan_for(model, st) for st in states]
    return None if any(loop is None for loop in loops) else ManyLoop(loops)


def plan_for(model, state) -> DecodeLoop | None:
    """The decode loop of (model, state), built on first use; None: use the per-op path."""
    if not (switches.CPU_PLAN and switches.STEP_KERNELS and max_tokens() and model.device.type == "cpu"
            and state.batch == 1):
        return None
    key = (ops._cpu, *model.experts)   # a plan holds this extension's and these experts' pointers
    loop = _plan_of(model._cpu_plans, state, key, lambda: _build(model, state))
    return loop if loop is not None and loop.follow_steps(state.steps) else None


def _plan_of(loops, state, key: tuple, build):
    """loops[state]'s plan, built by build() on first use or when what it points to (the objects
    in `key`) changed; None where the per-op path must run (remembered as well)."""
    hit = loops.get(state)
    if hit is None or len(hit[0]) != len(key) or not all(map(operator.is_, hit[0], key)):
        try:
            loop = build()
        except (_PerOp, KeyError):   # KeyError: a tensor the per-op path would miss as well
            loop = None
        hit = loops[state] = (key, loop)
    return hit[1]


def _build(model, state, mtp=None) -> DecodeLoop | MtpLoop:
    """The trunk's plan on `state`, or with `mtp` (an MtpHead) its block's on the State's MTP KV."""
    c, keep = model.config, []
    H, d = c.n_embd, c.head_dim
    if mtp is None:
        blocks, experts, recurrent = model.blk, model.experts, c.recurrent
        k_caches, v_caches = state.k, state.v
        embd, out_norm, head = model.embd, model.out_norm, model.head
    else:
        blocks, experts, recurrent = [mtp.L], [mtp.experts], [False]
        k_caches, v_caches = {0: state.mtp_k}, {0: state.mtp_v}
        embd, out_norm, head = mtp.embd, mtp.norm, mtp.head

    def mat(w, n_in: int) -> tuple:   # what ops.matmul / matmul_many pass for w, or _PerOp
        arg = ops._cpu_weight(w) if isinstance(w, QTensor) else None
        if arg is None or arg[4] != n_in:
            raise _PerOp
        keep.append(w)
        return arg[:4]

    def f32(t: torch.Tensor, numel: int | None = None) -> int:   # a host float32 buffer's address
        if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
                and t.is_contiguous() and (numel is None or t.numel() == numel)):
            raise _PerOp
        keep.append(t)
        return t.data_ptr()

    def kv_caches(kc: torch.Tensor, vc: torch.Tensor, d: int) -> dict:   # host caches of a KV type
        try:
            kvt = ops._cpu_caches(kc, vc, d, "decode loop")   # what the C++ mixer takes
        except NativeError:
            raise _PerOp from None
        keep.extend((kc, vc))
        return dict(k_cache=kc.data_ptr(), v_cache=vc.data_ptr(), kv_type=kvt.code)

    if any("+" in k for L in blocks for k in L):   # fused projections (a GPU upload)
        raise _PerOp
    layer_args, step_shapes = [], {}
    for i, L in enumerate(blocks):
        step_shapes[i] = ((1, *state.conv[i].shape[1:]), (1, *state.ssm[i].shape[1:])) \
            if recurrent[i] else None
        a = dict(recurrent=bool(recurrent[i]), attn_norm=f32(L["attn_norm.weight"], H),
                 post_norm=f32(L["post_attention_norm.weight"], H))
        if recurrent[i]:
            hv_dv = c.ssm_n_v_heads * c.ssm_head_v_dim
            conv_w = L["ssm_conv1d.weight"]
            a.update(mixer_in=[mat(L[n], H) for n in SSM_IN], mixer_out=mat(L["ssm_out.weight"], hv_dv),
                     conv_state=f32(state.conv[i]), conv_w=f32(conv_w), conv_kc=int(conv_w.shape[1]),
                     ssm_state=f32(state.ssm[i]), ssm_a=f32(L["ssm_a"]), dt_bias=f32(L["ssm_dt.bias"]),
                     ssm_norm=f32(L["ssm_norm.weight"]))
        else:
            if d % 16:   # gated_attention runs torch then
                raise _PerOp
            names = ("attn_qkv.weight",) if "attn_qkv.weight" in L else ATTN_IN
            a.update(mixer_in=[mat(L[n], H) for n in names],
                     mixer_out=mat(L["attn_output.weight"], c.n_head * d),
                     q_norm=f32(L["attn_q_norm.weight"], d), k_norm=f32(L["attn_k_norm.weight"], d),
                     **kv_caches(k_caches[i], v_caches[i], d))
        ex = experts[i]
        banks = ops._cpu_banks(ex.gate, ex.up, ex.down) if type(ex) is ResidentExperts else None
        if banks is None or banks[2] != H:
            raise _PerOp
        keep.append(ex)
        e, f, _, bank = banks
        a.update(gate=tuple(bank[0:3]), up=tuple(bank[3:6]), down=tuple(bank[6:9]), n_ff=f, n_bank_experts=e)
        if SHEXP_IN[0] in L:   # Qwen35Moe._moe's CPU branch: router, shared gate, gate, up in one call
            a.update(ffn_in=[mat(L[n], H) for n in ROUTER + SHEXP_IN])
            a.update(shared_down=mat(L["ffn_down_shexp.weight"], a["ffn_in"][2][2]))
        else:
            a.update(ffn_in=[mat(L[ROUTER[0]], H)])
        layer_args.append(a)
    if not (embd.device.type == "cpu" and embd.data.dim() == 2
            and ops._ext_supports(ops._cpu, embd.qtype, "dequantize", H)):
        raise _PerOp
    keep.append(embd)
    inv_freq = ops.rope_inv_freq(c.n_rot, c.rope_base)
    model_args = dict(
        n_embd=H, n_vocab=int(head.shape[0]), eps=c.rms_eps, n_expert=c.n_expert,
        top_k=c.n_expert_used, expert_floor=layers.EXPERT_WEIGHT_FLOOR, ssm_hk=c.ssm_n_k_heads,
        ssm_hv=c.ssm_n_v_heads, ssm_dk=c.ssm_d_state, ssm_dv=c.ssm_head_v_dim, n_head=c.n_head,
        n_head_kv=c.n_head_kv, head_dim=d, n_rot=c.n_rot, n_ctx=state.n_ctx, inv_freq=f32(inv_freq),
        embd=(embd.qtype.type_id, embd.data.data_ptr(), embd.row_bytes), out_norm=f32(out_norm, H),
        head=mat(head, H))
    plan = ops._cpu.DecodePlan(model_args, layer_args)
    if mtp is not None:
        return MtpLoop(plan, keep, model_args["n_vocab"], H)
    return DecodeLoop(plan, keep, model_args["n_vocab"], H, step_shapes)
