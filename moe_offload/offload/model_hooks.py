"""What the offload runtime hands the model: its experts[layer] callables (decode path inside a
step, prefill path outside), the order of a layer's routed and shared experts (the shared one on
a side stream during decode), and the MTP head's experts held whole where the GPU reads them."""
from __future__ import annotations

import torch

from native import offload_native as on

from .experts import OffloadEngine


class LayerExperts:
    """experts[layer](x, ids, w) for the model: decode path inside a step, else prefill."""

    def __init__(self, engine: OffloadEngine, layer: int):
        self.engine, self.layer = engine, layer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = self.engine
        if e.in_step and x.shape[0] <= e.max_tok:
            return e.decode_layer(self.layer, x, ids, w)
        return e.prefill_layer(self.layer, x, ids, w)


class SharedBeside:
    """The model's moe_pair under the runtime: inside a decode step a layer's shared expert runs
    on a side stream while its routed experts wait on PCIe and the CPU; elsewhere in order."""

    def __init__(self):
        self._side: torch.cuda.Stream | None = None

    def __call__(self, experts, f: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, shared):
        if not (f.is_cuda and isinstance(experts, LayerExperts) and experts.engine.in_step):
            return experts(f, ids, w), shared()
        main = torch.cuda.current_stream(f.device)
        if self._side is None:
            self._side = torch.cuda.Stream(f.device)
        self._side.wait_stream(main)
        f.record_stream(self._side)   # f's memory stays f's until the side stream is done
        with torch.cuda.stream(self._side):
            s = shared()
        y = experts(f, ids, w)
        main.wait_stream(self._side)
        s.record_stream(main)
        return y, s


class ResidentPool:
    """One layer's routed experts held whole where the GPU can read them (the MTP layer's:
    runtime._place_mtp_experts): the decode pool kernel over the bank itself (slot = expert id)
    for up to max_tok tokens -- no host sync, no allocation but the output, capturable -- and
    ops.moe_ffn for more (the MTP head catching up on a prompt)."""

    def __init__(self, experts, *, top_k: int, ff: int, max_tok: int):
        self.experts, self.top_k, self.ff, self.max_tok = experts, top_k, ff, max_tok
        g = experts.gate
        self.n_experts = g.shape[0]
        self.banks = tuple((q.qtype.type_id, q.data.data_ptr(), q.expert_stride)
                           for q in (experts.gate, experts.up, experts.down))
        self.scratch = torch.empty(on.moe_scratch_bytes(max_tok, top_k, ff, g.shape[2]),
                                   dtype=torch.uint8,
                                   device=g.device if g.device.type == "cuda" else "cuda")

    def capturable(self, n_tok: int) -> bool:
        """Whether a call on n_tok tokens runs on the device alone (a CUDA graph may hold it)."""
        return n_tok <= self.max_tok and self.experts.gate.device.type == "cuda"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.capturable(x.shape[0]):
            return self.experts(x, ids, w)
        x = x.float().contiguous()
        y = torch.empty_like(x)
        on.pool_moe_ffn(x, ids.to(torch.int32).contiguous(), w.float().contiguous(), self.banks,
                        self.n_experts, y, self.scratch, top_k=self.top_k, ff=self.ff)
        return y
