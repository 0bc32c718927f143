"""--ctx auto (serve's and chat's default) on fake memory budgets: host RAM for every State's
KV on the CPU; under a VRAM cap, the expert cache's share at a full context and a prompt's
workspace beside it (a stand-in of the synthetic 35B-A3B: its config and tensor sizes, no
file)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from moe_offload import CONTEXT, auto_context_host, auto_context_under_cap, plan_sketch
from moe_offload.offload.placement import gpu_workspace_bytes

GiB = 1 << 30


def test_host_context_is_what_ram_holds_for_every_state():
    per = 40960            # the 35B's f32 KV a token (10 attention layers)
    kw = dict(floor=4096, keep=2 * GiB, step=1024)
    # 8 States (4 active + 4 cached): (64 - 20 - 2) GiB / (8 x 40 KiB) = 137,625 -> 137,216
    n = auto_context_host(262144, per, 8, 64 * GiB, 20 * GiB, **kw)
    assert n == (42 * GiB // (8 * per)) // 1024 * 1024 == 137216
    assert 8 * per * n <= 42 * GiB < 8 * per * (n + 1024)
    assert auto_context_host(262144, per, 1, 64 * GiB, 20 * GiB, **kw) == 262144  # the trained
    assert auto_context_host(262144, per, 8, 22 * GiB, 20 * GiB, **kw) == 4096    # the floor
    assert auto_context_host(4096, per, 8, 64 * GiB, 20 * GiB, **kw) == 4096
    # keep defaults to CONTEXT's: the larger of host_keep and a share of what is available
    n = auto_context_host(10 ** 9, per, 1, 100 * GiB, 0, floor=4096)
    assert n == (int(100 * GiB * (1 - CONTEXT.host_keep_share)) // per) // CONTEXT.step \
        * CONTEXT.step


def _standin_35b():
    from loaders.synth import PRESETS, SynthOptions, _config, plan_tensors
    p = PRESETS["35b-a3b"]
    c = _config(p, 248320, p.n_layer)
    return SimpleNamespace(config=c, weights={t.name: t for t in plan_tensors(
        SynthOptions(preset="35b-a3b"), c, [])})


@pytest.fixture(scope="module")
def b35():
    return _standin_35b()


def _rooms(m, vram, n, n_seq=1, bpv="f16"):
    from moe_offload import OffloadPolicy, kv_bytes_per_token
    pol = OffloadPolicy()
    s = plan_sketch(m, vram, n)
    prompt = vram - s.dense_bytes - s.workspace_bytes - n_seq * s.state_bytes \
        - kv_bytes_per_token(m, bpv) * n_seq * n
    return prompt + gpu_workspace_bytes(m.config, n) - pol.decode_headroom, prompt


@pytest.mark.parametrize("gib", [6, 8, 16])
def test_cap_context_keeps_the_expert_cache_its_share(b35, gib):
    vram = gib * GiB
    n = auto_context_under_cap(b35, vram)
    base = _rooms(b35, vram, 4096)[0]
    decode, prompt = _rooms(b35, vram, n)
    assert n % CONTEXT.step == 0 and 4096 <= n <= b35.config.n_ctx_train
    assert decode >= CONTEXT.expert_share * base and prompt >= 0
    if n < b35.config.n_ctx_train:   # the next step would break one of the two
        d2, p2 = _rooms(b35, vram, n + CONTEXT.step)
        assert d2 < CONTEXT.expert_share * base or p2 < 0


def test_cap_context_grows_with_the_cap_and_shrinks_with_sequences(b35):
    a, b = auto_context_under_cap(b35, 8 * GiB), auto_context_under_cap(b35, 16 * GiB)
    assert a < b
    assert auto_context_under_cap(b35, 8 * GiB, n_seq=4) < a
    # a KV of about 1 byte a value (q8_0) fits more positions
    assert auto_context_under_cap(b35, 8 * GiB, kv_type="q8_0") >= a
    # a cap the model does not fit: the default context (the runtime says what does not fit)
    assert auto_context_under_cap(b35, 1 * GiB) == 4096


def test_choose_context_reads_the_flags(tiny_model, monkeypatch):
    from freetoken_patch.cli import ctx_auto
    from freetoken_patch.errors import CLIError
    from loaders import open_model
    import moe_offload.memory as memory
    lm = open_model(tiny_model)
    monkeypatch.setattr(memory, "host_ram_available", lambda: 64 * GiB)
    args = argparse.Namespace(ctx="auto", vram=None, allow_long_ctx=False, draft=0)
    ch = ctx_auto.choose_context(args, lm, torch.device("cpu"), 8)
    assert args.ctx == ch.n_ctx == lm.config.n_ctx_train and ch.kv_type == "f32" and ch.auto
    assert ch.describe().startswith(f"context {ch.n_ctx} (auto: KV f32, ")
    assert "up to 8" in ch.describe() and ch.as_meta()["n_ctx"] == ch.n_ctx
    monkeypatch.setattr(memory, "host_ram_available", lambda: 1 * GiB)
    args.ctx = "auto"
    assert ctx_auto.choose_context(args, lm, torch.device("cpu"), 8).n_ctx == \
        min(4096, lm.config.n_ctx_train)
    args.ctx = 10 ** 6
    with pytest.raises(CLIError, match="allow-long-ctx"):
        ctx_auto.choose_context(args, lm, torch.device("cpu"), 1)
    args.ctx, args.allow_long_ctx = 10 ** 5, True
    assert ctx_auto.choose_context(args, lm, torch.device("cpu"), 1).n_ctx == 10 ** 5
    from freetoken_patch.cli.model_args import add_model_args
    p = argparse.ArgumentParser()
    add_model_args(p, ctx_auto="RAM")
    assert p.parse_args(["m"]).ctx == "auto" and p.parse_args(["m", "--ctx", "512"]).ctx == 512
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--ctx", "big"])


def test_auto_kv_type_narrows_the_kv_before_the_cache_loses_its_share(b35):
    """--kv-type auto under 8 GiB: f16 at the default and at --ctx auto's context; a context
    given past that goes to q8_0, then q4_0, each the widest whose full KV leaves the expert
    cache its share (the rule --ctx auto uses); never wider for a longer context."""
    from moe_offload import auto_kv_type
    vram = 8 * GiB
    base = _rooms(b35, vram, 4096)[0]
    auto_n = auto_context_under_cap(b35, vram)
    assert auto_kv_type(b35, vram, 4096) == auto_kv_type(b35, vram, auto_n) == "f16"
    order = ["f16", "q8_0", "q4_0"]
    last = 0
    for n in (32768, 65536, 131072, 262144):
        kv = auto_kv_type(b35, vram, n)
        assert order.index(kv) >= last
        last = order.index(kv)
        if kv != "q4_0":
            assert _rooms(b35, vram, n, bpv=kv)[0] >= CONTEXT.expert_share * base
        if kv != "f16":    # the wider one would not have left it
            assert _rooms(b35, vram, n, bpv=order[order.index(kv) - 1])[0] < \
                CONTEXT.expert_share * base
    assert auto_kv_type(b35, vram, 262144) == "q8_0"     # f16 would leave the cache 1 GiB
    assert auto_kv_type(b35, 4 * GiB, 262144) == "q4_0"


def test_choose_context_under_a_cap_names_the_kv_type_it_chose(b35, monkeypatch):
    from freetoken_patch.cli import ctx_auto
    args = argparse.Namespace(ctx=262144, vram=8 * GiB, allow_long_ctx=False, draft=0,
                              kv_type="auto")
    ch = ctx_auto.choose_context(args, b35, torch.device("cpu"), 1)
    assert ch.kv_type == "q8_0" and args.kv_type == ch.kv_type
    assert f"KV {ch.kv_type} (auto)" in ch.describe() and ch.as_meta()["kv_type_auto"]
    args = argparse.Namespace(ctx=131072, vram=8 * GiB, allow_long_ctx=False, draft=0,
                              kv_type="f16")
    ch = ctx_auto.choose_context(args, b35, torch.device("cpu"), 1)
    assert ch.kv_type == "f16" and "(auto)" not in ch.describe()
    assert ch.kv_bytes == 131072 * 10 * 2 * 2 * 256 * 2


def test_a_block_kv_type_on_heads_it_cannot_split_is_one_line():
    """--kv-type q8_0 / q4_0 store blocks of 32: a model whose heads are not a multiple of 32 gets
    one line naming the flag and the fix; auto and f16 keep working for it."""
    from freetoken_patch.cli.model_args import kv_type_for
    from freetoken_patch.errors import CLIError
    odd = SimpleNamespace(config=SimpleNamespace(head_dim=48))
    for kv in ("q8_0", "q4_0"):
        args = argparse.Namespace(kv_type=kv, vram=None)
        with pytest.raises(CLIError, match=rf"--kv-type {kv} stores blocks of 32 .* 48; use "
                                           r"--kv-type f16"):
            kv_type_for(args, odd, 4096)
    assert kv_type_for(argparse.Namespace(kv_type="auto", vram=None), odd, 4096) == "f32"
    assert kv_type_for(argparse.Namespace(kv_type="f16", vram=None), odd, 4096) == "f16"
