"""The emulated host-to-GPU link (LinkClock, offload_link_mark/hold): copies through it are
unchanged byte for byte, take as long as the emulated rate makes them (held to
link_schedule_reference's arithmetic), and queue behind each other across streams; the runtime
under --link-gbps gives the same tokens as without. Needs CUDA."""
import time

import pytest
import torch

from native import offload_native as on

pytestmark = pytest.mark.gpu

EXPERT = 1 << 20      # bytes an "expert" in these tests


def _bank_and_list(n: int):
    host = torch.randint(0, 256, (n, EXPERT), dtype=torch.uint8)
    on.pin_host(host)
    fl = torch.zeros(1 + 2 * on.MAX_SELECTIONS, dtype=torch.int32)
    fl[0] = n
    fl[1:1 + 2 * n:2] = torch.arange(n)
    fl[2:2 + 2 * n:2] = torch.arange(n).flip(0)
    return host, fl.cuda()


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def test_paced_fetch_copies_the_same_bytes_at_the_emulated_rate():
    n, gbps = 16, 2.0                       # 16 MiB at 2 GB/s: 8.4 ms
    host, fl = _bank_and_list(n)
    try:
        pool = torch.zeros((n, EXPERT), dtype=torch.uint8, device="cuda")
        on.fetch(fl, on.host_view(host), pool, n)     # warm-up, unpaced
        fast = _timed(lambda: on.fetch(fl, on.host_view(host), pool, n))
        pool.zero_()
        link = on.LinkClock(torch.device("cuda"), gbps)
        slow = _timed(lambda: on.fetch(fl, on.host_view(host), pool, n, link=link))
        assert torch.equal(pool.cpu(), host.flip(0)), "the paced copy changed bytes"
        want = n * EXPERT / (gbps * 1e9)
        assert want <= slow <= want * 1.25 + 2e-3, (slow, want, fast)
        assert link.bytes_booked() == n * EXPERT
        link.set_rate(8.0)                             # no re-capture needed: read every hold
        quicker = _timed(lambda: on.fetch(fl, on.host_view(host), pool, n, link=link))
        assert quicker < slow / 2
    finally:
        on.unpin_host(host)


def test_copies_on_two_streams_share_the_link():
    """Two fetches launched at once on two streams take as long as both bytes at the rate, not
    as long as one (the real link would carry them one after the other at that rate)."""
    n, gbps = 8, 2.0
    host, fl = _bank_and_list(n)
    try:
        pools = [torch.zeros((n, EXPERT), dtype=torch.uint8, device="cuda") for _ in range(2)]
        link = on.LinkClock(torch.device("cuda"), gbps)
        streams = [torch.cuda.Stream() for _ in range(2)]

        def both():
            for i, (st, pool) in enumerate(zip(streams, pools)):
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    on.fetch(fl, on.host_view(host), pool, n, link=link, which=i)
            for st in streams:
                torch.cuda.current_stream().wait_stream(st)
        took = _timed(both)
        want = on.link_schedule_reference([(0, n * EXPERT), (0, n * EXPERT)], gbps)[-1] / 1e9
        assert want <= took <= want * 1.25 + 2e-3, (took, want)
        for pool in pools:
            assert torch.equal(pool.cpu(), host.flip(0))
    finally:
        on.unpin_host(host)


def test_runtime_under_an_emulated_link_gives_the_same_logits(synth_model):
    """Every miss over the link (the split forced, so the CPU's different rounding cannot enter):
    the emulated link changes when copies land, not what is computed."""
    from loaders import open_model
    from moe_offload import OffloadPolicy, open_runtime
    loaded = open_model(synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K"))
    prompt = torch.randint(0, loaded.config.n_vocab, (1, 20),
                           generator=torch.Generator().manual_seed(0)).cuda()
    logits, rates = {}, {}
    for link in (None, 1.0):
        with open_runtime(loaded, 2 << 30, policy=OffloadPolicy(fetch_fraction=1.0), ctx=256,
                          cache_slots=6, link_gbps=link) as rt:
            st = rt.new_state(1)
            out = [rt.prefill(prompt, st)]
            for _ in range(16):
                out.append(rt.decode(out[-1].argmax(-1), st))
            logits[link], rates[link] = torch.stack(out), rt.stats().rates
    assert torch.equal(logits[None].argmax(-1), logits[1.0].argmax(-1))
    torch.testing.assert_close(logits[None], logits[1.0], rtol=0, atol=1e-3)
    # the cost model sees the emulated link (it measures through it), not the real one
    assert 0.8 <= rates[1.0]["link_GBps"] <= 1.05, rates
    assert rates[1.0]["link_emulated_GBps"] == 1.0
    assert rates[None]["link_GBps"] > 5
