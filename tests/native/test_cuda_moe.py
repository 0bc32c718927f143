"""native._cuda routed-expert FFN: the slot-pool decode path (moe_ffn_pool), the full-bank entry
(moe_ffn, native._cpu's signature), CUDA graph capture and replay, and the native.ops dispatch.

Two references: native.ops.moe_ffn_ref (exact float32, experts not resident masked to -1) and
`moe_ref_hat` below, which rounds each projection's input the way its accumulation type does
(matmul_accum(): "q8" rounds x, and the down input h, to int8 per 32 values) and computes the rest
in float64. Tolerances, relative to max|ref|:
  vs ref_hat: 2e-3 (float32 sums, __expf, rare rounding flips of h at a .5 boundary)
  vs exact:   1e-4 if every projection is f32, else 5e-2 (int8 rounding of x and h; ~1% rms)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loaders.quants import dequantize_reference, iq_tables, quant_type, random_tensor

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

# (gate, up, down): the model's all-IQ3_S, K-quant mixes, differing gate/up types, generic paths.
COMBOS = [("IQ3_S", "IQ3_S", "IQ3_S"), ("Q4_K", "Q4_K", "Q6_K"), ("IQ4_XS", "IQ4_XS", "IQ4_XS"),
          ("Q8_0", "Q5_K", "Q4_0"), ("Q6_K", "IQ3_S", "F16"), ("IQ2_XXS", "IQ2_XXS", "Q3_K")]
E, H, F, K = 6, 512, 256, 4
SLOT_OF_EXPERT = np.array([2, -1, 0, 3, -1, 1], np.int32)  # experts 1 and 4 are not resident
N_SLOTS = 4


def _load_ext():
    import native._cuda as ext
    ext.set_tables(iq_tables())
    return ext


@pytest.fixture(scope="module")
def ext():
    return _load_ext()


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream if DEVICE == "cuda" else 0


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def q8_round(x: np.ndarray) -> np.ndarray:
    """float32 [n, m] -> the int8-per-32 rounding the kernels apply, as float64."""
    g = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


class Bank:
    """One projection of E experts: raw blocks [E, rows, row_bytes] and float64 weights."""

    def __init__(self, name: str, rows: int, cols: int, rng: np.random.Generator):
        self.q = quant_type(name)
        self.rows, self.cols = rows, cols
        self.blocks = random_tensor(self.q, (E * rows, cols), rng).reshape(E, rows, -1)
        self.w = dequantize_reference(self.blocks, self.q, (E, rows, cols)).astype(np.float64)

    @property
    def expert_bytes(self) -> int:
        return self.blocks.shape[1] * self.blocks.shape[2]

    def pool(self, pad: int = 32) -> tuple[torch.Tensor, int]:
        """Slot pool holding the resident experts, slots `pad` bytes longer than an expert."""
        slot_bytes = self.expert_bytes + pad
        pool = np.full((N_SLOTS, slot_bytes), 0xFF, np.uint8)
        for e, s in enumerate(SLOT_OF_EXPERT):
            if s >= 0:
                pool[s, :self.expert_bytes] = self.blocks[e].reshape(-1)
        return _dev(pool), slot_bytes

    def qtensor(self):
        from native.ops import QTensor
        return QTensor(_dev(self.blocks.reshape(E * self.rows, -1)), self.q, (E, self.rows, self.cols))


def _banks(combo, seed: int):
    rng = np.random.default_rng(seed)
    g, u, d = combo
    return Bank(g, F, H, rng), Bank(u, F, H, rng), Bank(d, H, F, rng), rng


def _routing(rng: np.random.Generator, n_tok: int):
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n_tok)]).astype(np.int32)
    if n_tok > 1:
        ids[1, 0] = -1  # a slot the caller masked out
    w = rng.uniform(0.05, 1.0, (n_tok, K)).astype(np.float32)
    return ids, w / w.sum(1, keepdims=True)


def _resident(ids: np.ndarray) -> np.ndarray:
    ok = (ids >= 0) & (ids < E)
    return ok & (SLOT_OF_EXPERT[np.clip(ids, 0, E - 1)] >= 0)


def moe_ref_hat(x, gate, up, down, ids, weights, resident, accum) -> np.ndarray:
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        xg = q8_round(x[t:t + 1])[0] if accum[gate.q.name] == "q8" else x[t].astype(np.float64)
        xu = q8_round(x[t:t + 1])[0] if accum[up.q.name] == "q8" else x[t].astype(np.float64)
        for k in range(K):
            if not resident[t, k]:
                continue
            e = ids[t, k]
            g = (gate.w[e] @ xg).astype(np.float32)
            u = (up.w[e] @ xu).astype(np.float32)
            h = (g / (1 + np.exp(-g.astype(np.float64))) * u).astype(np.float32)
            hh = q8_round(h[None])[0] if accum[down.q.name] == "q8" else h.astype(np.float64)
            out[t] += float(weights[t, k]) * (down.w[e] @ hh)
    return out


def _check(y: np.ndarray, x, gate, up, down, ids, weights, ext, what: str) -> None:
    assert np.isfinite(y).all(), f"{what}: non-finite outputs"
    from native.ops import moe_ffn_ref
    resident = _resident(ids)
    accum = ext.matmul_accum()
    ref_hat = moe_ref_hat(x, gate, up, down, ids, weights, resident, accum)
    scale = np.abs(ref_hat).max()
    assert scale > 0
    err = np.abs(y - ref_hat).max() / scale
    assert err <= 2e-3, f"{what}: error vs rounded reference {err:.3g} of max|ref|"
    masked = np.where(resident, ids, -1).astype(np.int64)
    ref = moe_ffn_ref(_dev(x), gate.qtensor(), up.qtensor(), down.qtensor(), _dev(masked),
                      _dev(weights)).cpu().numpy()
    tol = 1e-4 if all(accum[b.q.name] == "f32" for b in (gate, up, down)) else 5e-2
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= tol, f"{what}: error vs exact reference {err:.3g} of max|ref| (tolerance {tol})"


def _pool_call(ext, x, ids, weights, soe, pools, y, skipped, scratch, n_tok):
    (gp, gs, gt), (up_, us, ut), (dp, ds, dt) = pools
    ext.moe_ffn_pool(x.data_ptr(), n_tok, H, F, ids.data_ptr(), weights.data_ptr(), K,
                     soe.data_ptr(), E, N_SLOTS, gt, gp.data_ptr(), gs, ut, up_.data_ptr(), us,
                     dt, dp.data_ptr(), ds, y.data_ptr(), skipped.data_ptr(), scratch.data_ptr(),
                     scratch.numel(), _stream())


def _pools(gate, up, down):
    out = []
    for b in (gate, up, down):
        p, sb = b.pool()
        out.append((p, sb, b.q.type_id))
    return out


@pytest.mark.parametrize("n_tok", [1, 3, 8])
@pytest.mark.parametrize("combo", COMBOS, ids="-".join)
def test_moe_ffn_pool(ext, combo, n_tok):
    gate, up, down, rng = _banks(combo, seed=n_tok)
    x = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids, weights = _routing(rng, n_tok)
    pools = _pools(gate, up, down)
    xd, idd, wd, soe = _dev(x), _dev(ids), _dev(weights), _dev(SLOT_OF_EXPERT)
    y = torch.full((n_tok, H), float("nan"), device=DEVICE)
    skipped = torch.full((n_tok, K), 7, dtype=torch.int32, device=DEVICE)
    scratch = torch.full((ext.moe_scratch_bytes(n_tok, K, F, H),), 0xFF, dtype=torch.uint8, device=DEVICE)
    _pool_call(ext, xd, idd, wd, soe, pools, y, skipped, scratch, n_tok)
    _sync()
    assert np.array_equal(skipped.cpu().numpy(), (~_resident(ids)).astype(np.int32))
    _check(y.cpu().numpy(), x, gate, up, down, ids, weights, ext, f"{combo} T={n_tok}")


@pytest.mark.parametrize("blocking", [0, 2], ids=["blocks-where-they-pay", "blocks-always"])
@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[4]], ids="-".join)
def test_moe_ffn_pool_tokens_equal_each_alone(ext, combo, blocking):
    """8 tokens over 6 experts (each expert chosen by several tokens, read once for all of them)
    give each token bit for bit what it gets alone: a verify step's or a batch's tokens agree
    with decode steps (also where each lane decodes its unit for two rows at once)."""
    before = ext.row_blocking()
    ext.set_row_blocking(blocking)
    try:
        _tokens_equal_each_alone(ext, combo)
    finally:
        ext.set_row_blocking(before)


def _tokens_equal_each_alone(ext, combo):
    gate, up, down, rng = _banks(combo, seed=41)
    n_tok = 8
    pools = _pools(gate, up, down)
    x = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids, weights = _routing(rng, n_tok)
    xd, idd, wd, soe = _dev(x), _dev(ids), _dev(weights), _dev(SLOT_OF_EXPERT)
    scratch = torch.empty(ext.moe_scratch_bytes(n_tok, K, F, H), dtype=torch.uint8, device=DEVICE)
    skipped = torch.zeros(n_tok, K, dtype=torch.int32, device=DEVICE)
    y = torch.full((n_tok, H), float("nan"), device=DEVICE)
    _pool_call(ext, xd, idd, wd, soe, pools, y, skipped, scratch, n_tok)
    alone = torch.full((n_tok, H), float("nan"), device=DEVICE)
    for t in range(n_tok):
        _pool_call(ext, xd[t:t + 1], idd[t:t + 1], wd[t:t + 1], soe, pools, alone[t:t + 1],
                   skipped[t:t + 1], scratch, 1)
    _sync()
    assert torch.equal(y, alone), f"tokens differ from their single-token calls: " \
        f"{(y - alone).abs().max().item():.3g}"
    _check(y.cpu().numpy(), x, gate, up, down, ids, weights, ext, f"{combo} grouped")


def test_moe_ffn_pool_skips_a_token_naming_a_slot_twice(ext):
    """A token's K ids are distinct experts; if one names a slot again, that pair is skipped
    (flagged in `skipped`), and the token gets what the call without it gives."""
    gate, up, down, rng = _banks(COMBOS[0], seed=43)
    n_tok = 2
    pools = _pools(gate, up, down)
    x = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids = np.array([[0, 2, 0, 3], [3, 5, 2, 0]], np.int32)   # token 0 names expert 0 twice
    weights = np.full((n_tok, K), 0.25, np.float32)
    xd, wd, soe = _dev(x), _dev(weights), _dev(SLOT_OF_EXPERT)
    scratch = torch.empty(ext.moe_scratch_bytes(n_tok, K, F, H), dtype=torch.uint8, device=DEVICE)
    masked = ids.copy()
    masked[0, 2] = -1
    out = []
    for row in (ids, masked):
        y = torch.full((n_tok, H), float("nan"), device=DEVICE)
        skipped = torch.zeros(n_tok, K, dtype=torch.int32, device=DEVICE)
        _pool_call(ext, xd, _dev(row), wd, soe, pools, y, skipped, scratch, n_tok)
        _sync()
        out.append((y.cpu(), skipped.cpu().numpy()))
    assert out[0][1][0].tolist() == [0, 0, 1, 0] and out[0][1][1].tolist() == [0, 0, 0, 0]
    assert torch.equal(out[0][0], out[1][0])


@pytest.mark.parametrize("combo", COMBOS[:3], ids="-".join)
def test_moe_ffn_full_banks(ext, combo):
    """native._cpu's signature: whole banks, ids < 0 skipped, T = 11 (groups of 8 and 3)."""
    gate, up, down, rng = _banks(combo, seed=11)
    n_tok = 11
    x = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids, weights = _routing(rng, n_tok)
    ids[ids == 1] = -1   # the test's "not resident" experts are plain masked slots here
    ids[ids == 4] = -1
    banks = [(b.q.type_id, _dev(b.blocks), b.expert_bytes) for b in (gate, up, down)]
    y = torch.full((n_tok, H), float("nan"), device=DEVICE)
    xd, idd, wd = _dev(x), _dev(ids), _dev(weights)
    ext.moe_ffn(xd.data_ptr(), n_tok, H, F, E, idd.data_ptr(), wd.data_ptr(), K,
                *[v for t, d, s in banks for v in (t, d.data_ptr(), s)], y.data_ptr(), _stream())
    _sync()
    _check(y.cpu().numpy(), x, gate, up, down, ids, weights, ext, f"{combo} full banks")


@pytest.mark.parametrize("combo", COMBOS[:2], ids="-".join)
def test_moe_ffn_pool_in_two_calls_accumulates(ext, combo):
    """Slot ids given directly (no slot_of_expert), the pairs split over two calls, the second
    with accumulate: the sum of both equals one call over all resident pairs (the offload
    runtime's split: resident experts first, fetched ones once their bytes land)."""
    gate, up, down, rng = _banks(combo, seed=31)
    n_tok = 3
    pools = _pools(gate, up, down)
    x = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids, weights = _routing(rng, n_tok)
    slots = np.where(ids >= 0, SLOT_OF_EXPERT[np.maximum(ids, 0)], -1).astype(np.int32)
    first = (rng.random(slots.shape) < 0.5)
    rows = [np.where(first, slots, -1), np.where(first, -1, slots)]
    xd, wd = _dev(x), _dev(weights)
    scratch = torch.empty(ext.moe_scratch_bytes(n_tok, K, F, H), dtype=torch.uint8, device=DEVICE)
    y = torch.full((n_tok, H), float("nan"), device=DEVICE)
    (gp, gs, gt), (up_, us, ut), (dp, ds, dt) = pools
    for i, row in enumerate(rows):
        r = _dev(row.astype(np.int32))
        ext.moe_ffn_pool(xd.data_ptr(), n_tok, H, F, r.data_ptr(), wd.data_ptr(), K, 0, N_SLOTS,
                         N_SLOTS, gt, gp.data_ptr(), gs, ut, up_.data_ptr(), us, dt, dp.data_ptr(),
                         ds, y.data_ptr(), 0, scratch.data_ptr(), scratch.numel(), _stream(),
                         accumulate=i > 0)
    _sync()
    _check(y.cpu().numpy(), x, gate, up, down, ids, weights, ext, f"{combo} two calls")


def test_moe_ffn_pool_graph_replay(ext):
    """Captured once, replayed with new x, routing and residency written in place."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a device")
    gate, up, down, rng = _banks(COMBOS[0], seed=21)
    n_tok = 2
    pools = _pools(gate, up, down)
    x0 = rng.standard_normal((n_tok, H), dtype=np.float32)
    ids0, w0 = _routing(rng, n_tok)
    xd, idd, wd, soe = _dev(x0), _dev(ids0), _dev(w0), _dev(SLOT_OF_EXPERT)
    y = torch.zeros(n_tok, H, device=DEVICE)
    skipped = torch.zeros(n_tok, K, dtype=torch.int32, device=DEVICE)
    scratch = torch.empty(ext.moe_scratch_bytes(n_tok, K, F, H), dtype=torch.uint8, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture
        _pool_call(ext, xd, idd, wd, soe, pools, y, skipped, scratch, n_tok)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _pool_call(ext, xd, idd, wd, soe, pools, y, skipped, scratch, n_tok)
    for seed in (1, 2):
        r = np.random.default_rng(100 + seed)
        x = r.standard_normal((n_tok, H), dtype=np.float32)
        ids, w = _routing(r, n_tok)
        xd.copy_(_dev(x)), idd.copy_(_dev(ids)), wd.copy_(_dev(w))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = y.clone()
        y.fill_(float("nan"))
        _pool_call(ext, xd, idd, wd, soe, pools, y, skipped, scratch, n_tok)
        torch.cuda.synchronize()
        assert torch.equal(replayed, y), "graph replay differs from an eager run"
        _check(replayed.cpu().numpy(), x, gate, up, down, ids, w, ext, f"graph replay {seed}")


def test_moe_pool_rejects_bad_arguments(ext):
    z = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    p = z.data_ptr()
    with pytest.raises(ValueError):  # T > 8
        ext.moe_ffn_pool(p, 9, H, F, p, p, K, 0, E, N_SLOTS, 21, p, 1 << 20, 21, p, 1 << 20, 21, p,
                         1 << 20, p, 0, p, 1 << 30, _stream())
    with pytest.raises(ValueError):  # scratch too small
        ext.moe_ffn_pool(p, 1, H, F, p, p, K, 0, E, N_SLOTS, 21, p, 1 << 20, 21, p, 1 << 20, 21, p,
                         1 << 20, p, 0, p, 16, _stream())


def test_ops_dispatch_to_cuda(ext):
    """native.ops drives native._cuda with the same code as native._cpu."""
    if DEVICE != "cuda":
        pytest.skip("needs the real extension")
    from native import ops
    if ops._cuda is None:
        pytest.fail("native.ops did not load native._cuda on a CUDA machine")
    gate, up, down, rng = _banks(COMBOS[1], seed=31)
    x = rng.standard_normal((3, H), dtype=np.float32)
    ids, weights = _routing(rng, 3)
    ids[ids == 1] = -1
    ids[ids == 4] = -1
    y = ops.moe_ffn(_dev(x), gate.qtensor(), up.qtensor(), down.qtensor(), _dev(ids), _dev(weights))
    _check(y.cpu().numpy(), x, gate, up, down, ids, weights, ext, "ops.moe_ffn")
    w = gate.qtensor().expert(2)
    ym = ops.matmul(_dev(x), w).cpu().numpy()
    ref = x.astype(np.float64) @ gate.w[2].T
    assert np.abs(ym - ref).max() <= 5e-2 * np.abs(ref).max()
