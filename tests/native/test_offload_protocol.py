"""The constants Python shares with the offload kernels come from the extensions (one header,
csrc/offload_exchange.h, exported by both bindings): the CPU extension, always built, states
them; the CUDA one, where built, states the same; Python's users read them from there."""
import numpy as np
import pytest
import torch

from native import offload_native as on
from native.ops import _cpu, _cuda


def test_the_cpu_extension_states_the_protocol():
    assert _cpu is not None, "the CPU extension is always built"
    assert _cpu.MAX_SELECTIONS == on.MAX_SELECTIONS == 64
    assert tuple(_cpu.STATS_COLUMNS) == on.STATS_COLUMNS == (
        "hits", "fetched", "cpu", "prefetch_hits", "prefetched")
    assert _cpu.SCORE_ONE == on.SCORE_ONE == 1 << 16
    assert _cpu.SCORE_STEPS == on.SCORE_STEPS == 1024
    assert dict(_cpu.OUTPUT_DTYPES) == on.OUTPUT_DTYPES == {"F32": 0, "F16": 1, "BF16": 30}
    assert dict(_cpu.LINK_WORDS) == on.LINK_WORDS
    assert on.LINK_WORDS["mark"] + on.LINK_WORDS["marks"] <= on.LINK_WORDS["ns_per_byte"]
    assert max(on.LINK_WORDS[k] for k in ("free_at", "ns_per_byte", "bytes")) < on.LINK_WORDS["words"]


def test_output_dtypes_are_the_ggml_type_ids():
    from loaders.quants import QUANT_TYPES
    ids = {name: qt.type_id for name, qt in QUANT_TYPES.items()}
    for name, type_id in on.OUTPUT_DTYPES.items():
        assert ids[name] == type_id


def _cuda_module():
    """native._cuda where it is built (it imports without a GPU; ops only uses it with one)."""
    if _cuda is not None:
        return _cuda
    try:
        import native._cuda as ext
    except ImportError:
        return None
    return ext


@pytest.mark.skipif(_cuda_module() is None, reason="the CUDA extension is not built")
def test_the_cuda_extension_states_the_same_protocol():
    ext = _cuda_module()
    for name in ("MAX_SELECTIONS", "SCORE_ONE", "SCORE_STEPS"):
        assert getattr(ext, name) == getattr(_cpu, name), name
    assert tuple(ext.STATS_COLUMNS) == tuple(_cpu.STATS_COLUMNS)
    assert dict(ext.OUTPUT_DTYPES) == dict(_cpu.OUTPUT_DTYPES)
    assert dict(ext.LINK_WORDS) == dict(_cpu.LINK_WORDS)


def test_cache_stats_read_the_columns_by_name():
    from moe_offload.offload.expert_cache import STATS, CacheStats
    assert STATS == on.STATS_COLUMNS
    assert set(CacheStats.__dataclass_fields__) == set(on.STATS_COLUMNS)


def test_one_score_mirror_for_numpy_and_torch():
    """decayed_scores, the kernels' eviction score, gives the same integers on numpy arrays,
    numpy scalars and torch tensors; ages past the table forget, negative ages count as 0."""
    table = on.score_decay_table(0.99)
    rng = np.random.default_rng(0)
    score = rng.integers(0, 1 << 30, 200)
    seen = rng.integers(-1200, 40, 200)
    want = [((int(s) * int(table[min(max(30 - int(a), 0), on.SCORE_STEPS - 1)])) >> 16)
            if 30 - int(a) < on.SCORE_STEPS else 0 for s, a in zip(score, seen)]
    assert on.decayed_scores(score, seen, 30, table).tolist() == want
    assert [int(on.decayed_scores(s, a, 30, table)) for s, a in zip(score, seen)] == want
    got = on.decayed_scores(torch.from_numpy(score).int(), torch.from_numpy(seen).int(),
                            torch.tensor(30, dtype=torch.int32), torch.from_numpy(table))
    assert got.tolist() == want


def test_ops_reads_the_dtype_ids_from_the_extension():
    from native import ops
    assert ops._GGML_DTYPE == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


def test_link_schedule_reference_queues_copies_on_one_clock():
    """The emulated link's booking (the hold kernel's arithmetic): a copy starts at its mark or
    when the link frees up, whichever is later, and lasts bytes / rate; an empty copy waits for
    nothing."""
    gbps = 10.0   # 10 bytes a ns
    done = on.link_schedule_reference([(0, 1000), (50, 1000), (1000, 500), (1000, 0), (5000, 10)],
                                      gbps)
    assert done == [100, 200, 1050, 1000, 5001]
