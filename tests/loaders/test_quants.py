"""The ggml type table, the reference dequantizer, random valid blocks, IQ tables."""
import zlib

import gguf
import numpy as np
import pytest

from loaders import GGUFError, QUANT_TYPES, dequantize_reference, quant_type, random_blocks
from loaders.quants import iq_tables, random_tensor

ISSUE_TYPES = ("F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M "
               "IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4").split()


def test_table_covers_every_weight_type_with_gguf_sizes():
    assert set(ISSUE_TYPES) <= set(QUANT_TYPES)
    for name, q in QUANT_TYPES.items():
        gt = gguf.GGMLQuantizationType[name]
        assert q.type_id == int(gt)
        assert (q.block_elems, q.block_bytes) == gguf.GGML_QUANT_SIZES[gt]
        assert q.family in {"float", "legacy", "k", "i", "ternary", "fp4"}


def test_lookup_by_name_and_id_and_unknown():
    assert quant_type("iq3_s") is QUANT_TYPES["IQ3_S"]
    assert quant_type(21) is QUANT_TYPES["IQ3_S"]
    with pytest.raises(GGUFError, match="unsupported ggml type 'Q9_9'.*IQ3_S"):
        quant_type("Q9_9")


@pytest.mark.parametrize("name", ISSUE_TYPES)
def test_reference_matches_gguf_py_on_random_blocks(name):
    q = QUANT_TYPES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rows, cols = 6, 2 * 256 if q.block_elems > 1 else 96
    raw = random_tensor(q, (rows, cols), rng)
    ours = dequantize_reference(raw, q, (rows, cols))
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    assert ours.dtype == np.float32 and ours.shape == (rows, cols)
    np.testing.assert_array_equal(ours, theirs)
    # 3-D banks (experts) reshape the same way
    bank = dequantize_reference(raw, q, (2, 3, cols))
    np.testing.assert_array_equal(bank.reshape(rows, cols), ours)


@pytest.mark.parametrize("name", ISSUE_TYPES)
def test_random_blocks_are_finite_centred_and_scaled(name):
    rng = np.random.default_rng(7)
    q = QUANT_TYPES[name]
    n = 4096 if q.block_elems == 1 else 256
    w = dequantize_reference(random_blocks(q, n, rng), q)
    assert np.isfinite(w).all()
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    assert 0.012 < rms < 0.03, rms
    assert abs(float(w.mean())) < 0.2 * rms


def test_random_blocks_deterministic_for_a_seed():
    a = random_blocks("Q4_K", 8, np.random.default_rng(3))
    b = random_blocks("Q4_K", 8, np.random.default_rng(3))
    c = random_blocks("Q4_K", 8, np.random.default_rng(4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_ternary_blocks_only_hold_trits():
    raw = random_blocks("TQ2_0", 64, np.random.default_rng(0))
    codes = np.concatenate([(raw[:, :64] >> s) & 3 for s in (0, 2, 4, 6)])
    assert set(np.unique(codes).tolist()) <= {0, 1, 2}


def test_reference_rejects_partial_blocks_and_wrong_shapes():
    raw = random_blocks("Q8_0", 2, np.random.default_rng(0))
    with pytest.raises(GGUFError, match="not a whole number of Q8_0 blocks"):
        dequantize_reference(raw.reshape(-1)[:50], "Q8_0")
    with pytest.raises(GGUFError, match="not shape"):
        dequantize_reference(raw, "Q8_0", (3, 32))
    with pytest.raises(GGUFError, match="whole number of 256-weight blocks"):
        QUANT_TYPES["IQ3_S"].row_bytes(100)


def test_iq_tables_match_gguf_py_grids():
    t = iq_tables()
    sizes = {"iq2xxs": 256, "iq2xs": 512, "iq2s": 1024, "iq3xxs": 256, "iq3s": 512, "iq1s": 2048}
    for key, n in sizes.items():
        assert t[key].shape == (n,)
    # entry 1 of iq3s is (3, 1, 1, 1) little-endian packed, as ggml's table has it
    assert int(t["iq3s"][1]) == 0x01010103
    assert int(t["iq2xxs"][1]) == 0x080808080808082B
    iq1 = t["iq1s"].view(np.int8).reshape(-1, 8)
    assert set(np.unique(iq1).tolist()) == {-1, 0, 1}
    assert t["ksigns"].shape == (128,) and t["kvalues_iq4nl"][0] == -127
    # every ksigns byte has even parity (the 8th bit completes the 7 stored ones)
    assert all(bin(int(b)).count("1") % 2 == 0 for b in t["ksigns"])
