"""The offload runtime on a GPU: offloaded logits equal all-on-GPU logits (same kernels) within
float tolerance, whichever engine computes the misses; graphs equal eager; the cache evolves;
the cap is enforced. Needs CUDA (the lead runs these on the H200)."""
import pytest
import torch

from loaders import open_model

pytestmark = pytest.mark.gpu

PROMPT = 20
STEPS = 24


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """End to end, offloaded and resident logits differ by rounding: bf16 GEMMs in prefill grouped
    differently, int16 (CPU) vs int8 (GPU) activations where a miss runs on the CPU; a random-weight
    model compounds it over steps (measured cosine 0.988-0.99998). A sanity bound here; the exact
    check of the mechanism is test_offloaded_layers_match_reference."""
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
    assert torch.isfinite(a).all(), what
    assert cos > 0.97 and err <= 0.3 * scale, \
        f"{what}: max |diff| {err:.3g} (logit scale {scale:.3g}), cosine {cos:.5f}"


@pytest.fixture(scope="module")
def loaded(synth_model):
    return open_model(synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K"))


@pytest.fixture(scope="module")
def reference(loaded):
    """All on the GPU: logits of a prompt and of greedy decode steps (the token path to follow)."""
    from moe_offload.models import build_model
    m = build_model(loaded, "cuda")
    st = m.new_state(1, 256)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.n_vocab, (1, PROMPT), generator=g).cuda()
    out = [m.prefill(prompt, st)]
    toks = []
    for _ in range(STEPS):
        t = out[-1].argmax(-1)
        toks.append(t)
        out.append(m.decode(t, st))
    return prompt, toks, out


def _runtime(loaded, **kw):
    """open_runtime at 2 GiB, 6 slots a layer, 256 positions; OffloadPolicy fields go to the policy."""
    from moe_offload import OffloadPolicy, open_runtime
    policy = {k: kw.pop(k) for k in list(kw) if k in OffloadPolicy.__dataclass_fields__}
    # the tests here check the prefill path (what it streams, what it borrows) with prompts
    # short enough to go through decode steps by default: test_short_prompt_* checks those
    policy.setdefault("short_prompt", 0)
    kw.setdefault("cache_slots", 6)
    return open_runtime(loaded, 2 << 30, policy=OffloadPolicy(**policy), ctx=kw.pop("n_ctx", 256),
                        **kw)


def _follow(rt, prompt, toks):
    st = rt.new_state(1, 256)
    out = [rt.prefill(prompt, st)]
    for t in toks:
        out.append(rt.decode(t, st))
    return out


@pytest.mark.parametrize("fraction", [None, 0.0, 1.0])
def test_offloaded_logits_match_all_on_gpu(loaded, reference, fraction):
    prompt, toks, ref = reference
    rt = _runtime(loaded, fetch_fraction=fraction)
    try:
        out = _follow(rt, prompt, toks)
        for i, (a, b) in enumerate(zip(out, ref)):
            _close(a, b, f"step {i} (fetch fraction {fraction})")
        s = rt.stats().as_dict()
        assert s["selections"] == STEPS * loaded.config.n_layer * loaded.config.n_expert_used
        assert s["hits"] > 0
        if fraction == 0.0:
            assert s["fetched"] == 0 and s["cpu"] > 0
        elif fraction == 1.0:
            assert s["cpu"] == 0 and s["fetched"] > 0
        else:
            assert s["fetched"] + s["cpu"] > 0
        assert rt.report.slots_per_layer == [6] * loaded.config.n_layer
        assert s["prefill_streamed"] > 0  # the prompt's other experts were streamed, not cached
    finally:
        rt.close()


def test_the_cpus_repacked_copy_gives_the_same_logits(loaded, reference):
    """Every miss on the CPU (fetch fraction 0), its experts read from the repacked copy
    (IQ3_S -> IQ3_S_N4) or from the pinned banks: the same bits."""
    prompt, toks, _ = reference
    outs = {}
    for mode in ("off", "on"):
        rt = _runtime(loaded, fetch_fraction=0.0, cpu_repack=mode)
        try:
            assert (rt.report.cpu_repacked_bytes > 0) == (mode == "on")
            outs[mode] = torch.stack([o.reshape(-1) for o in _follow(rt, prompt, toks)])
            assert rt.stats().as_dict()["cpu"] > 0
        finally:
            rt.close()
    diff = float((outs["on"] - outs["off"]).abs().max())
    assert torch.equal(outs["on"], outs["off"]), f"max |diff| {diff}"


@pytest.mark.parametrize("graphs", [True, False])
def test_short_prompt_runs_as_decode_steps(loaded, reference, graphs):
    """A prompt of at most policy.short_prompt tokens goes through decode steps (max_tok tokens
    a verify step, the rest one at a time): nothing streamed through the staging, the prompt's
    experts planned as decode selections, nothing lent by the cache. Its logits are those of
    the all-on-GPU model, and at every length those of decoding the prompt a token at a
    time; with the hidden states (the MTP head's input) too. All logits take the prefill path."""
    prompt, toks, ref = reference
    c = loaded.config
    rt = _runtime(loaded, short_prompt=64, use_graphs=graphs)
    try:
        assert PROMPT % rt.engine.max_tok   # a shorter last step is covered
        out = _follow(rt, prompt, toks)
        for i, (a, b) in enumerate(zip(out, ref)):
            _close(a, b, f"step {i} (short prompt in decode steps)")
        s = rt.stats().as_dict()
        assert s["prefill_streamed"] == 0
        # the prompt's selections are the decode path's (an expert two tokens of a step chose
        # counts once)
        assert STEPS * c.n_layer * c.n_expert_used < s["selections"] \
            <= (PROMPT + STEPS) * c.n_layer * c.n_expert_used
        assert rt.cache.slots == [6] * c.n_layer
        st = rt.new_state(1, 256)   # with the hidden states (the MTP head's input)
        logits, hidden = rt.prefill(prompt, st, hidden=True)
        assert logits.shape == (1, c.n_vocab) and hidden.shape == (1, PROMPT, c.n_embd)
        assert st.n_past == PROMPT and rt.stats().prefill_streamed == 0
        _close(logits, ref[0], "the last logits, with the hidden states")
        # every position against the prompt decoded a token at a time (same kernels but the
        # pool kernel's token count)
        st = rt.new_state(1, 256)
        one = torch.stack([rt.decode(prompt[:, i], st)[0] for i in range(PROMPT)])
        for n in (1, 7, 8, 9, 16, PROMPT):
            st = rt.new_state(1, 256)
            _close(rt.prefill(prompt[:, :n], st)[0], one[n - 1], f"a prompt of {n} tokens")
        st = rt.new_state(1, 256)   # all logits: the prefill path (decode's headroom holds a step's)
        assert rt.prefill(prompt, st, all_logits=True).shape == (1, PROMPT, c.n_vocab)
        assert rt.stats().prefill_streamed > 0
    finally:
        rt.close()


def test_prefetch_changes_placement_not_results(loaded, reference):
    """Guessing the next layer's experts moves experts earlier; the logits stay those of the
    all-on-GPU model, and the guesses are counted."""
    prompt, toks, ref = reference
    outs, stats = {}, {}
    for name, kw in (("off", dict(prefetch=False)), ("on", dict(prefetch=True))):
        rt = _runtime(loaded, **kw)
        try:
            outs[name], stats[name] = _follow(rt, prompt, toks), rt.stats().as_dict()
        finally:
            rt.close()
    for i, (a, b) in enumerate(zip(outs["on"], ref)):
        _close(a, b, f"step {i} (prefetch on)")
    off, on = stats["off"], stats["on"]
    assert off["prefetched"] == 0 and on["prefetched"] > 0
    assert 0 < on["prefetch_hits"] <= on["prefetched"]
    assert 0 < on["prefetch_precision"] <= 1 and 0 < on["prefetch_recall"] <= 1
    assert on["hits"] + on["fetched"] + on["cpu"] == on["selections"] == off["selections"]
    rt = _runtime(loaded, fetch_fraction=0.0)   # CPU-only misses: nothing may cross the link
    try:
        _follow(rt, prompt, toks[:4])
        assert not rt.prefetching and rt.stats().prefetched == 0
    finally:
        rt.close()


def test_guessing_starts_and_stops_as_the_links_share_crosses_the_line(loaded, reference):
    """Guessing is decided again whenever the CPU's rate is re-measured: on at or above
    prefetch_min_fetch_share, off only below it less prefetch_hysteresis; the first change into
    a mode captures the decode step in it (with or without the guesses' kernels), a change back
    replays the step kept for that mode, and the logits stay right."""
    prompt, toks, ref = reference
    rt = _runtime(loaded)
    pol, sch = rt.policy, rt.scheduler
    band = pol.prefetch_min_fetch_share - pol.prefetch_hysteresis / 2

    def share(q):   # the CPU rate that gives the link a share q, as a re-measure would
        sch.rates.cpu_bytes_per_s = sch.rates.link_bytes_per_s * (1 - q) / q
        sch.apply()
        rt.guessing.recheck()

    try:
        st = rt.new_state(1, 256)
        out = [rt.prefill(prompt, st), rt.decode(toks[0], st)]   # the step captured once
        started = rt.prefetching
        modes = {started}   # the modes whose step has been captured
        plan = [(0.9, True), (band, True), (0.2, False), (band, False), (0.9, True)]
        for i, t in enumerate(toks[1:1 + 2 * len(plan)]):
            caps = rt.captures
            if i % 2 == 0:
                share(plan[i // 2][0])
            out.append(rt.decode(t, st))
            if i % 2 == 0:
                assert rt.prefetching == plan[i // 2][1], (i, plan[i // 2])
            new = rt.prefetching not in modes   # captured iff this mode's step is new
            assert (rt.captures > caps) == new, i
            modes.add(rt.prefetching)
        assert rt.guessing_changes == (2 if started else 3)
        for i, (a, b) in enumerate(zip(out, ref)):
            _close(a, b, f"step {i}")
    finally:
        rt.close()


@pytest.mark.parametrize("fraction,overlap", [(0.5, True), (0.0, True), (1.0, True), (0.5, False)])
def test_offloaded_layers_match_reference(loaded, fraction, overlap):
    """One decode step at a time, every MoE layer through the device-side path (plan, fetch,
    pool kernel(s), CPU worker, wait/add) against the float reference of that layer, while the
    cache fills, evicts and hands misses to the CPU; overlap: resident experts computed while
    the misses are fetched on their own stream, the fetched ones added after."""
    from native.ops import QTensor, moe_ffn_ref
    c = loaded.config
    rt = _runtime(loaded, fetch_fraction=fraction, overlap_misses=overlap)
    eng = rt.engine
    refs = [[QTensor.from_weight(loaded.weights[f"blk.{L}.ffn_{p}_exps.weight"])
             for p in ("gate", "up", "down")] for L in range(c.n_layer)]
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(12):
            eng.arm(1)
            outs = []
            with eng.decode_step():
                for L in range(c.n_layer):
                    x = torch.randn(1, c.n_embd, generator=g)
                    ids = torch.randperm(c.n_expert, generator=g)[:c.n_expert_used].view(1, -1)
                    w = torch.softmax(torch.randn(1, c.n_expert_used, generator=g), -1)
                    y = eng.decode_layer(L, x.cuda(), ids.cuda(), w.cuda())
                    outs.append((y, moe_ffn_ref(x, *refs[L], ids, w)))
            eng.settle()
            eng.check()
            for L, (y, ref) in enumerate(outs):
                y = y.cpu()
                err = float((y - ref).abs().max() / ref.abs().max())
                cos = float(torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0))
                assert err < 0.03 and cos > 0.9995, f"step {step} layer {L}: rel err {err:.3g}, cos {cos:.6f}"
        s = rt.stats()
        assert s.hits > 0
        assert (s.fetched > 0) == (fraction > 0) and (s.cpu > 0) == (fraction < 1)
    finally:
        rt.close()


def test_elastic_cache_lends_its_memory_to_prefill_and_takes_it_back(loaded, reference, monkeypatch):
    """A prefill whose workspace does not fit beside the cache shrinks it (here to nothing: every
    expert streams); the next decode step grows it back; a shrink in the middle of decoding keeps
    the experts of highest score, then the most recent (moved with their bytes). The prefill
    staging is freed after the prompt (lent to the cache). Logits stay the all-on-GPU ones."""
    import moe_offload.offload.elastic as elastic
    from native import offload_native as on
    prompt, toks, ref = reference
    rt = _runtime(loaded, cache_slots=10)
    try:
        if not rt.cache.elastic:
            pytest.skip("this GPU has no virtual memory management")
        L = loaded.config.n_layer
        assert rt.cache.slots == [10] * L
        st = rt.new_state(1, 256)
        with monkeypatch.context() as m:   # a prompt that needs the whole cap
            m.setattr(elastic, "prefill_workspace_bytes", lambda *a, **k: rt.opts.vram)
            out = [rt.prefill(prompt, st)]
        assert rt.cache.slots == [0] * L and rt.stats().prefill_streamed > 0
        assert rt.engine.staging is None   # streamed through it, then lent to the cache
        for t in toks[:12]:
            out.append(rt.decode(t, st))
        assert rt.cache.slots == [10] * L     # taken back by the first decode step
        last = rt.cache.slot_last_use.cpu()
        eos = rt.cache.expert_of_slot.cpu()
        score, seen = rt.cache.expert_score.cpu().numpy(), rt.cache.expert_seen.cpu().numpy()
        table = rt.cache.score_decay.cpu().numpy()
        used = []   # expert -> (decayed score, step of last use), before the shrink
        for la in range(L):
            value = on.decayed_scores(score[la], seen[la], int(seen[la].max()), table)
            used.append({int(eos[la, s]): (int(value[eos[la, s]]), int(last[la, s]))
                         for s in range(10) if eos[la, s] >= 0})
        rt.cache.resize([4] * L)
        for layer in range(L):
            kept = set(rt.cache.resident(layer).tolist())
            left = set(used[layer]) - kept
            assert len(kept) == 4 and kept <= set(used[layer])
            assert min(used[layer][e] for e in kept) >= max(used[layer][e] for e in left), \
                f"layer {layer}: an expert of lower score (or as high, less recent) stayed"
            for e in kept:
                s = int(rt.cache.slot_of_expert[layer, e])
                assert s < 4 and torch.equal(rt.cache.pools[layer][s].cpu(), rt.bank.expert(layer, e))
        for t in toks[12:]:
            out.append(rt.decode(t, st))
        for i, (a, b) in enumerate(zip(out, ref)):
            _close(a, b, f"step {i} (elastic)")
        assert rt.vram_peaks()["cache_peak"] >= rt.cache.nbytes
    finally:
        rt.close()


def test_elastic_kv_grows_with_the_context_and_gives_its_memory_back(loaded, monkeypatch):
    """The KV maps memory as the conversation grows, the cache giving up slots when the cap
    cannot hold both; a new conversation gives the KV's memory back to the cache. Logits follow
    those of a runtime whose KV is allocated for the whole context."""
    from native import offload_native as on
    if not on.elastic_supported():
        pytest.skip("this GPU has no virtual memory management")
    c = loaded.config
    chunk = on.elastic_chunk()
    per_chunk = chunk // (c.n_head_kv * c.head_dim * 2)      # float16 positions in one chunk
    n_ctx, n_prompt = 3 * per_chunk + 256, 2 * per_chunk + 100
    n_kv = 2 * len(c.attention_layers)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, c.n_vocab, (1, n_prompt), generator=g).cuda()
    outs, toks = {}, []
    for elastic in (False, True):
        rt = _runtime(loaded, n_ctx=n_ctx, elastic=elastic, cache_slots=10)
        try:
            st = rt.new_state(1, n_ctx)
            assert st.elastic_kv == elastic
            if elastic:
                assert st.kv_rows == per_chunk and rt.stats().kv_bytes == n_kv * chunk
                with monkeypatch.context() as m:   # no room beside the cache: it gives way
                    m.setattr(rt.vram, "policy", rt.policy.with_(decode_graphs=rt.opts.vram,
                                                                 decode_extra=0))
                    out = [rt.prefill(prompt, st)]
                assert st.kv_rows >= n_prompt and rt.stats().kv_bytes == n_kv * 3 * chunk
                assert rt.cache.slots == [0] * c.n_layer
            else:
                out = [rt.prefill(prompt, st)]
            for i in range(6):
                if not elastic:
                    toks.append(out[-1].argmax(-1))
                out.append(rt.decode(toks[i], st))
            outs[elastic] = out
            if elastic:   # a new conversation: the KV shrinks, the next decode regrows the cache
                st = rt.new_state(1, n_ctx)
                assert rt.stats().kv_bytes == n_kv * chunk
                rt.prefill(prompt[:, :16], st)
                rt.decode(toks[0], st)
                assert rt.cache.slots == [10] * c.n_layer
        finally:
            rt.close()
    for i, (a, b) in enumerate(zip(outs[True], outs[False])):
        _close(a, b, f"step {i} (elastic KV)")


def test_embedding_and_head_in_host_ram_give_the_same_logits(loaded, reference):
    """Weights kept in pinned host RAM and read by the kernels over PCIe: same results."""
    prompt, toks, ref = reference
    rt = _runtime(loaded, host_head=True)
    try:
        names = {"token_embd.weight"} | ({"output.weight"} if "output.weight" in loaded.weights else set())
        assert set(rt.report.host_weights) == names
        host = rt.pinned.tensors[0]
        assert rt.model.embd.data.data_ptr() == host.data_ptr()   # the GPU reads host memory
        for i, (a, b) in enumerate(zip(_follow(rt, prompt, toks), ref)):
            _close(a, b, f"step {i} (embedding + head in host RAM)")
    finally:
        rt.close()


def test_graphs_equal_eager(loaded, reference):
    prompt, toks, _ = reference
    # all misses on the GPU: the same kernels compute every expert, whatever the cache decides;
    # one runtime at a time (the allocator cap is per process: a second runtime would see the
    # first's memory and plan its prefill differently)
    outs = []
    for graphs in (True, False):
        rt = _runtime(loaded, fetch_fraction=1.0, use_graphs=graphs)
        try:
            outs.append(_follow(rt, prompt, toks))
        finally:
            rt.close()
    # Graph and eager steps sum a layer's experts in the same kernels but not always in the same
    # order (measured: ~1e-7 apart). Where such a difference moves an activation across an int8
    # rounding boundary of the q8 kernels, one step's logits jump by ~1e-3 and the next steps
    # agree again (seen at one of 24 steps after f16 prefill GEMMs; runs of one mode are
    # bitwise repeatable). So: every step within 1e-2, all but one within 1e-4.
    diffs = [float((x - y).abs().max()) for x, y in zip(*outs)]
    assert max(diffs) <= 1e-2, diffs
    assert sum(d > 1e-4 for d in diffs) <= 1, diffs


def test_cache_evolves_and_keeps_pinned_hot_set(loaded, reference, tmp_path):
    import numpy as np
    from moe_offload.offload.expert_cache import save_profile
    c = loaded.config
    counts = np.zeros((c.n_layer, c.n_expert), np.int64)
    counts[:, 5] = 1000
    save_profile(tmp_path / "p.json", counts)
    prompt, toks, _ = reference
    rt = _runtime(loaded, fetch_fraction=1.0, profile=str(tmp_path / "p.json"))
    try:
        before = [set(rt.cache.resident(L).tolist()) for L in range(c.n_layer)]
        assert all(5 in r for r in before), f"resident {before}, slots {rt.cache.slots}"
        _follow(rt, prompt, toks)
        after = [set(rt.cache.resident(L).tolist()) for L in range(c.n_layer)]
        assert any(a != b for a, b in zip(after, before))       # fetches replaced experts
        assert all(5 in r and len(r) == 6 for r in after)       # pinned expert 5 stayed
        for L in range(c.n_layer):                              # slot bytes = host bytes
            for e in after[L]:
                s = int(rt.cache.slot_of_expert[L, e])
                assert torch.equal(rt.cache.pools[L][s].cpu(), rt.bank.expert(L, e))
    finally:
        rt.close()


def test_cap_too_small_is_refused_with_numbers(loaded):
    from moe_offload.errors import OffloadError
    from moe_offload.offload.runtime import OffloadRuntime, RuntimeOptions
    # refused before any allocation by the metadata's estimate (what the context needs beside
    # the weights), or by the start-up plan once the weights are measured: numbers either way
    with pytest.raises(OffloadError, match=r"--vram .* is too small: .* needs .* but only|"
                                           r"needs [0-9.]+ [MG]iB of VRAM .* --vram [0-9.]+ GiB "
                                           r"leaves [0-9.]+ [MG]iB"):
        OffloadRuntime(loaded, RuntimeOptions(vram=64 << 20, n_ctx=256))


def test_bench_cli_smoke(loaded, capsys):
    import json
    from freetoken_patch.cli import main
    path = str(loaded.file.path)
    assert main(["bench", path, "--vram", "2GiB", "-p", "64", "-n", "8", "--reps", "1",
                 "--ctx", "256", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pp64"]["median"] > 0 and d["tg8"]["median"] > 0
    assert 0 <= d["cache"]["hit_rate"] <= 1 and d["vram"]["cap"] == 2 << 30
    assert "regime" in d and "routing_stats" in d
    assert main(["bench", path, "--vram", "2GiB", "-p", "64", "-n", "8", "--reps", "1",
                 "--ctx", "256", "--trace", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["regime"].startswith("trace(") and "trace_stats" in d


@pytest.mark.parametrize("graphs", [True, False])
def test_trace_replayed_and_record_written_once_a_step(loaded, reference, graphs):
    """A replayed trace routes each step to its row, and the record (written on its own stream)
    holds, row for row, the ids each step used: the trace's here. Rows never written stay -1."""
    prompt, toks, _ = reference
    c = loaded.config
    N = 16   # fewer rows than steps: rows are reused modulo N
    g = torch.Generator().manual_seed(1)
    trace = torch.stack([torch.stack([torch.randperm(c.n_expert, generator=g)[:c.n_expert_used]
                                      for _ in range(c.n_layer)]) for _ in range(N)]).cuda()
    from moe_offload import RoutingRecorder
    rt = _runtime(loaded, fetch_fraction=1.0, use_graphs=graphs)
    try:
        rt.replay(trace)
        recorder = rt.attach_recorder(RoutingRecorder(N))
        _follow(rt, prompt, toks)
        rt.stats()   # a sync point
        rec = recorder.ids.long()
        written = (rec >= 0).all(-1).all(-1)
        assert int(written.sum()) == N   # more steps than rows: every row was written
        assert torch.equal(rec, trace)
        assert rt.stats().selections > 0
    finally:
        rt.close()


def test_trace_gives_each_token_of_a_step_its_own_segment(loaded):
    """Replaying a trace, token t of a decode step routes by row (step - 1 + t * N / max_tok) mod
    N: B sequences stepped together follow B separate stretches of the trace, as B conversations
    would, not one row shared by all (which would make a batch's experts coincide). Eager, so
    each step's rows can be read as it begins."""
    c = loaded.config
    rt = _runtime(loaded, fetch_fraction=1.0, max_sequences=3, use_graphs=False)
    try:
        e = rt.engine
        N = 5 * e.max_tok + 3   # not a multiple: the stride rounds down
        g = torch.Generator().manual_seed(2)
        trace = torch.stack([torch.stack([torch.randperm(c.n_expert, generator=g)[:c.n_expert_used]
                                          for _ in range(c.n_layer)]) for _ in range(N)]).cuda()
        states = [rt.new_state(1) for _ in range(3)]
        for st in states:
            rt.prefill(torch.randint(0, c.n_vocab, (1, 4), generator=g).cuda(), st)
        rt.replay(trace)
        seen, begin = [], e.begin_device_step

        def spy():
            begin()
            seen.append((int(e.step.item()), e._trace_rows.clone()))
        e.begin_device_step = spy
        toks = torch.randint(0, c.n_vocab, (3,), generator=g).cuda()
        for _ in range(4):
            toks = rt.decode_many(toks, states).argmax(-1)
        assert len(seen) == 4
        stride = N // e.max_tok
        for step, rows in seen:
            want = torch.stack([trace[(step - 1 + t * stride) % N] for t in range(e.max_tok)])
            assert torch.equal(rows, want), f"step {step}"
        assert rt.stats().selections > 0
    finally:
        rt.close()


def test_record_of_model_routing_equal_with_and_without_graphs(loaded, reference):
    """The ids the model itself routes, recorded inside a captured graph and eagerly: equal (all
    misses over PCIe: the same kernels, the same logits, the same routing)."""
    prompt, toks, _ = reference
    c = loaded.config
    from moe_offload import RoutingRecorder
    recs, seen = [], []
    for graphs in (True, False):
        rt = _runtime(loaded, fetch_fraction=1.0, use_graphs=graphs)
        try:
            recorder = rt.attach_recorder(RoutingRecorder(64))
            _follow(rt, prompt, toks)
            s = rt.stats().as_dict()   # a sync point
            recs.append((recorder.ids.cpu(), int(rt.engine.step)))
            seen.append(f"graphs={graphs}: slots {rt.cache.slots}, fetched {s['fetched']}, "
                        f"cpu {s['cpu']}, captures {rt.captures}")
        finally:
            rt.close()
    (a, steps_a), (b, steps_b) = recs
    for rec, steps in recs:   # each step wrote its own row (a capture's warm-up is a step too)
        assert steps >= len(toks) and int((rec >= 0).all(-1).all(-1).sum()) == min(steps, 64)
        assert int(rec.max()) < c.n_expert
    # the graph run's steps include capture warm-ups: compare the last len(toks) steps of each
    last = lambda rec, steps: rec[[(s - 1) % 64 for s in range(steps - len(toks) + 1, steps + 1)]]
    ra, rb = last(a, steps_a), last(b, steps_b)
    differ = (ra != rb).any(-1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"steps {differ} of the last {len(toks)} differ; " + "; ".join(seen)


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_many_equals_each_sequence_alone(loaded, graphs):
    """Three sequences of different lengths under one runtime (max_sequences 3), stepped together
    by decode_many, against each decoded alone on the same runtime; every miss over PCIe, so no
    expert takes the CPU's rounding. Teacher-forced: both paths take the same tokens, so one near
    tie cannot move the rest. The same argmax everywhere; the logits differ by summation order
    (a batch splits a layer's experts into resident and fetched differently, and the pool kernel
    adds them in another order), which this random-weight model amplifies to a few 1e-3 of the
    logit scale (measured 2.4e-3 and 4.3e-3 on the H200). Half-way the batch changes order
    (the same graph, its States through the step's table)."""
    from moe_offload import OffloadError
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, loaded.config.n_vocab, (1, n), generator=g).cuda()
               for n in (5, 17, 30)]
    feed = torch.randint(0, loaded.config.n_vocab, (8, 3), generator=g).cuda()
    rt = _runtime(loaded, fetch_fraction=1.0, max_sequences=3, use_graphs=graphs)
    try:
        alone = []
        for b, p in enumerate(prompts):
            st = rt.new_state(1)
            out = [rt.prefill(p, st)]
            out += [rt.decode(feed[s, b:b + 1], st) for s in range(feed.shape[0])]
            alone.append(torch.cat(out))
            rt.release(st)
        states = [rt.new_state(1) for _ in prompts]
        assert len({id(st) for st in states}) == 3
        with pytest.raises(OffloadError, match="all 3 sequences"):
            rt.new_state(1)
        first = torch.cat([rt.prefill(p, st) for p, st in zip(prompts, states)])
        # half-way the batch comes in another order
        steps = []
        for s in range(feed.shape[0]):
            order = [0, 1, 2] if s < feed.shape[0] // 2 else [2, 0, 1]
            out = rt.decode_many(feed[s, order], [states[i] for i in order])
            steps.append(torch.empty_like(out).index_copy_(0, torch.tensor(order).cuda(), out))
        together = torch.stack([first] + steps, dim=1)             # [3, 1 + steps, V]
        for b in range(3):
            a, ref = together[b], alone[b]
            assert torch.equal(a.argmax(-1), ref.argmax(-1)), f"sequence {b}"
            err = float((a - ref).abs().max()) / float(ref.abs().max())
            assert err < 2e-2, f"sequence {b}: relative max |diff| {err:.2e}"
        assert [st.n_past for st in states] == [p.shape[1] + feed.shape[0] for p in prompts]
        with pytest.raises(OffloadError, match="same state twice"):
            rt.decode_many(feed[0, :2], [states[0], states[0]])
    finally:
        rt.close()


def test_batches_of_any_states_replay_graphs_captured_once(loaded):
    """A runtime of several sequences reaches a step's States through a table, so its graphs are
    keyed by batch size and attended bucket only: newcomers' short prompts (verify and decode
    steps) and batches of other States, in other orders, capture nothing once their size has
    been captured. Against the same calls run eagerly: the same argmax, logits within the
    graph-vs-eager bound of test_graphs_equal_eager; every device position equal to its State's
    count."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, loaded.config.n_vocab, (1, 20), generator=g).cuda()
               for _ in range(3)]
    feed = torch.randint(0, loaded.config.n_vocab, (6, 3), generator=g).cuda()
    batches = [[0, 1], [1, 2], [2, 0], [0, 1, 2], [2, 1, 0], [1, 0]]
    outs, counts = {}, {}
    for graphs in (True, False):
        rt = _runtime(loaded, fetch_fraction=1.0, max_sequences=3, use_graphs=graphs,
                      short_prompt=64)
        try:
            states = [rt.new_state(1) for _ in prompts]
            got = [rt.prefill(prompts[0], states[0])]
            seen = [rt.captures]
            got += [rt.prefill(p, st) for p, st in zip(prompts[1:], states[1:])]
            seen.append(rt.captures)
            for s, order in enumerate(batches):
                out = rt.decode_many(feed[s, order], [states[i] for i in order])
                got.append(out[order.index(0)] if 0 in order else out[0])
                seen.append(rt.captures)
            outs[graphs], counts[graphs] = torch.stack([x.reshape(-1) for x in got]), seen
            for st in states:
                assert int(st.pos) == st.n_past
            assert [st.n_past for st in states] == [20 + sum(b in o for o in batches)
                                                     for b in range(3)]
        finally:
            rt.close()
    seen = counts[True]
    assert seen[1] == seen[0], "a newcomer's short prompt captured anew"
    new = [b - a for a, b in zip(seen[1:], seen[2:])]
    assert new == [1, 0, 0, 1, 0, 0], f"captures a batch: {new}"
    a, b = outs[True], outs[False]
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    diffs = (a - b).abs().amax(-1).tolist()
    assert max(diffs) <= 1e-2 and sum(d > 1e-4 for d in diffs) <= 1, diffs


def test_prepared_batches_capture_nothing_later(loaded):
    """prepare_batches (the server's start) captures the decode steps of 1..N sequences, of
    1..N-1 with a prompt's piece beside them, and a short prompt's verify step, and empties the
    States: prompts, batches and pieces of any of them then capture nothing while they stay in
    the first attention bucket."""
    g = torch.Generator().manual_seed(5)
    rt = _runtime(loaded, max_sequences=3, short_prompt=64)
    try:
        states = [rt.new_state(1) for _ in range(3)]
        rt.prepare_batches(states)
        assert [(st.n_past, int(st.pos)) for st in states] == [(0, 0)] * 3
        caps = rt.captures
        assert caps >= 6   # decode of 1, 2, 3; beside a piece 1, 2; a verify step
        for n, st in zip((20, 11, 3), states):
            rt.prefill(torch.randint(0, loaded.config.n_vocab, (1, n), generator=g).cuda(), st)
        for order in ([2, 0], [0, 1, 2], [1], [1, 2], [2, 1, 0]):
            ids = torch.randint(0, loaded.config.n_vocab, (len(order),), generator=g).cuda()
            rt.decode_many(ids, [states[i] for i in order])
        ids = torch.randint(0, loaded.config.n_vocab, (8,), generator=g).cuda()
        top = rt.engine.max_tok
        rt.decode_many_with_prompt(ids[:2], [states[2], states[0]], ids[None, :top - 2], states[1])
        rt.decode_many_with_prompt(ids[:1], [states[1]], ids[None, :top - 1], states[2])
        assert rt.captures == caps
    finally:
        rt.close()


@pytest.mark.parametrize("graphs", [True, False])
def test_a_prompt_piece_beside_a_batch_equals_the_two_apart(loaded, graphs):
    """decode_many_with_prompt: two sequences' decode tokens and a third's prompt piece in one
    step (2 + T = max_tok) against decode_many and the piece's own verify step on a second
    runtime, then three decode steps of all three (their States as the step left them): the
    same argmax everywhere, logits within decode_many's bound against each alone (a step's
    experts split into resident and fetched differently); every miss over PCIe."""
    g = torch.Generator().manual_seed(9)
    V = loaded.config.n_vocab
    prompts = [torch.randint(0, V, (1, n), generator=g).cuda() for n in (9, 14, 5)]
    feed = torch.randint(0, V, (4, 3), generator=g).cuda()
    outs = []
    for together in (True, False):
        rt = _runtime(loaded, fetch_fraction=1.0, max_sequences=3, use_graphs=graphs,
                      short_prompt=64)   # the piece apart: decode steps, as the server's are
        try:
            top = rt.engine.max_tok
            piece = torch.randint(0, V, (1, top - 2),
                                  generator=torch.Generator().manual_seed(1)).cuda()
            states = [rt.new_state(1) for _ in prompts]
            for p, st in zip(prompts[:2], states[:2]):
                rt.prefill(p, st)
            rt.prefill(prompts[2], states[2])
            if together:
                dec, first = rt.decode_many_with_prompt(feed[0, :2], states[:2], piece, states[2])
            else:
                dec = rt.decode_many(feed[0, :2], states[:2])
                first = rt.prefill(piece, states[2])
            got = [dec, first.reshape(1, -1)]
            got += [rt.decode_many(feed[s], states) for s in range(1, 4)]
            assert [st.n_past for st in states] == [13, 18, 5 + top - 2 + 3]
            assert all(int(st.pos) == st.n_past for st in states)
            outs.append(torch.cat(got))
        finally:
            rt.close()
    a, b = outs
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    err = float((a - b).abs().max()) / float(b.abs().max())
    assert err < 2e-2, f"relative max |diff| {err:.2e}"


def test_generate_queues_each_step_before_reading_its_token(loaded):
    """generate() on the runtime queues the step after a token before the host reads it: the
    same greedy tokens as a step-by-step loop; the cache holds every token yielded but the last
    when max_tokens ends it, all of them when the caller leaves early or an end-of-generation
    id ends it (its step was queued already)."""
    from moe_offload import DoneEvent, SamplingParams, generate
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, loaded.config.n_vocab, (PROMPT,), generator=g).tolist()
    rt = _runtime(loaded)
    try:
        st = rt.new_state(1, 256)
        logits, ref = rt.prefill(torch.tensor([prompt]).cuda(), st), []
        for _ in range(8):
            ref.append(int(logits.argmax(-1)))
            logits = rt.decode(torch.tensor([ref[-1]]).cuda(), st)
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eog=True)
        *toks, done = generate(rt, rt.new_state(1, 256), prompt, greedy, eog_ids=())
        assert [e.token for e in toks] == ref == list(done.tokens)
        st = rt.new_state(1, 256)
        list(generate(rt, st, prompt, greedy, eog_ids=()))
        assert st.n_past == PROMPT + 7                       # the 8th token is never fed
        st = rt.new_state(1, 256)
        gen = generate(rt, st, prompt, greedy, eog_ids=())
        [next(gen) for _ in range(3)]
        gen.close()
        assert st.n_past == PROMPT + 3                       # the 3rd was queued before it left
        i = next(i for i in range(2, 7) if ref[i] not in ref[:i])   # its first appearance
        st = rt.new_state(1, 256)
        *toks, done = generate(rt, st, prompt, SamplingParams(temperature=0.0, max_tokens=8),
                               eog_ids=(ref[i],))
        assert isinstance(done, DoneEvent) and done.reason == "eog"
        assert list(done.tokens) == ref[:i + 1] and st.n_past == PROMPT + i + 1
    finally:
        rt.close()
