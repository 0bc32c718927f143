"""native._cuda against the references, for every type of loaders.quants (needs a CUDA device).

Outputs are poisoned with NaN before each run, so a kernel that skips an element fails.
Tolerances (one table per accumulation type, as `native._cuda.matmul_accum()` reports it):
  f32  float32 x, FMA:      |y - ref| <= 1e-5 * sum|w x|   (ref: float64 on the dequantized weights)
  q8   x rounded to int8 per 32 values (d = amax/127):
       against x-hat (the same rounding rebuilt here):  |y - ref_hat| <= 1e-4 * sum|w x_hat|
       against exact x:  |y - ref| <= 6 sigma + 1e-4 * sum|w x|, sigma^2 = sum_j w_j^2 d_j^2 / 12
       (the rounding error of x_j is uniform in +-d_j/2)
dequantize: F32 bit-exact with gguf-py; F16/BF16 = that rounded to nearest even, bit-exact.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loaders.quants import QUANT_TYPES, dequantize_reference, iq_tables, quant_type, random_tensor

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
TYPES = list(QUANT_TYPES)
HOT = ["Q4_K", "Q6_K", "IQ3_S", "IQ4_XS"]


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


def _nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=DEVICE)


def _cols(name: str, units: int) -> int:
    """A row length of `units` 32-weight groups, rounded up to whole blocks."""
    be = max(32, quant_type(name).block_elems)
    return -(-units * 32 // be) * be


# ---- q8 rounding of activations, rebuilt with the kernels' float32 operations -----------------------

def q8_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [n, m] -> (x_hat float64 [n, m], d float64 [n, m] per element)."""
    g = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(g).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    xh = (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
    return xh, np.broadcast_to(d.astype(np.float64), g.shape).reshape(x.shape)


def check_matmul(y: np.ndarray, x: np.ndarray, w: np.ndarray, accum: str, what: str) -> None:
    """y [T, O] from the kernel; x float32 [T, H]; w float64 [O, H] (dequantized)."""
    assert np.isfinite(y).all(), f"{what}: non-finite outputs"
    x64 = x.astype(np.float64)
    ref = x64 @ w.T
    mag = np.abs(x64) @ np.abs(w).T
    if accum == "f32":
        err = np.abs(y - ref) / (1e-5 * mag + 1e-30)
        assert err.max() <= 1, f"{what}: f32 error {err.max():.3g} x tolerance"
        return
    assert accum == "q8", accum
    xh, d = q8_round(x)
    ref_h = xh @ w.T
    err_h = np.abs(y - ref_h) / (1e-4 * (np.abs(xh) @ np.abs(w).T) + 1e-30)
    assert err_h.max() <= 1, f"{what}: q8 error vs rounded x {err_h.max():.3g} x tolerance"
    sigma = np.sqrt((d * d / 12.0) @ (w * w).T)
    err = np.abs(y - ref) / (6 * sigma + 1e-4 * mag + 1e-30)
    assert err.max() <= 1, f"{what}: q8 error vs exact x {err.max():.3g} x tolerance"


# ---- dequantize ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_dequantize_bit_exact(ext, name):
    q = quant_type(name)
    rng = np.random.default_rng(q.type_id)
    rows, cols = 7, _cols(name, 24)
    blocks = random_tensor(q, (rows, cols), rng)
    ref = dequantize_reference(blocks, q, (rows, cols))
    # rows 6 bytes apart from each other beyond the row: exercises src_row_stride
    padded = np.zeros((rows, blocks.shape[1] + 6), np.uint8)
    padded[:, :blocks.shape[1]] = blocks
    for data, stride in ((blocks, blocks.shape[1]), (padded, padded.shape[1])):
        src = _dev(data)
        out = _nan(rows, cols)
        ext.dequantize(q.type_id, src.data_ptr(), rows, cols, stride, out.data_ptr(), 0, _stream())
        _sync()
        got = out.cpu().numpy()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), \
            f"{name}: {(got != ref).sum()} of {ref.size} values differ (stride {stride})"
    for dtype, ggml_id in ((torch.float16, 1), (torch.bfloat16, 30)):
        out = torch.full((rows, cols), float("nan"), dtype=dtype, device=DEVICE)
        src = _dev(blocks)
        ext.dequantize(q.type_id, src.data_ptr(), rows, cols, blocks.shape[1], out.data_ptr(),
                       ggml_id, _stream())
        _sync()
        want = torch.from_numpy(ref).to(dtype)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), f"{name} -> {dtype}"


# ---- matmul (decode: 1..8 tokens) -------------------------------------------------------------------

def _run_matmul(ext, name: str, n_out: int, units: int, n_tok: int, seed: int) -> None:
    q = quant_type(name)
    rng = np.random.default_rng(seed)
    h = _cols(name, units)
    blocks = random_tensor(q, (n_out, h), rng)
    w = dequantize_reference(blocks, q, (n_out, h)).astype(np.float64)
    x = rng.standard_normal((n_tok, h), dtype=np.float32)
    wd, xd, y = _dev(blocks), _dev(x), _nan(n_tok, n_out)
    ext.matmul(q.type_id, wd.data_ptr(), n_out, h, blocks.shape[1], xd.data_ptr(), n_tok,
               y.data_ptr(), _stream())
    _sync()
    check_matmul(y.cpu().numpy(), x, w, ext.matmul_accum()[name],
                 f"{name} O={n_out} H={h} T={n_tok}")


@pytest.mark.parametrize("n_tok", range(1, 9))
@pytest.mark.parametrize("name", TYPES)
def test_matmul_tokens(ext, name, n_tok):
    _run_matmul(ext, name, n_out=67, units=72, n_tok=n_tok, seed=100 + n_tok)


# Row lengths that exercise every chunking: one unit, rows packed 2..32 per chunk, rows of 24
# units (lanes idle), whole chunks, and a partial last chunk.
@pytest.mark.parametrize("units", [1, 3, 8, 16, 24, 32, 40, 64])
@pytest.mark.parametrize("name", TYPES)
def test_matmul_shapes(ext, name, units):
    if _cols(name, units) != 32 * units:
        pytest.skip("not a whole number of blocks")
    _run_matmul(ext, name, n_out=33, units=units, n_tok=3, seed=7 * units)


@pytest.fixture(params=[0, 2], ids=["blocks-where-they-pay", "blocks-always"])
def row_blocking(request, ext):
    """The rows engine's row blocking for several tokens: where it pays (the default), or
    always, so that small shapes take the blocked kernels too."""
    before = ext.row_blocking()
    ext.set_row_blocking(request.param)
    yield request.param
    ext.set_row_blocking(before)


# Rows of 3 units (packed 8 a chunk), 40 (a partial second chunk) and 72; 67 rows leave a partial
# last row block, 4500 rows of 72 units are enough that blocking pays on an H200.
@pytest.mark.parametrize("units,rows", [(3, 67), (40, 67), (72, 67), (72, 4500)])
@pytest.mark.parametrize("name", HOT + ["Q8_0", "Q3_K", "F16"])
def test_matmul_tokens_equal_each_alone(ext, name, units, rows, row_blocking):
    """T tokens in one launch give each token bit for bit what a launch of it alone gives,
    whatever T (several tokens may decode a unit for two rows at once): a verify step's and a
    batch's products agree with decode's."""
    if rows > 100 and DEVICE != "cuda":
        pytest.skip("the large shape is for a GPU's own blocking rule")
    q = quant_type(name)
    rng = np.random.default_rng(units)
    h = _cols(name, units)
    blocks = random_tensor(q, (rows, h), rng)
    wd = _dev(blocks)
    x = _dev(rng.standard_normal((8, h), dtype=np.float32))
    alone = _nan(8, rows)
    for t in range(8):
        ext.matmul(q.type_id, wd.data_ptr(), rows, h, blocks.shape[1], x[t:t + 1].data_ptr(), 1,
                   alone[t:t + 1].data_ptr(), _stream())
    for n_tok in (2, 3, 5, 8):
        y = _nan(n_tok, rows)
        ext.matmul(q.type_id, wd.data_ptr(), rows, h, blocks.shape[1], x.data_ptr(), n_tok,
                   y.data_ptr(), _stream())
        _sync()
        assert torch.equal(y, alone[:n_tok]), \
            f"{name} T={n_tok}: {(y - alone[:n_tok]).abs().max().item():.3g} from single-token launches"


def test_row_blocking_setting_is_checked(ext):
    before = ext.row_blocking()
    with pytest.raises(Exception, match="row blocking"):
        ext.set_row_blocking(3)
    assert ext.row_blocking() == before


@pytest.mark.parametrize("name", HOT + ["Q8_0", "F16"])
def test_matmul_many_tokens_and_large(ext, name):
    _run_matmul(ext, name, n_out=19, units=64, n_tok=13, seed=3)      # 8 + 5 token groups
    _run_matmul(ext, name, n_out=2053, units=64, n_tok=1, seed=4)     # many tiles per warp


def test_matmul_rejects_bad_arguments(ext):
    blocks = _dev(np.zeros((4, 144), np.uint8))
    x, y = _nan(1, 256), _nan(1, 4)
    with pytest.raises(ValueError):
        ext.matmul(12, blocks.data_ptr(), 4, 250, 144, x.data_ptr(), 1, y.data_ptr(), _stream())
    with pytest.raises(ValueError):
        ext.matmul(5, blocks.data_ptr(), 4, 256, 144, x.data_ptr(), 1, y.data_ptr(), _stream())


def test_bad_tuning_value_is_a_native_error(ext):
    """A bad argument reaches Python as NativeError: the CLI prints it as one line."""
    from native.errors import NativeError
    before = ext.rows_min_chunks()
    with pytest.raises(NativeError, match="1..1024"):
        ext.set_rows_min_chunks(0)
    assert ext.rows_min_chunks() == before


def test_tables_sizes_and_types(ext):
    assert ext.tables_ready()
    assert ext.block_sizes() == {n: (q.block_elems, q.block_bytes) for n, q in QUANT_TYPES.items()}
    for op in ("dequantize_types", "matmul_types", "moe_ffn_types"):
        assert sorted(getattr(ext, op)()) == sorted(TYPES)
    assert set(ext.matmul_accum().values()) <= {"f32", "q8"}
    assert all(ext.matmul_accum()[n] == "q8" for n in HOT)


# ---- prefill: dequantize to 16 bits + cuBLAS (native.ops.cuda_prefill_matmul) ------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", HOT + ["Q8_0", "F16", "IQ2_XXS"])
def test_cuda_prefill_matmul(ext, name, dtype):
    """Tolerance: both operands rounded to 16 bits (unit roundoff u), errors random per product:
    |y - ref| <= 6 u sqrt(sum (w x)^2) + u |ref| (a 16-bit output) + 1e-5 sum |w x|."""
    if DEVICE != "cuda":
        pytest.skip("torch GEMM on a CUDA device")
    from native import ops
    q, dt = quant_type(name), getattr(torch, dtype)
    u = 2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -11
    rng = np.random.default_rng(5)
    n_out, h, n_tok = 300, _cols(name, 64), 67
    blocks = random_tensor(q, (n_out, h), rng)
    w = dequantize_reference(blocks, q, (n_out, h)).astype(np.float64)
    x = rng.standard_normal((n_tok, h), dtype=np.float32)
    wq = ops.QTensor(_dev(blocks), q, (n_out, h), name)
    workspace = torch.empty(n_out * h * 2 + 64, dtype=torch.uint8, device=DEVICE)
    y = ops.cuda_prefill_matmul(_dev(x), wq, workspace, dt).cpu().numpy()
    assert y.dtype == np.float32 and y.shape == (n_tok, n_out) and np.isfinite(y).all()
    x64 = x.astype(np.float64)
    ref = x64 @ w.T
    tol = 6 * u * np.sqrt((x64 * x64) @ (w * w).T) + u * np.abs(ref) + 1e-5 * (np.abs(x64) @ np.abs(w).T)
    err = np.abs(y - ref) / tol
    assert err.max() <= 1, f"{name} {dtype}: error {err.max():.3g} x tolerance"


# ---- fidelity: no less faithful than ggml's int8 scheme (docs/BENCHMARKS.md "GPU fidelity") -----------

def _wide_range_x(rng: np.random.Generator, n_tok: int, h: int) -> np.ndarray:
    """Features of very different sizes and a few outliers, as real activations have."""
    x = rng.standard_normal((n_tok, h)) * np.exp(1.5 * rng.standard_normal((1, h)))
    x[rng.random((n_tok, h)) < 0.002] *= 200.0
    return x.astype(np.float32)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("name", [n for n in TYPES if quant_type(n).family != "float"])
def test_matmul_no_less_faithful_than_ggml_q8(ext, name, wide):
    """The decode kernels against the exact product: rms error <= that of ggml's q8 activations
    (x to int8 per 32 values, d = amax/127, exact sums) on the same inputs. q8 types reproduce that
    scheme (float32 sums add ~1e-6); f32 types are exact."""
    q = quant_type(name)
    rng = np.random.default_rng(17 + q.type_id)
    n_out, h, n_tok = 160, _cols(name, 64), 5
    blocks = random_tensor(q, (n_out, h), rng)
    w = dequantize_reference(blocks, q, (n_out, h)).astype(np.float64)
    x = _wide_range_x(rng, n_tok, h) if wide else rng.standard_normal((n_tok, h), dtype=np.float32)
    wd, xd, y = _dev(blocks), _dev(x), _nan(n_tok, n_out)   # held until the kernel has run
    ext.matmul(q.type_id, wd.data_ptr(), n_out, h, blocks.shape[1], xd.data_ptr(), n_tok,
               y.data_ptr(), _stream())
    _sync()
    ref = x.astype(np.float64) @ w.T
    rms = lambda e: float(np.sqrt(np.mean(e * e)))
    err = rms(y.cpu().numpy() - ref)
    err_q8 = rms(q8_round(x)[0] @ w.T - ref)
    assert err <= 1.001 * err_q8 + 1e-6 * rms(ref), f"{name}: rms error {err:.4g} > ggml q8's {err_q8:.4g}"


def test_rows_to_f16_matches_reference(ext):
    """The prefill GEMM's f16 operand: bit-exact with native.ops.rows_to_f16_ref, rows beyond f16's
    range scaled by a power of two, a strided input, zero rows."""
    from native import ops
    rng = np.random.default_rng(23)
    x = rng.standard_normal((7, 300)).astype(np.float32)
    x[1] *= 1e5          # overflows f16 unscaled
    x[2] = 0.0
    x[3, 5] = 65504.0    # exactly f16's max: scaled below 2^15
    x[4] *= 1e-6
    for xin in (torch.from_numpy(x), torch.from_numpy(np.pad(x, ((0, 0), (0, 20))))[:, :300]):
        xd = xin.to(DEVICE)
        out = torch.empty(7, 300, dtype=torch.float16, device=DEVICE)
        scale = torch.empty(7, dtype=torch.float32, device=DEVICE)
        ext.rows_to_f16(xd.data_ptr(), 7, 300, xd.stride(0), out.data_ptr(), scale.data_ptr(), _stream())
        _sync()
        want, want_scale = ops.rows_to_f16_ref(torch.from_numpy(x))
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
        assert torch.equal(scale.cpu(), want_scale)
    assert want_scale[1] > 1 and want_scale[3] == 2 and torch.isfinite(want.float()).all()


def test_prefill_matmul_survives_activations_beyond_f16(ext):
    """Rows with |x| ~ 1e6 through the default prefill GEMM: finite, within f16 rounding."""
    from native import ops
    q = quant_type("Q6_K")
    rng = np.random.default_rng(29)
    n_out, h, n_tok = 64, 512, 20
    blocks = random_tensor(q, (n_out, h), rng)
    w = dequantize_reference(blocks, q, (n_out, h)).astype(np.float64)
    x = rng.standard_normal((n_tok, h)).astype(np.float32)
    x[::3] *= 1e6
    y = ops.matmul(_dev(x), ops.QTensor(_dev(blocks), q, (n_out, h), "w")).cpu().numpy()
    ref = x.astype(np.float64) @ w.T
    assert np.isfinite(y).all()
    u = 2.0 ** -11
    tol = 6 * u * np.sqrt((x.astype(np.float64) ** 2) @ (w * w).T) + u * np.abs(ref) + 1e-5 * (np.abs(x) @ np.abs(w).T)
    assert (np.abs(y - ref) <= tol).all()


@pytest.mark.parametrize("n,masked,first_tile", [(1024, False, True), (1024, True, False),
                                                 (777, True, True), (256, False, False)])
def test_softmax_tile_matches_the_torch_ops(ext, n, masked, first_tile):
    """One tile's online-softmax update of a prompt chunk's attention (csrc/cuda/softmax_tile.cu)
    against the torch ops it replaces (moe_offload/models/attention.py), in float64: the max
    exact, p, corr and the sum within 1e-5 relative (fast-math exp, another order of the sum),
    masked columns exactly 0. n 777: the one-column-a-lane form."""
    g = torch.Generator().manual_seed(n + masked)
    G, T = 4, 48
    rows = 2 * G * T                                  # rows g * T + t of 2 kv heads
    j0 = 0 if first_tile else 1000
    s = torch.randn(rows, n, generator=g) * 4
    if first_tile:
        m, l = torch.full((rows, 1), float("-inf")), torch.zeros(rows, 1)
        pos = torch.randint(0, n + 5, (T,), generator=g)          # column 0 seen by every row
    else:
        m, l = torch.randn(rows, 1, generator=g) * 4, torch.rand(rows, 1, generator=g) * 10 + 1
        pos = j0 + torch.randint(-5, n + 5, (T,), generator=g)    # some rows see none of the tile
    ref = s.double()
    if masked:
        ref.masked_fill_(torch.arange(j0, j0 + n) > pos.repeat(rows // T)[:, None], float("-inf"))
    m_new = torch.maximum(m.double(), ref.amax(-1, keepdim=True))
    corr_ref = torch.exp(m.double() - m_new)
    p_ref = torch.exp(ref - m_new)
    l_ref = l.double() * corr_ref + p_ref.sum(-1, keepdim=True)

    s_d, m_d, l_d = (t.to(DEVICE).contiguous() for t in (s, m, l))
    pos_d = pos.to(DEVICE).contiguous()
    corr_d = torch.full_like(m_d, float("nan"))
    ext.softmax_tile(s_d.data_ptr(), rows, n, n, m_d.data_ptr(), l_d.data_ptr(), corr_d.data_ptr(),
                     pos_d.data_ptr() if masked else 0, T if masked else 0, j0, _stream())
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(m_d.cpu().double(), m_new)
    assert torch.allclose(corr_d.cpu().double(), corr_ref, rtol=1e-5, atol=1e-30)
    assert torch.allclose(s_d.cpu().double(), p_ref, rtol=1e-5, atol=1e-9)
    assert torch.equal(s_d.cpu()[p_ref == 0], torch.zeros(int((p_ref == 0).sum())))
    assert torch.allclose(l_d.cpu().double(), l_ref, rtol=1e-5)
