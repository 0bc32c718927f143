"""The offload plan and prefetch kernels decide what their numpy reference decides
(native.offload_native.plan_reference / prefetch_reference, tested on the CPU in
test_offload_policy.py): random tables, random routing and guesses, over many steps."""
import numpy as np
import pytest
import torch

from moe_offload.config import OffloadPolicy
from native import offload_native as on

pytestmark = pytest.mark.gpu

L, E, S, T, K, H = 2, 40, 16, 2, 4, 64
TABLE = on.score_decay_table(OffloadPolicy().score_decay)


def _random_tables(rng):
    soe = np.full((L, E), -1, np.int32)
    eos = np.full((L, S), -1, np.int32)
    for layer in range(L):
        slots = rng.permutation(S)[:rng.integers(S // 2, S + 1)]
        for s, e in zip(slots, rng.permutation(E)[:len(slots)]):
            soe[layer, e], eos[layer, s] = s, e
    last = rng.integers(0, 5, (L, S)).astype(np.int32)
    pinned = np.zeros((L, S), np.int32)
    pinned[:, :2] = 1
    freq = rng.integers(0, 10, (L, E)).astype(np.int32)
    n_slots = np.array([S, S - 4], np.int32)
    # scores of a few choices, some stored long ago (ages past the decay table forget them)
    score = (rng.integers(0, 4, (L, E)) * on.SCORE_ONE + rng.integers(0, 1000, (L, E))).astype(np.int32)
    seen = rng.integers(-1100, 6, (L, E)).astype(np.int32)
    return soe, eos, last, pinned, freq, n_slots, score, seen


def test_plan_and_prefetch_kernels_match_the_reference():
    rng = np.random.default_rng(7)
    soe, eos, last, pinned, freq, n_slots, score, seen = _random_tables(rng)
    refs = [on.LayerTablesRef(soe[i].copy(), eos[i].copy(), last[i].copy(), pinned[i].copy(),
                              freq[i].copy(), int(n_slots[i]), score[i].astype(np.int64),
                              seen[i].astype(np.int64), decay=TABLE) for i in range(L)]
    dev = {k: torch.from_numpy(v).cuda() for k, v in
           dict(soe=soe, eos=eos, last=last, pinned=pinned, freq=freq, n_slots=n_slots,
                score=score, seen=seen).items()}
    stats = torch.zeros((L, 5), dtype=torch.int32, device="cuda")
    pending = torch.zeros(L, dtype=torch.int32, device="cuda")
    decay = torch.from_numpy(TABLE).cuda()
    tables = on.CacheTablesPtrs(dev["soe"], dev["eos"], dev["last"], dev["pinned"], dev["freq"],
                                dev["n_slots"], stats, pending, dev["score"], dev["seen"],
                                decay).as_dict()
    ex_buf = on.ExchangeBuffers.allocate(L, T, K, H, pin=True)
    ex = ex_buf.as_dict(T)
    step_t = torch.zeros((), dtype=torch.int32, device="cuda")
    fetch_list = torch.zeros(1 + 2 * 64, dtype=torch.int32, device="cuda")
    pf_list = torch.zeros(1 + 2 * 64, dtype=torch.int32, device="cuda")
    pair = torch.full((2, 64), -1, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(T, H, device="cuda", generator=g)
    w = torch.rand(T * K, device="cuda", generator=g)
    hits, pf_hits = [0, 0], [0, 0]
    for step in range(6, 30):
        step_t.fill_(step)
        # guesses for layer 1: duplicates, resident experts, out-of-range ids among them
        guess = rng.integers(-1, E + 1, 6).astype(np.int32)
        guess[1] = guess[0]
        on.prefetch(tables, 1, torch.from_numpy(guess).cuda(), T * K, step_t, pf_list)
        torch.cuda.synchronize()
        want = on.prefetch_reference(refs[1], guess.tolist(), T * K, step)
        got = pf_list.cpu().numpy()
        assert [tuple(p) for p in got[1:1 + 2 * got[0]].reshape(-1, 2).tolist()] == want, f"step {step}"
        for layer in range(L):
            ids = rng.integers(0, E, T * K).astype(np.int32)
            ids[K] = ids[0]                                       # two tokens share an expert
            frac = (float(rng.choice([0.0, 0.5, 2 / 3, 0.9, 1.0])), float(rng.choice([0, 2])))
            guessed = int(rng.choice([0, 0, 1, 3, 7]))   # experts this step's guesses copied
            on.plan(tables, ex, layer, torch.from_numpy(ids).cuda(), w, x, step_t,
                    torch.tensor(frac, dtype=torch.float32, device="cuda"), fetch_list, pair,
                    guessed=torch.tensor([guessed], dtype=torch.int32, device="cuda") if guessed else None)
            torch.cuda.synchronize()
            before = (refs[layer].expert_of_slot.tolist(), refs[layer].slot_last_use.tolist())
            ref = on.plan_reference(refs[layer], ids.tolist(), step, frac, guessed)
            what = (f"step {step} layer {layer} ids {ids.tolist()} fraction {frac} guessed {guessed}; "
                    f"before: slots {before}")
            got = fetch_list.cpu().numpy()
            assert [tuple(p) for p in got[1:1 + 2 * got[0]].reshape(-1, 2).tolist()] == ref["fetch"], what
            assert ex_buf.cpu_ids[layer].reshape(-1)[:T * K].tolist() == ref["cpu_ids"], what
            assert pair[:, :T * K].cpu().tolist() == ref["pair_slots"], what
            assert int(pending[layer]) == sum(e >= 0 for e in ref["cpu_ids"]), what
            hits[layer] += ref["hits"]
            assert int(stats[layer, 0]) == hits[layer], what
            pf_hits[layer] += ref["prefetch_hits"]
            assert int(stats[layer, 3]) == pf_hits[layer], what
        for name, col in (("soe", "slot_of_expert"), ("eos", "expert_of_slot"),
                          ("last", "slot_last_use"), ("freq", "expert_freq"),
                          ("score", "expert_score"), ("seen", "expert_seen")):
            for layer in range(L):
                assert np.array_equal(dev[name][layer].cpu().numpy(), getattr(refs[layer], col)), \
                    f"step {step}: {col} of layer {layer}"
