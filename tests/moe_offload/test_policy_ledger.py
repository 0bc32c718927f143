"""The offload policy (one frozen object, every number) and the VRAM ledger (what is where under
the cap, lent and reclaimed): pure arithmetic, on the CPU."""
import dataclasses

import pytest

from moe_offload import OffloadError, OffloadPolicy
from moe_offload.offload.budget import VramLedger

MiB = 1 << 20


def test_policy_is_frozen_and_checked():
    p = OffloadPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.prefetch_k = 3
    for bad in (dict(fetch_fraction=1.5), dict(prefetch_k=0), dict(score_decay=1.0)):
        with pytest.raises(OffloadError):
            OffloadPolicy(**bad)


def test_policy_numbers_and_derived_sizes():
    p = OffloadPolicy()
    assert p.guesses(8) == 6 and p.guesses(1) == 1 and p.with_(prefetch_k=3).guesses(8) == 3
    assert p.with_(prefetch_k=None) == p                       # None: the default stays
    assert p.decode_headroom == p.decode_graphs + p.decode_extra == 160 * MiB
    assert p.capture_headroom(100 * MiB) == 125 * MiB + 16 * MiB
    assert p.capture_headroom(101) == 101 * 5 // 4 + 16 * MiB   # integer, as the runtime sized it
    # sampling outside the graph: 4 sequences of the 35B's 248,320 logits; a small vocabulary
    # still needs two of torch's 20 MiB segments
    assert p.sampling_workspace(248_320, 4) == 4 * 248_320 * 64
    assert p.sampling_workspace(1000, 1) == 40 * MiB
    d = p.as_dict()
    assert d["score_decay"] == 0.99 and d["fetch_blocks"] == 16 and len(d) == len(
        dataclasses.fields(OffloadPolicy))


def test_every_policy_field_has_its_comment():
    import inspect
    import moe_offload.config as mod
    src = inspect.getsource(mod.OffloadPolicy)
    for f in dataclasses.fields(OffloadPolicy):
        line = next(ln for ln in src.splitlines() if ln.strip().startswith(f"{f.name}:"))
        assert "#" in line, f"{f.name} has no comment"


def test_ledger_plans_and_refuses_with_numbers():
    led = VramLedger(8 << 30)
    led.reserve("dense weights", 3 << 30)
    led.reserve("kv", 1 << 30)
    assert led.left == led.free_under_cap() == 4 << 30
    with pytest.raises(OffloadError, match=r"cache needs 5.00 GiB but only 4.00 GiB is left "
                                           r"\(dense weights 3.00 GiB, kv 1.00 GiB\)"):
        led.reserve("cache", 5 << 30)
    assert led.summary() == {"cap": 8 << 30, "dense weights": 3 << 30, "kv": 1 << 30,
                             "left": 4 << 30}


def test_ledger_lends_and_reclaims_the_cache_room():
    """The runtime's sums: the cache's room is the cap less what the others hold and what was
    lent; torch's cap leaves its loans out (they are torch's)."""
    led = VramLedger(8000)
    for purpose, n in (("context", 700), ("torch", 2000), ("KV", 300), ("cache", 4000)):
        led.set(purpose, n)
    assert led.free_under_cap("cache") == 8000 - 700 - 2000 - 300
    led.lend("prefill workspace", 900)
    assert led.free_under_cap("cache") == 8000 - 3000 - 900
    assert led.free_under_cap("torch", loans=False) == 8000 - 700 - 300 - 4000
    assert led.free_under_cap() == 8000 - 7000 - 900
    led.lend("prefill workspace", 500)            # a new figure replaces the old
    assert led.reclaim("prefill workspace") == 500 and led.reclaim("prefill workspace") == 0
    led.lend("a", 1)
    led.lend("b", 2)
    assert led.reclaim() == 3 and led.loans == {}
    led.set("KV", 0)                                # a figure of 0 drops the entry
    assert "KV" not in led.items and led.held("cache") == 2700
    led.release("torch", 500)
    assert led.items["torch"] == 1500
