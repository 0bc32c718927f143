"""native._cpu kernels against the reference, looping over the type table, on every CPU ISA:
dequantize bit-exact with gguf-py; matmul and moe_ffn within the tolerance table of float64."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from kernel_oracle import (SEED, assert_close, kernel_cols, matmul_reference, moe_reference,
                           poisoned, random_weight, rng_for)
from loaders.quants import QUANT_TYPES, dequantize_reference, random_tensor
from native import ops

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")
cpu = ops._cpu
TYPES = list(QUANT_TYPES)


# ---- the type table ------------------------------------------------------------------------------

def test_block_sizes_match_the_table_and_gguf():
    sizes = cpu.block_sizes()
    assert set(sizes) == set(QUANT_TYPES)
    for name, q in QUANT_TYPES.items():
        assert tuple(sizes[name]) == (q.block_elems, q.block_bytes), name
        assert tuple(sizes[name]) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]], name


def test_accumulation_kinds_are_in_the_tolerance_table(cpu_isa):
    from kernel_oracle import TOLERANCES
    assert {cpu.accumulation(n) for n in QUANT_TYPES} <= set(TOLERANCES)
    if cpu_isa == "generic":  # the oracle path never rounds activations
        assert {cpu.accumulation(n) for n in QUANT_TYPES} == {"f32"}


def test_every_type_runs_natively_and_supported_types_says_so():
    for op in ("dequantize", "matmul", "moe_ffn"):
        assert sorted(getattr(cpu, f"{op}_types")()) == sorted(QUANT_TYPES), op
    assert all(v["cpu"] for v in ops.supported_types().values())
    assert cpu.tables_ready()


# ---- dequantize ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_exact_with_gguf_py(cpu_isa, name):
    q = QUANT_TYPES[name]
    rng = rng_for("dequantize", cpu_isa, name)
    for rows, blocks in ((1, 1), (5, 3)):
        cols = kernel_cols(q, blocks)
        raw = random_tensor(q, (rows, cols), rng)
        ref = dequantize_reference(raw, q, (rows, cols))
        out = poisoned((rows, cols))
        cpu.dequantize(q.type_id, raw.ctypes.data, rows, cols, raw.shape[1], out.ctypes.data, 0, 0)
        assert np.array_equal(out, ref), f"{name} [{rows}, {cols}] on {cpu_isa} (seed {SEED})"
    # rows with a stride (a bank view): every other row of a wider buffer
    wide = np.zeros((rows, 2 * raw.shape[1]), np.uint8)
    wide[:, :raw.shape[1]] = raw
    out = poisoned((rows, cols))
    cpu.dequantize(q.type_id, wide.ctypes.data, rows, cols, wide.shape[1], out.ctypes.data, 0, 0)
    assert np.array_equal(out, ref), f"{name} strided rows on {cpu_isa} (seed {SEED})"


@pytest.mark.parametrize("name", ["Q4_K", "IQ3_S", "F32", "MXFP4"])
def test_dequantize_to_f16_and_bf16_rounds_like_torch(name):
    import torch
    q = QUANT_TYPES[name]
    raw = random_tensor(q, (3, kernel_cols(q, 2)), rng_for("half", name))
    ref = torch.from_numpy(dequantize_reference(raw, q, (3, kernel_cols(q, 2))))
    for dtype, dt_id in ((torch.float16, 1), (torch.bfloat16, 30)):
        out = torch.full(ref.shape, float("nan"), dtype=dtype)
        cpu.dequantize(q.type_id, raw.ctypes.data, 3, ref.shape[1], raw.shape[1], out.data_ptr(),
                       dt_id, 0)
        assert torch.equal(out.view(torch.int16), ref.to(dtype).view(torch.int16)), (name, dtype)


def test_bad_arguments_raise_before_writing():
    from native.errors import NativeError   # the CLI prints it as one line (a ValueError too)
    raw = random_tensor(QUANT_TYPES["Q4_K"], (1, 256), rng_for("bad"))
    out = poisoned((1, 256))
    with pytest.raises(NativeError, match="no CPU kernel"):
        cpu.dequantize(99, raw.ctypes.data, 1, 256, 144, out.ctypes.data, 0, 0)
    with pytest.raises(ValueError, match="whole number"):
        cpu.dequantize(QUANT_TYPES["Q4_K"].type_id, raw.ctypes.data, 1, 100, 144, out.ctypes.data, 0, 0)
    with pytest.raises(ValueError, match="stream=0"):
        cpu.dequantize(QUANT_TYPES["Q4_K"].type_id, raw.ctypes.data, 1, 256, 144, out.ctypes.data, 0, 7)
    assert np.isnan(out).all()


# ---- q8 activations --------------------------------------------------------------------------------

def test_q8_activations_are_ggml_rounding_bit_for_bit(cpu_isa):
    """The integer inputs of the q8 kernels: int8 values and scales equal native.numerics.q8_round
    (ggml's q8 rounding) exactly, on awkward inputs too (ties, zeros, huge and tiny blocks)."""
    import torch
    from native.numerics import q8_round
    if cpu_isa == "generic":
        with pytest.raises(ValueError, match="float"):
            cpu.quantize_q8(0, 0, 32, 0, 0, 0)
        return
    rng = rng_for("q8", cpu_isa)
    t, n = 9, 512
    x = rng.standard_normal((t, n), dtype=np.float32) * np.exp(3 * rng.standard_normal((t, n // 32, 1))).repeat(32, -1).reshape(t, n).astype(np.float32)
    x[0, :32] = 0.0                                       # an all-zero block: d = 0, q = 0
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5    # halves: ties round to even
    x[1, 32:64] = 127.0 * np.float32(0.5) ** np.arange(32)
    x[2, :32] = 1e-30                                     # tiny
    x[2, 32:64] = 3e37                                    # huge
    q, d, m16 = np.zeros((t, n), np.int8), poisoned((t, n // 32)), poisoned((t, n // 16))
    cpu.quantize_q8(x.ctypes.data, t, n, q.ctypes.data, d.ctypes.data, m16.ctypes.data)
    xt = torch.from_numpy(x).reshape(t, n // 32, 32)
    d_ref = (xt.abs().amax(-1) / 127.0).numpy()
    assert np.array_equal(d, d_ref), f"{cpu_isa}: scales (seed {SEED})"
    q_ref = np.rint(q8_round(torch.from_numpy(x)).numpy().reshape(t, n // 32, 32) /
                    np.where(d_ref > 0, d_ref, 1)[..., None].astype(np.float64))
    assert np.array_equal(q.reshape(t, n // 32, 32), q_ref), f"{cpu_isa}: int8 values (seed {SEED})"
    sums = q.astype(np.int64).reshape(t, n // 16, 16).sum(-1)
    with np.errstate(over="ignore"):                      # the huge block's sums overflow, as in C++
        assert np.array_equal(m16, d.repeat(2, -1) * sums.astype(np.float32)), cpu_isa


def test_q16_activations_are_q16_round_bit_for_bit(cpu_isa):
    """The int16 inputs of the 32-weight block types' kernels: values, scales and per-32 sums
    equal native.numerics.q16_round exactly, on awkward inputs too."""
    import torch
    from native.numerics import q16_round
    if cpu_isa == "generic":
        with pytest.raises(ValueError, match="float"):
            cpu.quantize_q16(0, 0, 32, 0, 0, 0)
        return
    rng = rng_for("q16", cpu_isa)
    t, n = 9, 512
    x = rng.standard_normal((t, n), dtype=np.float32) * np.exp(3 * rng.standard_normal((t, n // 32, 1))).repeat(32, -1).reshape(t, n).astype(np.float32)
    x[0, :32] = 0.0                                       # an all-zero block: d = 0, q = 0
    x[1, :31] = np.arange(31, dtype=np.float32) - 15.5   # d = 1: halves, ties round to even
    x[1, 31] = 32767.0
    x[2, :32] = 1e-30                                     # tiny
    x[2, 32:64] = 3e37                                    # huge
    q, d, s = np.zeros((t, n), np.int16), poisoned((t, n // 32)), poisoned((t, n // 32))
    cpu.quantize_q16(x.ctypes.data, t, n, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    xt = torch.from_numpy(x).reshape(t, n // 32, 32)
    d_ref = (xt.abs().amax(-1) / 32767.0).numpy()
    assert np.array_equal(d, d_ref), f"{cpu_isa}: scales (seed {SEED})"
    q_ref = np.rint(q16_round(torch.from_numpy(x)).numpy().reshape(t, n // 32, 32) /
                    np.where(d_ref > 0, d_ref, 1)[..., None].astype(np.float64))
    assert np.array_equal(q.reshape(t, n // 32, 32), q_ref), f"{cpu_isa}: int16 values (seed {SEED})"
    sums = q.astype(np.int64).reshape(t, n // 32, 32).sum(-1)
    with np.errstate(over="ignore"):
        assert np.array_equal(s, d * sums.astype(np.float32)), cpu_isa


def test_int16_kernels_give_the_same_bits_on_avx2_and_avx512():
    """The q16 kernels sum the same integers per lane and take the same float steps on both ISAs."""
    isas = [i for i in ("avx2", "avx512") if i in cpu.available_isas()]
    if len(isas) < 2:
        pytest.skip("needs AVX2 and AVX-512")
    before = cpu.isa()
    try:
        for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"):
            q = QUANT_TYPES[name]
            rng = rng_for("q16-isas", name)
            raw, _ = random_weight(q, (21, kernel_cols(q, 7)), rng)
            x = rng.standard_normal((9, kernel_cols(q, 7)), dtype=np.float32)
            ys = []
            for isa in isas:
                cpu.set_isa(isa)
                assert cpu.accumulation(name) == "q16", (name, isa)
                ys.append([_matmul(q, raw, x[:nt]) for nt in (1, 3, 9)])
            for a, b in zip(*ys):
                assert np.array_equal(a, b), f"{name} T={a.shape[0]} (seed {SEED})"
    finally:
        cpu.set_isa(before)


# ---- matmul ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [1, 5], ids=["one_block", "many_blocks"])
@pytest.mark.parametrize("name", TYPES)
def test_matmul_matches_float64(cpu_isa, name, blocks):
    q = QUANT_TYPES[name]
    rng = rng_for("matmul", cpu_isa, name, blocks)
    n_out, n_in = 37, kernel_cols(q, blocks)  # O deliberately not a multiple of anything
    raw, w64 = random_weight(q, (n_out, n_in), rng)
    for n_tok in (1, 2, 3, 7, 33):
        x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
        y = poisoned((n_tok, n_out))
        cpu.matmul(q.type_id, raw.ctypes.data, n_out, n_in, raw.shape[1], x.ctypes.data, n_tok,
                   y.ctypes.data, 0)
        kind = cpu.accumulation(name)
        assert_close(y, *matmul_reference(kind, w64, x.astype(np.float64)),
                     f"{name} matmul ({kind}) T={n_tok} H={n_in} on {cpu_isa}")


@pytest.mark.parametrize("name", TYPES)
def test_a_tokens_result_does_not_depend_on_the_batch(cpu_isa, name):
    """Every token of a call gets the bits it would get alone (decode_many batches sequences;
    decode-sized calls stream rows, larger ones decode each row once: same arithmetic order)."""
    q = QUANT_TYPES[name]
    rng = rng_for("batch", cpu_isa, name)
    n_out, n_in = 21, kernel_cols(q, 3)
    raw, _ = random_weight(q, (n_out, n_in), rng)
    x = rng.standard_normal((9, n_in), dtype=np.float32)
    alone = np.stack([_matmul(q, raw, x[t:t + 1])[0] for t in range(9)])
    for n_tok in (2, 4, 5, 9):
        assert np.array_equal(_matmul(q, raw, x[:n_tok]), alone[:n_tok]), \
            f"{name} T={n_tok} on {cpu_isa} (seed {SEED})"


@pytest.mark.skipif(ops._cpu is None or "avx2" not in ops._cpu.available_isas(), reason="no AVX2")
def test_iq3s_grid_by_gather_or_by_loads_gives_the_same_bits():
    """The avx2 and avx512 tables' IQ3_S have two forms each (the grid by gathers or by loads,
    chosen by the CPU's vendor), and their decode shapes read it in column form: every ISA and
    form agrees bit for bit with the avx2 gather, for the decode (an odd row count included) and
    the many-token shapes, and the default is one of the two forms."""
    q = QUANT_TYPES["IQ3_S"]
    rng = rng_for("iq3s_grid")
    raw, w64 = random_weight(q, (37, kernel_cols(q, 4)), rng)
    x = rng.standard_normal((33, kernel_cols(q, 4)), dtype=np.float32)
    before_isa, before_grid = cpu.isa(), cpu.iq3s_grid()
    assert before_grid in ("gather", "loads")
    isas = [i for i in ("avx2", "avx512") if i in cpu.available_isas()]
    try:
        ys = {}
        for isa in isas:
            cpu.set_isa(isa)
            for how in ("gather", "loads"):
                cpu.set_iq3s_grid(how)
                assert cpu.iq3s_grid() == how
                ys[isa, how] = [_matmul(q, raw, x[:n]) for n in (1, 2, 3, 4, 33)]
        first = ys["avx2", "gather"]
        for key, got in ys.items():
            for a, b in zip(first, got):
                assert np.array_equal(a, b), f"IQ3_S T={a.shape[0]} on {key} (seed {SEED})"
        assert_close(first[-1], *matmul_reference("q8", w64, x.astype(np.float64)), "IQ3_S avx2")
        with pytest.raises(ValueError, match="gather.*loads"):
            cpu.set_iq3s_grid("simd")
    finally:
        cpu.set_iq3s_grid(before_grid)
        cpu.set_isa(before_isa)


def _matmul(q, raw, x):
    y = poisoned((x.shape[0], raw.shape[0]))
    cpu.matmul(q.type_id, raw.ctypes.data, raw.shape[0], x.shape[1], raw.shape[1], x.ctypes.data,
               x.shape[0], y.ctypes.data, 0)
    return y


# ---- matmul_multi ----------------------------------------------------------------------------------

@pytest.mark.parametrize("names", [("IQ3_S", "Q4_K", "Q8_0", "F32"), ("Q6_K",), ("IQ4_XS", "BF16", "Q5_K")])
def test_matmul_multi_is_each_matmul_bit_for_bit(cpu_isa, names):
    """Several weights against one x in one call (small ones inline, large ones over the pool):
    every weight's columns hold exactly what its own matmul gives (which the test above holds to
    float64), written at the output row stride; the columns past them are left alone."""
    rng = rng_for("matmul_multi", cpu_isa, *names)
    n_in = 256
    sizes = [3, 40, 1, 300][:len(names)]
    ws = [random_weight(QUANT_TYPES[n], (o, n_in), rng)[0] for n, o in zip(names, sizes)]
    for n_tok in (1, 3, 7, 70):
        x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
        ldy = sum(sizes) + 5
        y = poisoned((n_tok, ldy))
        cpu.matmul_multi([(QUANT_TYPES[n].type_id, w.ctypes.data, o, w.shape[1])
                          for n, w, o in zip(names, ws, sizes)], n_in, x.ctypes.data, n_tok,
                         y.ctypes.data, ldy, 0)
        col = 0
        for n, w, o in zip(names, ws, sizes):
            assert np.array_equal(y[:, col:col + o], _matmul(QUANT_TYPES[n], w, x)), \
                f"{n} in {names} T={n_tok} on {cpu_isa} (seed {SEED})"
            col += o
        assert np.isnan(y[:, col:]).all(), "matmul_multi wrote past its columns"


def test_matmul_multi_checks_every_weight_first():
    q = QUANT_TYPES["Q4_K"]
    w = random_weight(q, (4, 256), rng_for("multi_bad"))[0]
    x = np.ones((1, 256), dtype=np.float32)
    y = poisoned((1, 8))
    good = (q.type_id, w.ctypes.data, 4, w.shape[1])
    with pytest.raises(ValueError, match="row stride is shorter"):
        cpu.matmul_multi([good, (q.type_id, w.ctypes.data, 4, 8)], 256, x.ctypes.data, 1, y.ctypes.data, 8, 0)
    with pytest.raises(ValueError, match="output row stride"):
        cpu.matmul_multi([good, good], 256, x.ctypes.data, 1, y.ctypes.data, 7, 0)
    assert np.isnan(y).all()


# ---- moe_ffn ---------------------------------------------------------------------------------------

def _moe_case(rng, gate_t, up_t, down_t, n_tok, n_exp=6, k=3, fused=False):
    """Random banks (gate/up [E, F, H], down [E, H, F]), routing with some skipped slots."""
    qg, qu, qd = (QUANT_TYPES[n] for n in (gate_t, up_t, down_t))
    f = max(kernel_cols(qd, 1), 32)
    h = 2 * max(kernel_cols(qg, 1), kernel_cols(qu, 1))
    if fused:  # one [E, 2F, H] buffer: gate rows then up rows of each expert
        raw, w64 = random_weight(qg, (n_exp, 2 * f, h), rng)
        bank = raw.reshape(n_exp, 2 * f, -1)
        gate, up = (bank[:, :f], w64[:, :f]), (bank[:, f:], w64[:, f:])
    else:
        graw, g64 = random_weight(qg, (n_exp, f, h), rng)
        uraw, u64 = random_weight(qu, (n_exp, f, h), rng)
        gate, up = (graw.reshape(n_exp, f, -1), g64), (uraw.reshape(n_exp, f, -1), u64)
    draw, d64 = random_weight(qd, (n_exp, h, f), rng)
    down = (draw.reshape(n_exp, h, -1), d64)
    x = rng.standard_normal((n_tok, h), dtype=np.float32)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.15] = -1  # skipped slots (computed elsewhere)
    weights = rng.random((n_tok, k), dtype=np.float32)
    return (qg, qu, qd), x, gate, up, down, ids, weights


def _run_moe(types, x, gate, up, down, ids, weights):
    n_tok, h = x.shape
    y = poisoned((n_tok, h))
    banks = []
    for q, (raw, _) in zip(types, (gate, up, down)):
        banks += [q.type_id, raw.ctypes.data, raw.strides[0]]
    cpu.moe_ffn(x.ctypes.data, n_tok, h, gate[0].shape[1], gate[0].shape[0], ids.ctypes.data,
                weights.ctypes.data, ids.shape[1], *banks, y.ctypes.data, 0)
    return y


@pytest.mark.parametrize("name", TYPES)
def test_moe_ffn_matches_float64(cpu_isa, name):
    rng = rng_for("moe", cpu_isa, name)
    for n_tok in (1, 3, 7):
        types, x, gate, up, down, ids, weights = _moe_case(rng, name, name, name, n_tok)
        y = _run_moe(types, x, gate, up, down, ids, weights)
        y64, bound = moe_reference(x.astype(np.float64), gate[1], up[1], down[1], ids, weights,
                                   [cpu.accumulation(q.name) for q in types])
        assert_close(y, y64, bound, f"{name} moe_ffn T={n_tok} on {cpu_isa}")


@pytest.mark.parametrize("gate_t,down_t", [("IQ3_S", "Q6_K"), ("Q4_K", "Q8_0"), ("IQ4_XS", "F16")])
def test_moe_ffn_fused_gate_up_views_and_mixed_types(cpu_isa, gate_t, down_t):
    rng = rng_for("moe_fused", cpu_isa, gate_t, down_t)
    types, x, gate, up, down, ids, weights = _moe_case(rng, gate_t, gate_t, down_t, 5, fused=True)
    assert not gate[0].flags.c_contiguous  # a real strided view into the fused bank
    y = _run_moe(types, x, gate, up, down, ids, weights)
    y64, bound = moe_reference(x.astype(np.float64), gate[1], up[1], down[1], ids, weights,
                               [cpu.accumulation(q.name) for q in types])
    assert_close(y, y64, bound, f"fused {gate_t}/{down_t} on {cpu_isa}")


def test_moe_ffn_skips_negative_ids_and_rejects_out_of_range():
    rng = rng_for("moe_ids")
    types, x, gate, up, down, ids, weights = _moe_case(rng, "Q4_0", "Q4_0", "Q4_0", 2)
    ids[:] = -1
    assert not _run_moe(types, x, gate, up, down, ids, weights).any()  # all skipped: zeros
    ids[0, 0] = 6  # == E
    with pytest.raises(ValueError, match="out of range"):
        _run_moe(types, x, gate, up, down, ids, weights)


def test_long_prefill_crosses_token_tiles_and_chunks(cpu_isa):
    """matmul tiles tokens by 64, moe_ffn chunks them by 512: both must stitch correctly, and a
    bad id in the last chunk must raise before anything is written."""
    rng = rng_for("prefill", cpu_isa)
    q = QUANT_TYPES["Q4_K"]
    raw, w64 = random_weight(q, (19, 512), rng)
    x = rng.standard_normal((130, 512), dtype=np.float32)
    y = poisoned((130, 19))
    cpu.matmul(q.type_id, raw.ctypes.data, 19, 512, raw.shape[1], x.ctypes.data, 130, y.ctypes.data, 0)
    assert_close(y, *matmul_reference(cpu.accumulation("Q4_K"), w64, x.astype(np.float64)),
                 f"T=130 on {cpu_isa}")

    types, x, gate, up, down, ids, weights = _moe_case(rng, "Q8_0", "Q8_0", "IQ4_NL", 600)
    bad = ids.copy()
    bad[-1, 0] = 6  # == E, in the second 512-token chunk
    y = poisoned(x.shape)
    banks = [v for qq, (r, _) in zip(types, (gate, up, down)) for v in (qq.type_id, r.ctypes.data, r.strides[0])]
    with pytest.raises(ValueError, match="out of range"):
        cpu.moe_ffn(x.ctypes.data, 600, x.shape[1], gate[0].shape[1], 6, bad.ctypes.data,
                    weights.ctypes.data, 3, *banks, y.ctypes.data, 0)
    assert np.isnan(y).all()
    y = _run_moe(types, x, gate, up, down, ids, weights)
    y64, bound = moe_reference(x.astype(np.float64), gate[1], up[1], down[1], ids, weights,
                               [cpu.accumulation(t.name) for t in types])
    assert_close(y, y64, bound, f"moe_ffn T=600 on {cpu_isa}")
