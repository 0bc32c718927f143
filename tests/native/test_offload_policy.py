"""The residency decisions of the offload plan and prefetch kernels, in their numpy reference
(native.offload_native.plan_reference / prefetch_reference); the kernels are compared with it on
the GPU in test_offload_policy_gpu.py."""
import numpy as np

from native.offload_native import LayerTablesRef, plan_reference, prefetch_reference


def _tables(E: int, S: int, resident: dict[int, int], last: dict[int, int] | None = None,
            pinned=(), freq: dict[int, int] | None = None) -> LayerTablesRef:
    """resident: expert -> slot; last: slot -> step of last use; freq: expert -> count."""
    soe = np.full(E, -1, np.int32)
    eos = np.full(S, -1, np.int32)
    for e, s in resident.items():
        soe[e], eos[s] = s, e
    lu = np.zeros(S, np.int32)
    for s, v in (last or {}).items():
        lu[s] = v
    pin = np.zeros(S, np.int32)
    pin[list(pinned)] = 1
    fq = np.zeros(E, np.int32)
    for e, v in (freq or {}).items():
        fq[e] = v
    return LayerTablesRef(soe, eos, lu, pin, fq, S)


def test_hits_stay_and_the_least_recently_used_slot_goes_first():
    t = _tables(16, 4, {0: 0, 1: 1, 2: 2, 3: 3}, last={0: 5, 1: 2, 2: 7, 3: 4})
    out = plan_reference(t, [0, 9], step=10, fetch_fraction=(1.0, 0))
    assert out["fetch"] == [(9, 1)]                        # slot 1 (used at step 2) is evicted
    assert t.slot_of_expert[1] == -1 and t.slot_of_expert[9] == 1 and t.slot_last_use[1] == 10
    assert t.slot_last_use[0] == 10                        # the hit is now used this step
    assert out["hits"] == 1 and out["cpu_ids"] == [-1, -1]
    assert out["pair_slots"] == [[0, -1], [-1, 1]]         # resident now, fetched once it lands


def test_free_slots_first_pinned_never_ties_by_frequency():
    t = _tables(16, 4, {0: 0, 1: 1, 2: 2}, last={0: 3, 1: 3, 2: 1}, pinned=[2], freq={0: 5, 1: 2})
    out = plan_reference(t, [7, 8, 9], step=4, fetch_fraction=(1.0, 0))
    # free slot 3, then of slots 0/1 (same step) the less frequently used expert's (1); the
    # pinned slot 2, although the oldest, stays
    assert out["fetch"] == [(7, 3), (8, 1), (9, 0)] and t.slot_of_expert[2] == 2
    out = plan_reference(t, [10], step=5, fetch_fraction=(1.0, 0))
    assert out["fetch"] == [(10, 0)]   # three slots last used at step 4, once each: the lowest


def test_every_slot_in_use_sends_the_rest_to_the_cpu():
    t = _tables(16, 2, {0: 0, 1: 1})
    out = plan_reference(t, [0, 1, 5, 6], step=1, fetch_fraction=(1.0, 0))
    assert out["fetch"] == [] and out["cpu_ids"] == [-1, -1, 5, 6]


def test_the_most_frequent_misses_are_fetched_and_at_least_min_fetch():
    t = _tables(16, 8, {}, freq={4: 1, 5: 9, 6: 3})
    out = plan_reference(t, [4, 5, 6, 6], step=1, fetch_fraction=(0.3, 0))
    # 3 unique misses, 0.3 of them rounds to 1: the most frequent (5, then 6 counted twice)
    assert [e for e, _ in out["fetch"]] == [5]
    assert out["cpu_ids"] == [4, -1, 6, 6]
    t = _tables(16, 8, {}, freq={4: 1, 5: 9, 6: 3})
    out = plan_reference(t, [4, 5, 6, 6], step=1, fetch_fraction=(0.0, 2))
    assert [e for e, _ in out["fetch"]] == [5, 6] and out["cpu_ids"] == [4, -1, -1, -1]


def test_guessed_hits_wait_for_their_bytes():
    t = _tables(16, 4, {0: 0})
    assert prefetch_reference(t, [3], reserve=0, step=2) == [(3, 1)]   # slot 1, used this step
    out = plan_reference(t, [0, 3, 0], step=2, fetch_fraction=(1.0, 0))
    # expert 0 was resident before the step (twice selected: both now), 3 arrives on its guess
    assert out["pair_slots"] == [[0, -1, 0], [-1, 1, -1]]
    assert out["hits"] == 3 and out["prefetch_hits"] == 1


def test_prefetch_skips_resident_and_duplicates_and_leaves_the_reserve():
    t = _tables(16, 6, {0: 0, 1: 1}, last={0: 1, 1: 1})
    got = prefetch_reference(t, [0, 7, 7, 8, 9, 10], reserve=2, step=3)
    # 6 evictable slots, 2 kept for the layer's own misses: 4 guesses at most, resident 0 skipped
    assert [e for e, _ in got] == [7, 8, 9, 10]
    assert [s for _, s in got] == [2, 3, 4, 5]             # free slots before the used ones
    got = prefetch_reference(t, [11, 12, 13], reserve=2, step=3)   # 4 slots are now this step's
    assert got == []
