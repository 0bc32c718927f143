"""Speculative decoding under the offload runtime (a VRAM cap): greedy output equal to the same
runtime's plain greedy decoding, with graphs and without, for fixed and adaptive k, on a tiny
model whose MTP head agrees with the trunk on ~70% of tokens (accepts and rejections both).
Needs CUDA (the lead runs these on the H200: scripts/dev/mtp_gpu.sh)."""
import pytest
import torch

from loaders import open_model

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 300, 42, 9, 100, 77, 12]


@pytest.fixture(scope="module")
def loaded(synth_model):
    return open_model(synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K",
                                  mtp_agree=0.7))


def _runtime(loaded, graphs):
    from moe_offload import open_runtime
    return open_runtime(loaded, 2 << 30, ctx=256, cache_slots=6, use_graphs=graphs, mtp=True)


def _greedy(rt, draft=None, n=48):
    from moe_offload.gen import SamplingParams, generate
    evs = list(generate(rt, rt.new_state(1, 256), PROMPT,
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eog=True), draft=draft))
    return list(evs[-1].tokens)


@pytest.mark.parametrize("graphs", [True, False])
def test_speculative_greedy_equals_plain_under_a_cap(loaded, graphs):
    from moe_offload.spec import SpeculativeDecoder
    rt = _runtime(loaded, graphs)
    try:
        assert rt.mtp is not None
        ref = _greedy(rt)
        for k in (1, 2, 3, "auto", 0):   # 0: plain steps, each queued behind the last
            d = SpeculativeDecoder(rt, rt.mtp, k)
            # a mismatch right after a near tie would be numerics (a verify step's matmuls see
            # k+1 rows); report the step so it can be told from a rollback bug
            got = _greedy(rt, d)
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            assert first is None, (k, first, d.stats.as_dict())
            if k not in ("auto", 0):
                assert 0 < d.stats.accepted < d.stats.drafted, d.stats.as_dict()
    finally:
        rt.close()


def test_verify_logits_match_decode_steps(loaded):
    """A verify step of T tokens gives the logits T decode steps give (same runtime)."""
    rt = _runtime(loaded, True)
    try:
        toks = [3, 4, 5, 6]
        st = rt.new_state(1, 256)
        rt.keep_steps(st, 3)
        rt.prefill(torch.tensor([PROMPT], device="cuda"), st)
        snap = st.snapshot()
        dec = [rt.decode(torch.tensor([t], device="cuda"), st) for t in toks]
        st.restore(snap)
        logits, hidden = rt.verify(torch.tensor([toks], device="cuda"), st)
        assert hidden.shape == (1, 4, loaded.config.n_embd)
        for i, d in enumerate(dec):
            err = float((logits[0, i] - d[0]).abs().max())
            assert err <= 2e-2 * float(d.abs().max()), (i, err)
        st.rewind(2)      # keep 2 of the 4: the next decode step equals one after 2 decodes
        a = rt.decode(torch.tensor([toks[2]], device="cuda"), st)
        assert float((a - dec[2]).abs().max()) <= 2e-2 * float(dec[2].abs().max())
    finally:
        rt.close()


def _mtp_expert_bytes(loaded):
    from loaders.model import mtp_weights
    return sum(w.data.nbytes for n, w in mtp_weights(loaded).items() if "_exps." in n)


def test_mtp_experts_are_resident_and_counted_under_the_cap(loaded):
    """The MTP layer's routed experts sit in VRAM as their own entry of the start-up plan, the
    cache sized around them; with mtp_experts='host' they take no VRAM (pinned host RAM)."""
    from moe_offload import open_runtime
    want = _mtp_expert_bytes(loaded)
    rt = open_runtime(loaded, 2 << 30, ctx=256, mtp=True)
    try:
        assert rt.mtp.experts.experts.gate.device.type == "cuda"
        got = rt.report.budget["MTP experts"]
        assert want <= got <= want + (8 << 20), (got, want)   # allocator rounding only
        resident_cache = rt.report.budget["expert cache"]
    finally:
        rt.close()
    rt = open_runtime(loaded, 2 << 30, ctx=256, mtp=True, mtp_experts="host")
    try:
        assert "MTP experts" not in rt.report.budget
        assert rt.report.budget["expert cache"] >= resident_cache
        assert _greedy(rt, n=24) == _greedy(rt, __import__("moe_offload.spec.decoder", fromlist=[
            "SpeculativeDecoder"]).SpeculativeDecoder(rt, rt.mtp, 2), n=24)
    finally:
        rt.close()


def test_resident_pool_matches_the_reference_experts(loaded):
    """ResidentPool (the decode pool kernel over the whole bank) against ops.moe_ffn on the CPU
    banks, for the T a draft step gives it."""
    from moe_offload.models.weights import mtp_experts
    from moe_offload.offload.model_hooks import ResidentPool
    c = loaded.config
    cpu = mtp_experts(loaded, "cpu")
    pool = ResidentPool(mtp_experts(loaded, "cuda"), top_k=c.n_expert_used, ff=c.n_ff_exp, max_tok=8)
    g = torch.Generator().manual_seed(0)
    for T in (1, 3, 8):
        x = torch.randn(T, c.n_embd, generator=g)
        ids = torch.stack([torch.randperm(c.n_expert, generator=g)[:c.n_expert_used]
                           for _ in range(T)])
        w = torch.rand(T, c.n_expert_used, generator=g)
        ref = cpu(x, ids, w)
        got = pool(x.cuda(), ids.cuda(), w.cuda()).cpu()
        assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max()), T


def test_verify_equals_decode_bit_for_bit_with_every_expert_resident(loaded):
    """With the whole model in the cache (no miss: one pool kernel sums each token's experts),
    a verify step of T tokens gives exactly the logits of T decode steps: attention, the F32
    router and every matmul run per token as decode runs them (greedy speculative = plain)."""
    from moe_offload import open_runtime
    rt = open_runtime(loaded, 2 << 30, ctx=256, mtp=True)
    try:
        if min(rt.cache.slots) < loaded.config.n_expert:
            pytest.skip(f"the cache holds {min(rt.cache.slots)} experts a layer, not all")
        toks = [3, 4, 5, 6]
        st = rt.new_state(1, 256)
        rt.keep_steps(st, 3)
        rt.prefill(torch.tensor([PROMPT], device="cuda"), st)
        snap = st.snapshot()
        for t in toks:   # every expert these tokens route to is resident from now on
            rt.decode(torch.tensor([t], device="cuda"), st)
        st.restore(snap)
        dec = [rt.decode(torch.tensor([t], device="cuda"), st) for t in toks]
        st.restore(snap)
        logits, _ = rt.verify(torch.tensor([toks], device="cuda"), st)
        for i, d in enumerate(dec):
            assert torch.equal(logits[0, i], d[0]), (i, float((logits[0, i] - d[0]).abs().max()))
    finally:
        rt.close()


def test_speculative_equals_plain_under_a_trace_by_position(loaded):
    """Replaying a routing trace by position, verify steps route each token as the decode step
    at its position: speculative greedy = plain greedy, and the phases are timed."""
    from moe_offload.spec import SpeculativeDecoder
    from moe_offload.instrument.trace import TraceParams, make_trace
    c = loaded.config
    rt = _runtime(loaded, True)
    try:
        rt.replay(make_trace(96, c.n_layer, c.n_expert, c.n_expert_used, TraceParams()),
                  by_position=True)
        ref = _greedy(rt)
        d = SpeculativeDecoder(rt, rt.mtp, 2, phases=True)
        got = _greedy(rt, d)
        assert got == ref, (next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b),
                            d.stats.as_dict())
        ph = d.stats.phases_ms()
        assert {"draft_k2", "verify_T3", "accept", "rewind"} <= set(ph), ph
    finally:
        rt.close()


def _owing_state(rt, loaded, seed):
    """A state ready for the MTP head (keep_steps made its KV) and owed(T) -> random hidden
    states [1, T, H] and the tokens after them [1, T] on the GPU."""
    st = rt.new_state(1, 256)
    rt.keep_steps(st, 3)
    g = torch.Generator().manual_seed(seed)
    c = loaded.config

    def owed(T):
        return (torch.randn(1, T, c.n_embd, generator=g).cuda(),
                torch.randint(0, c.n_vocab, (1, T), generator=g).cuda())
    return st, owed


def test_captured_draft_equals_the_eager_head(loaded):
    """rt.draft as one captured graph gives the drafts the head gives call by call (eager, host
    positions), replayed at other positions than the one it was captured at, and leaves the MTP
    count at p + T (the drafts' rows provisional)."""
    rt = _runtime(loaded, True)
    try:
        mtp = rt.mtp
        st, owed = _owing_state(rt, loaded, 3)
        seen = set()
        for p, T, k in ((0, 2, 3), (2, 2, 3), (4, 2, 3), (6, 1, 2), (7, 1, 2), (8, 3, 1)):
            hidden, toks = owed(T)
            st.mtp_past = p
            before = rt.captures
            got = rt.draft(hidden, toks, st, k)
            seen.add((T, k, rt.captures > before))
            assert st.mtp_past == p + T
            st.mtp_past = p   # the same drafts, eagerly, one call at a time (same rows attended)
            n_attn = st.rows_attended(p + T + k - 1)
            lg, h = mtp.forward(hidden, toks, st, logits="last", n_attn=n_attn)
            want = [lg[0, -1].argmax(-1, keepdim=True)]
            for _ in range(1, k):
                lg, h = mtp.forward(h[:, -1:], want[-1][None], st, logits="last", n_attn=n_attn)
                want.append(lg[0, -1].argmax(-1, keepdim=True))
            assert got.tolist() == torch.cat(want).tolist(), (p, T, k)
        # each (T, k) captured once, then replayed at the later positions
        assert (2, 3, True) in seen and (2, 3, False) in seen and (1, 2, False) in seen
    finally:
        rt.close()


def test_captured_mtp_rows_equal_the_eager_head(loaded):
    """rt.mtp_rows (one graph of max_tok rows; shorter calls padded) writes the KV rows the head
    writes eagerly, bit for bit, moves the MTP count by the real rows only, and is captured
    once per attended length whatever the row count."""
    rt = _runtime(loaded, True)
    try:
        mtp = rt.mtp
        st, owed = _owing_state(rt, loaded, 4)
        caps = []
        for p, T in ((0, 8), (8, 3), (11, 1), (12, 5), (17, 8)):
            hidden, toks = owed(T)
            st.mtp_past = p
            before = rt.captures
            rt.mtp_rows(hidden, toks, st)
            caps.append(rt.captures - before)
            assert st.mtp_past == p + T
            got = st.mtp_k[0, p:p + T].clone(), st.mtp_v[0, p:p + T].clone()
            st.mtp_k[0, p:].zero_()
            st.mtp_v[0, p:].zero_()
            st.mtp_past = p
            mtp.forward(hidden, toks, st, logits="none")
            assert torch.equal(got[0], st.mtp_k[0, p:p + T]), (p, T)
            assert torch.equal(got[1], st.mtp_v[0, p:p + T]), (p, T)
        assert caps == [1, 0, 0, 0, 0], caps
    finally:
        rt.close()


@pytest.mark.parametrize("layers", [1, 0])
def test_guesses_while_drafting_are_used_and_change_no_token(loaded, layers):
    """The verify step's layer 0 guessed while the head drafts (the agreeing trunk routes by
    its embedding, so the guesses are good): greedy output stays plain greedy's, layer 0 gets
    guessed copies and its plans use them; at draft_guess_layers 0 it gets none (the per-layer
    guesses never reach layer 0)."""
    from moe_offload import OffloadPolicy, open_runtime
    from moe_offload.spec import SpeculativeDecoder
    rt = open_runtime(loaded, 2 << 30, ctx=256, cache_slots=10, mtp=True,
                      policy=OffloadPolicy(prefetch_k=3, draft_guess_layers=layers))
    try:
        assert rt.prefetching
        ref = _greedy(rt)
        rt.reset_stats()
        assert _greedy(rt, SpeculativeDecoder(rt, rt.mtp, 1)) == ref
        layer0 = rt.stats().per_layer[0]
        if layers:
            # hits count selections (two tokens of a step may use one copy): most copies used
            assert layer0["prefetched"] > 0 and layer0["prefetch_hits"] >= 0.6 * layer0["prefetched"], layer0
        else:
            assert layer0["prefetched"] == layer0["prefetch_hits"] == 0, layer0
    finally:
        rt.close()
