"""The offload runtime's CPU-testable parts: host bank layout, cache placement, budget,
scheduler rule, routing traces. (The device-side decode step: test_runtime_gpu.py.)"""
import numpy as np
import pytest
import torch

from loaders import open_model
from loaders.quants import dequantize_reference
from moe_offload.offload.budget import VramLedger
from moe_offload.errors import OffloadError
from moe_offload.offload.expert_cache import ExpertCache, load_profile, save_profile
from moe_offload.offload.host_bank import HostExpertBank
from moe_offload.offload.scheduler import Rates, Scheduler
from moe_offload.instrument.trace import TraceParams, make_trace, trace_stats


@pytest.fixture(scope="module")
def mixed(synth_model):
    return open_model(synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K",
                                  tensor_types=(("blk\\.2\\.ffn_up_exps", "Q8_0"),)))


def test_host_bank_holds_each_expert_contiguously(mixed):
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    assert len(bank.banks) == c.n_layer and bank.nbytes == sum(b.numel() for b in bank.banks)
    for L in (0, 2):
        lay = bank.layouts[L]
        assert lay.up.qtype.name == ("Q8_0" if L == 2 else "IQ3_S")
        assert lay.down.qtype.name == "Q6_K"
        assert lay.expert_bytes % 256 == 0 and lay.gate.offset == 0
        for e in (0, 7, c.n_expert - 1):
            row = bank.expert(L, e).numpy()
            for proj, name in ((lay.gate, "gate"), (lay.up, "up"), (lay.down, "down")):
                w = mixed.weights[f"blk.{L}.ffn_{name}_exps.weight"]
                want = w.data.reshape(c.n_expert, -1)[e]
                got = row[proj.offset:proj.offset + proj.nbytes]
                assert np.array_equal(got, want), (L, e, name)


def test_host_bank_splits_fused_gate_up(tiny_model, tmp_path):
    from helpers import fused_gate_up, rewrite
    add, drop = fused_gate_up(tiny_model)
    fused_model = open_model(rewrite(tiny_model, tmp_path / "f.gguf", drop=drop, add=add))
    a = HostExpertBank(open_model(tiny_model), pin=False, threads=1)
    b = HostExpertBank(fused_model, pin=False, threads=2)
    for L in range(4):
        assert torch.equal(a.banks[L], b.banks[L])


def test_cache_admit_warm_start_and_profile(mixed, tmp_path):
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    cache = ExpertCache(bank.layouts, [5] * c.n_layer, c.n_expert, torch.device("cpu"))
    assert cache.nbytes == sum(5 * lay.expert_bytes for lay in bank.layouts)
    counts = np.zeros((c.n_layer, c.n_expert), np.int64)
    counts[:, 9] = 100
    counts[:, 3] = 50
    counts[:, 12] = 10
    p = tmp_path / "prof.json"
    save_profile(p, counts, "tiny")
    prof = load_profile(p, c.n_layer, c.n_expert)
    cache.warm_start(bank, prof, pin_fraction=0.4)
    for L in range(c.n_layer):
        res = set(cache.resident(L).tolist())
        assert {9, 3, 12} <= res and len(res) == 5
        soe = cache.slot_of_expert[L]
        s9 = int(soe[9])
        assert int(cache.slot_pinned[L, s9]) == 1 and int(cache.slot_pinned[L, int(soe[12])]) == 0
        assert torch.equal(cache.pools[L][s9], bank.expert(L, 9))
        assert int(cache.expert_of_slot[L, s9]) == 9
    with pytest.raises(OffloadError, match="profile is for"):
        load_profile(p, c.n_layer + 1, c.n_expert)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(OffloadError, match="not a routing profile"):
        load_profile(tmp_path / "bad.json", c.n_layer, c.n_expert)


def test_cache_stats_columns_and_prefetch_rates(mixed):
    """The stats table's columns as the kernels write them (csrc/offload_exchange.h), and the
    prefetch precision / recall derived from them."""
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    cache = ExpertCache(bank.layouts, [5] * c.n_layer, c.n_expert, torch.device("cpu"))
    assert cache.read_stats().prefetch_precision == 0.0 == cache.read_stats().prefetch_recall
    # layer 0: 30 hits (6 of them on prefetched experts), 3 fetched, 1 on the CPU; 8 prefetched
    cache.stats[0] = torch.tensor([30, 3, 1, 6, 8], dtype=torch.int32)
    s = cache.read_stats()
    assert (s.hits[0], s.fetched[0], s.cpu[0], s.prefetch_hits[0], s.prefetched[0]) == (30, 3, 1, 6, 8)
    assert s.selections == 34 and s.hit_rate == 30 / 34
    assert s.prefetch_precision == 6 / 8
    assert s.prefetch_recall == 6 / (6 + 3 + 1)   # the misses there would have been without it
    cache.reset_stats()
    assert cache.read_stats().selections == 0


def _fill(cache, bank, L, experts, last, pinned=()):
    """Place `experts` of layer L in slots 0.. with the given last-use steps (host-side)."""
    cache.admit(L, list(experts), bank)
    for e, step in zip(experts, last):
        s = int(cache.slot_of_expert[L, e])
        cache.slot_last_use[L, s] = step
        cache.slot_pinned[L, s] = int(e in pinned)


def test_cache_shrink_keeps_the_most_valuable_experts_and_their_bytes(mixed):
    """resize() down: pinned experts first, then those of highest score, then the most recently
    used (frequency breaks ties) stay, moved into the remaining slots with their bytes; the rest
    leave; tables stay consistent. Growing again adds empty slots. (CPU: the elastic bookkeeping
    without VMM.)"""
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    E = c.n_expert
    cache = ExpertCache(bank.layouts, [8] * c.n_layer, E, torch.device("cpu"), elastic=True)
    assert cache.capacity == [E] * c.n_layer and cache.slots == [8] * c.n_layer
    experts = [0, 1, 2, 3, 4, 5, 6, 7]
    last = [1, 9, 2, 8, 3, 7, 4, 6]                  # recency: 1, 3, 5, 7, 6, 4, 2, 0
    _fill(cache, bank, 0, experts, last, pinned=(0,))
    assert cache.nbytes == 8 * sum(lay.expert_bytes for lay in bank.layouts)

    assert cache.resize([4] * c.n_layer) == [4] * c.n_layer
    assert cache.nbytes == 4 * sum(lay.expert_bytes for lay in bank.layouts)
    kept = set(cache.resident(0).tolist())
    assert kept == {0, 1, 3, 5}, kept                 # pinned 0, then last use 9, 8, 7
    for e in range(E):
        s = int(cache.slot_of_expert[0, e])
        if e in kept:
            assert 0 <= s < 4 and int(cache.expert_of_slot[0, s]) == e
            assert torch.equal(cache.pools[0][s], bank.expert(0, e)), f"expert {e} moved without its bytes"
        else:
            assert s == -1
    assert int(cache.slot_pinned[0, int(cache.slot_of_expert[0, 0])]) == 1
    assert int(cache.slot_last_use[0, int(cache.slot_of_expert[0, 1])]) == 9
    assert (cache.expert_of_slot[0, 4:] == -1).all() and (cache.slot_last_use[0, 4:] == 0).all()
    assert cache.n_slots.tolist() == [4] * c.n_layer

    _fill(cache, bank, 1, [10, 11, 12], [5, 5, 5])    # equally recent: frequency decides
    cache.expert_freq[1, 11], cache.expert_freq[1, 12] = 3, 7
    cache.resize([2, 1] + [4] * (c.n_layer - 2))
    assert set(cache.resident(0).tolist()) == {0, 1}
    assert cache.resident(1).tolist() == [12]
    assert torch.equal(cache.pools[1][0], bank.expert(1, 12))

    _fill(cache, bank, 2, [13, 14, 15], [9, 8, 1])     # 15 is the oldest but chosen most lately
    cache.expert_score[2, 15], cache.expert_seen[2, 15] = 3 << 16, 1
    cache.expert_score[2, 13], cache.expert_seen[2, 13] = 1 << 16, 9
    cache.resize([2, 1, 1] + [4] * (c.n_layer - 3))
    assert cache.resident(2).tolist() == [15]          # 3 * 0.99^8 beats 1

    assert cache.resize([E + 5] * c.n_layer) == [E] * c.n_layer   # capped at the capacity
    assert set(cache.resident(0).tolist()) == {0, 1}
    assert (cache.expert_of_slot[0, 2:] == -1).all()  # new slots start empty


def test_cache_that_cannot_grow_stays_consistent(mixed):
    """A device that cannot map more memory (another program took it) in the middle of growing:
    the layers before keep their new size, the rest their old one, the tables say so, and the
    error names the layer."""
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    cache = ExpertCache(bank.layouts, [2] * c.n_layer, c.n_expert, torch.device("cpu"), elastic=True)

    class Buffer:   # an ElasticBuffer whose third layer's device is full
        def __init__(self, layer):
            self.layer, self.chunk, self.capacity, self.mapped = layer, 1, 1 << 40, 0

        def resize(self, nbytes):
            if self.layer == 2 and nbytes > self.mapped:
                raise RuntimeError("cuMemCreate (out of device memory?): out of memory")
            self.mapped = nbytes
            return nbytes

    cache._buffers = [Buffer(L) for L in range(c.n_layer)]
    with pytest.raises(OffloadError, match="could not grow to 6 slots in layer 2"):
        cache.resize([6] * c.n_layer)
    assert cache.slots == [6, 6] + [2] * (c.n_layer - 2)
    assert cache.n_slots.tolist() == cache.slots


def test_fixed_cache_cannot_grow(mixed):
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    cache = ExpertCache(bank.layouts, [5] * c.n_layer, c.n_expert, torch.device("cpu"))
    assert not cache.elastic and cache.capacity == [5] * c.n_layer
    assert cache.resize([9] * c.n_layer) == [5] * c.n_layer
    assert cache.resize([3] * c.n_layer) == [3] * c.n_layer
    assert cache.nbytes == sum(5 * lay.expert_bytes for lay in bank.layouts)  # still allocated


def test_plan_slots_respects_budget(mixed):
    bank = HostExpertBank(mixed, pin=False, threads=2)
    lays = bank.layouts
    per = max(lay.expert_bytes for lay in lays)
    c = mixed.config
    L, E = c.n_layer, c.n_expert
    # even by count, then what is left buys one more slot, first layers first
    budget = per * L * 3 + 5
    got = ExpertCache.plan_slots(lays, budget, E)
    left = budget - 3 * sum(lay.expert_bytes for lay in lays)
    want = [3] * L
    for i, lay in enumerate(lays):
        if lay.expert_bytes <= left:
            want[i], left = 4, left - lay.expert_bytes
    assert got == want and sum(s * lay.expert_bytes for s, lay in zip(got, lays)) <= budget
    assert ExpertCache.plan_slots(lays, 10**12, E) == [E] * L
    # pools mapped in chunks: each layer rounds up to whole chunks, paid from the budget
    chunk = 2 * per + 7
    assert ExpertCache.plan_slots(lays, chunk * L, E, chunk) == [2] * L
    # 3 a layer would need 2 chunks each: the extra per * L buys a second chunk for
    # per * L // chunk layers (the first ones)
    extra = per * L // chunk
    assert ExpertCache.plan_slots(lays, chunk * L + per * L, E, chunk) == \
        [3] * extra + [2] * (L - extra)
    assert ExpertCache.plan_slots(lays, chunk * L - 1, E, chunk) == [0] * L


def test_budget_refuses_with_numbers():
    b = VramLedger(8 << 30)
    b.reserve("dense weights", 3 << 30)
    b.reserve("kv", 1 << 30)
    assert b.left == 4 << 30
    with pytest.raises(OffloadError, match=r"--vram 8.00 GiB is too small: cache needs 5.00 GiB but "
                                           r"only 4.00 GiB is left \(dense weights 3.00 GiB, kv 1.00 GiB\)"):
        b.reserve("cache", 5 << 30)
    b.release("kv")
    assert b.left == 5 << 30


def test_scheduler_splits_misses_by_rates():
    s = Scheduler.create(Rates(45e9, 15e9), torch.device("cpu"))
    assert s.q() == pytest.approx(0.75) and float(s.fetch_fraction[0]) == pytest.approx(0.75)
    assert s.min_fetch() == 3 and float(s.fetch_fraction[1]) == 3   # one CPU expert = 3 fetched
    s.observe_cpu(busy_s=1.0, expert_bytes=45e9)  # CPU turned out as fast as the link
    assert 0.5 < s.q() < 0.75
    forced = Scheduler.create(Rates(45e9, 15e9), torch.device("cpu"), forced=0.0)
    assert forced.q() == 0.0 and float(forced.fetch_fraction[0]) == 0.0
    assert float(forced.fetch_fraction[1]) == 0.0   # forced means exactly that share


def test_trace_has_the_stated_locality():
    tr = make_trace(300, 3, 256, 8, TraceParams(seed=1))
    assert tr.shape == (300, 3, 8)
    assert all(len(set(tr[t, l])) == 8 for t in range(300) for l in range(3))
    st = trace_stats(tr, 256)
    assert 0.38 < st.repeat_next < 0.52 and 0.72 < st.repeat_within8 < 0.88
    assert 0.4 < st.top10_share < 0.6
    uniform = trace_stats(make_trace(300, 2, 256, 8, TraceParams(repeat=0.0, skew=0.0)), 256)
    assert uniform.repeat_next < 0.1 and uniform.top10_share < 0.2


def test_host_buffer_is_one_aligned_range():
    """The banks' memory: the size asked for, starting on a 2 MiB boundary where the system can
    advise huge pages (fewer translations for the GPU's reads), writable end to end."""
    import mmap

    from moe_offload.offload.host_bank import HUGE_PAGE, host_buffer
    buf = host_buffer(5 * HUGE_PAGE + 4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * HUGE_PAGE + 4096
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf[0]) == 7


def test_host_bank_layers_share_one_buffer(mixed):
    bank = HostExpertBank(mixed, pin=False)
    end = bank.banks[0].data_ptr()
    for b in bank.banks:   # back to back, in layer order: one range to pin
        assert b.data_ptr() == end
        end += b.numel()
    assert end - bank.banks[0].data_ptr() == bank.nbytes


def test_prefill_choices_and_a_profile_join_the_eviction_scores(mixed):
    """A prefill chunk weighs as many decode steps as it has tokens (decayed); a warm start from
    a routing profile starts each expert at the score its rate would settle at."""
    from moe_offload.config import OffloadPolicy
    from native.offload_native import SCORE_ONE, score_decay_table
    SCORE_DECAY = OffloadPolicy().score_decay
    bank = HostExpertBank(mixed, pin=False, threads=2)
    c = mixed.config
    cache = ExpertCache(bank.layouts, [3] * c.n_layer, c.n_expert, torch.device("cpu"))
    counts = torch.zeros(c.n_expert, dtype=torch.long)
    counts[3], counts[4] = 10, 5            # of a 10-token chunk: every token chose 3, half 4
    cache.observe_chunk(0, counts, 10, torch.tensor(5, dtype=torch.int32))
    weight = (1 - SCORE_DECAY ** 10) / (1 - SCORE_DECAY)
    score = cache.expert_score[0]
    assert abs(int(score[3]) / SCORE_ONE - weight) < 1e-4
    assert abs(int(score[4]) / SCORE_ONE - weight / 2) < 1e-4 and int(score[5]) == 0
    assert int(cache.expert_seen[0, 3]) == 5
    before = int(score[3])
    cache.observe_chunk(0, torch.zeros(c.n_expert, dtype=torch.long), 4,
                        torch.tensor(8, dtype=torch.int32))   # nothing chosen, 3 steps later
    assert int(cache.expert_score[0, 3]) == (before * int(score_decay_table(SCORE_DECAY)[3])) >> 16
    assert int(cache.expert_score[1, 3]) == 0                  # other layers untouched
    prof = np.zeros((c.n_layer, c.n_expert), np.int64)
    prof[:, 9] = 30
    prof[:, 2] = 10
    cache.warm_start(bank, prof, top_k=c.n_expert_used)
    share = 30 / 40 * c.n_expert_used                           # choices a token
    assert abs(int(cache.expert_score[0, 9]) / SCORE_ONE - share / (1 - SCORE_DECAY)) < 1e-3


def test_dense_weights_pack_into_one_allocation(mixed):
    """On a GPU the dense weights are copied into one allocation (views of it): the same bytes,
    aligned, one storage. Packing is device-agnostic, so the CPU checks it."""
    from moe_offload.models.weights import ARENA_ALIGN, _pack, upload_weights
    from native.ops import QTensor
    tensors, _ = upload_weights(mixed, "cpu", experts_device="cpu")
    raw = lambda t: t.data if isinstance(t, QTensor) else t
    before = {n: raw(t).clone() for n, t in tensors.items()}
    _pack(tensors, list(tensors), torch.device("cpu"))
    storages = {raw(t).untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1 and len(tensors) > 10
    base = storages.pop()   # CUDA allocations start 512-aligned; offsets keep the alignment
    for n, t in tensors.items():
        d = raw(t)
        assert torch.equal(d, before[n]) and (d.data_ptr() - base) % ARENA_ALIGN == 0, n


def test_short_prompts_need_no_dequantized_expert_group(mixed, monkeypatch):
    """A prompt of at most ops.PREFILL_MOE_MIN_TOKENS tokens runs the experts through the decode
    kernels, so its workspace estimate (what the elastic cache lends it) has no bf16 group."""
    from moe_offload.offload.placement import prefill_workspace_bytes
    from native import ops
    c = mixed.config
    short = prefill_workspace_bytes(c, 16, 16)
    monkeypatch.setattr(ops, "PREFILL_MOE_MIN_TOKENS", 8)
    assert prefill_workspace_bytes(c, 16, 16) >= short
    group = 3 * 32 * c.n_ff_exp * c.n_embd * 2
    assert prefill_workspace_bytes(c, 128, 128) >= group    # long prompts: the GEMM path


def test_prompt_chunk_fits_the_reserved_workspace_at_any_context():
    """Without a chunk asked for, a prompt goes in the fewest even chunks whose workspace is
    within the one the plan reserves (the policy's chunk). A chunk reads the cache a tile at a
    time, so that workspace does not grow with the context: at 4K, 53K or 262K the same chunks,
    never more than the policy's size asks for. The 35B's shapes."""
    from loaders.synth import PRESETS, _config
    from moe_offload.config import OffloadPolicy
    from moe_offload.offload.placement import prefill_workspace_bytes as ws, prompt_chunk
    c, pol = _config(PRESETS["35b-a3b"], 248320, 40), OffloadPolicy()
    P = pol.prefill_chunk
    for n_ctx in (4096 + P, 53248, 262144):
        budget = ws(c, P, n_ctx)
        assert prompt_chunk(c, 100, 100, n_ctx, pol) == P                  # one chunk anyway
        for n, past in [(P + 275, 0), (3 * P, 0), (17657, 0), (4097, 1000)]:
            if past + n > n_ctx:
                continue
            chunk = prompt_chunk(c, n, past + n, n_ctx, pol)
            pieces = -(-n // chunk)
            assert ws(c, chunk, past + n) <= budget, (n, past, n_ctx)
            assert pieces == -(-n // P), (n, past, n_ctx)    # the fewest the reserve allows
            assert pieces * chunk - n < pieces                # even: no short last chunk
    # the workspace of a chunk is the same at 32K and at 262K (one tile of the cache)
    assert ws(c, P, 32768) == ws(c, P, 262144)


def test_prefill_workspace_covers_what_the_35b_used():
    """The estimate stays above torch's measured peak on the 35B under an 8 GiB cap, where one
    large chunk at the start of a sequence makes the chunked delta rule the largest phase (an
    estimate that counted a quarter of its blocks let a 3,000-token first prompt run out of
    memory). Measured use in MiB, with the allocator's slack the estimate keeps on top."""
    from loaders.synth import PRESETS, _config
    from moe_offload.offload.placement import prefill_workspace_bytes as ws
    c = _config(PRESETS["35b-a3b"], 248320, 40)
    for tokens, kv_end, used in [(2048, 2048, 790), (3000, 3000, 1152), (6000, 6000, 2269),
                                 (10000, 10000, 3800), (8829, 17657, 3334)]:
        assert ws(c, tokens, kv_end) >= 1.15 * used * 2**20, (tokens, kv_end)
