"""The residency decisions of the offload plan and prefetch kernels, in their numpy reference
(native.offload_native.plan_reference / prefetch_reference); the kernels are compared with it on
the GPU in test_offload_policy_gpu.py."""
import numpy as np

from moe_offload.config import OffloadPolicy
from native.offload_native import (SCORE_ONE, SCORE_STEPS, LayerTablesRef, decayed_scores,
                                   plan_reference, prefetch_reference, score_decay_table)

SCORE_DECAY = OffloadPolicy().score_decay
TABLE = score_decay_table(SCORE_DECAY)


def decayed_score(score, seen, step, table) -> int:
    return int(decayed_scores(score, seen, step, table))


def _tables(E: int, S: int, resident: dict[int, int], last: dict[int, int] | None = None,
            pinned=(), freq: dict[int, int] | None = None,
            score: dict[int, tuple[int, int]] | None = None) -> LayerTablesRef:
    """resident: expert -> slot; last: slot -> step of last use; freq: expert -> count;
    score: expert -> (choices, step of the last update), in whole choices."""
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
    sc, seen = np.zeros(E, np.int64), np.zeros(E, np.int64)
    for e, (n, at) in (score or {}).items():
        sc[e], seen[e] = n * SCORE_ONE, at
    return LayerTablesRef(soe, eos, lu, pin, fq, S, sc, seen, decay=TABLE)


def test_hits_stay_and_the_least_recently_used_slot_goes_first():
    t = _tables(16, 4, {0: 0, 1: 1, 2: 2, 3: 3}, last={0: 5, 1: 2, 2: 7, 3: 4})
    out = plan_reference(t, [0, 9], step=10, fetch_fraction=(1.0, 0))
    assert out["fetch"] == [(9, 1)]                        # slot 1 (used at step 2) is evicted
    assert t.slot_of_expert[1] == -1 and t.slot_of_expert[9] == 1 and t.slot_last_use[1] == 10
    assert t.slot_last_use[0] == 10                        # the hit is now used this step
    assert out["hits"] == 1 and out["cpu_ids"] == [-1, -1]
    assert out["pair_slots"] == [[0, -1], [-1, 1]]         # resident now, fetched once it lands


def test_free_slots_first_pinned_never_then_lowest_score():
    t = _tables(16, 4, {0: 0, 1: 1, 2: 2}, last={0: 3, 1: 3, 2: 1}, pinned=[2],
                score={0: (5, 3), 1: (2, 3)})
    out = plan_reference(t, [7, 8, 9], step=4, fetch_fraction=(1.0, 0))
    # free slot 3, then of slots 0/1 the expert of lower score (1); the pinned slot 2, although
    # the oldest, stays
    assert out["fetch"] == [(7, 3), (8, 1), (9, 0)] and t.slot_of_expert[2] == 2
    out = plan_reference(t, [10], step=5, fetch_fraction=(1.0, 0))
    assert out["fetch"] == [(10, 0)]   # three slots last used at step 4, chosen once each: the lowest


def test_a_frequent_expert_outlives_a_recent_one_until_its_score_decays():
    # expert 0 was chosen 6 times up to step 10, expert 1 once at step 19
    t = _tables(16, 2, {0: 0, 1: 1}, last={0: 10, 1: 19}, score={0: (6, 10), 1: (1, 19)})
    assert plan_reference(t, [5], step=20, fetch_fraction=(1.0, 0))["fetch"] == [(5, 1)]
    # six choices 190 steps before a single one weigh 6 * 0.99^190 = 0.89 of it: 0 goes
    t = _tables(16, 2, {0: 0, 5: 1}, last={0: 10, 1: 200}, score={0: (6, 10), 5: (1, 200)})
    assert plan_reference(t, [6], step=300, fetch_fraction=(1.0, 0))["fetch"] == [(6, 0)]


def test_scores_decay_in_fixed_point_and_count_each_choice():
    table = score_decay_table(SCORE_DECAY)
    assert table.shape == (SCORE_STEPS,) and table[0] == SCORE_ONE
    assert abs(table[100] / SCORE_ONE - SCORE_DECAY ** 100) < 1e-4
    assert decayed_score(3 * SCORE_ONE, 7, 7, table) == 3 * SCORE_ONE
    assert decayed_score(SCORE_ONE, 0, 10, table) == (SCORE_ONE * int(table[10])) >> 16
    assert decayed_score(SCORE_ONE, 0, SCORE_STEPS, table) == 0       # too old: forgotten
    t = _tables(16, 4, {})
    plan_reference(t, [3, 4, 3], step=5, fetch_fraction=(1.0, 0))   # two tokens chose 3
    assert t.expert_score[3] == 2 * SCORE_ONE and t.expert_score[4] == SCORE_ONE
    assert t.expert_seen[3] == 5
    plan_reference(t, [3], step=6, fetch_fraction=(1.0, 0))
    assert t.expert_score[3] == ((2 * SCORE_ONE * int(table[1])) >> 16) + SCORE_ONE


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


def test_guesses_copied_this_step_count_in_the_links_share():
    # q = 2/3: the link takes two thirds of the layer's copies. 6 misses alone: 4 fetched, 2 to
    # the CPU; with 3 guesses already copied, 2/3 of 9 = 6 copies are the link's, 3 of them the
    # guesses, so 3 misses are fetched and 3 go to the CPU
    ids = [10, 11, 12, 13, 14, 15]
    for guessed, n_fetch in ((0, 4), (3, 3), (9, 1), (12, 0)):
        t = _tables(32, 16, {})
        out = plan_reference(t, ids, step=1, fetch_fraction=(2 / 3, 0), guessed=guessed)
        assert len(out["fetch"]) == n_fetch, guessed
        assert sum(e >= 0 for e in out["cpu_ids"]) == len(ids) - n_fetch
    # the fewest to fetch still holds however many were guessed
    t = _tables(32, 16, {})
    out = plan_reference(t, ids, step=1, fetch_fraction=(2 / 3, 2), guessed=20)
    assert len(out["fetch"]) == 2
    # a link that takes everything fetches every miss, guesses or not
    t = _tables(32, 16, {})
    assert len(plan_reference(t, ids, step=1, fetch_fraction=(1.0, 0), guessed=7)["fetch"]) == 6


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
