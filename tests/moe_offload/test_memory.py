"""What a file's metadata implies for memory, estimated before anything is allocated: the
estimate's parts, the key named as responsible, the refusal against host RAM or a VRAM cap,
the State's own check, and the room this process has (RAM, cgroup, ulimit)."""
from __future__ import annotations

import resource
from dataclasses import replace

import pytest

from loaders import open_model
from loaders.footprint import culprit, kv_bytes_per_position, recurrent_state_bytes
from moe_offload import OffloadError, State
from moe_offload import memory

GiB = 1 << 30


@pytest.fixture(scope="module")
def config(tiny_model):
    return open_model(tiny_model).config


def test_the_sizes_are_the_states_own(config):
    st = State(config, 3, 96)
    assert recurrent_state_bytes(config) * 3 == st.recurrent_nbytes
    kv = sum(t.numel() * t.element_size() for t in (*st.k.values(), *st.v.values()))
    assert kv_bytes_per_position(config, 4) * 96 * 3 == kv


def test_a_huge_state_size_is_named_not_the_context(config):
    hostile = replace(config, ssm_d_state=262144)
    est = memory.estimate(hostile, 4096)
    assert est.culprit.key == "qwen35moe.ssm.state_size" and est.culprit.value == 262144
    with pytest.raises(OffloadError) as e:
        memory.check_host(est, "m.gguf", room=(GiB, "a test limit"))
    msg = str(e.value)
    assert msg.startswith("m.gguf needs ") and "a test limit leaves 1.00 GiB" in msg
    assert "qwen35moe.ssm.state_size = 262,144 (the Qwen3.5-35B-A3B has 128)" in msg
    assert "lower --ctx" not in msg and "\n" not in msg


@pytest.mark.parametrize("field,key", [("ssm_d_conv", "qwen35moe.ssm.conv_kernel"),
                                       ("ssm_n_k_heads", "qwen35moe.ssm.group_count"),
                                       ("head_dim", "qwen35moe.attention.key_length")])
def test_each_key_is_found_when_it_is_the_one(config, field, key):
    big = replace(config, **{field: 1 << 16})
    assert memory.estimate(big, 4096).culprit.key == key


def test_the_context_is_named_when_it_is_the_one(config):
    est = memory.estimate(config, 2**62)       # beyond any array dimension: integers only
    assert est.culprit.key == "--ctx" and est.kv == kv_bytes_per_position(config, 4) * 2**62
    with pytest.raises(OffloadError, match=r"--ctx 4,611,686,018,427,387,904 is what makes it "
                                           r"large; lower --ctx$"):
        memory.check_host(est, "m.gguf", room=(64 * GiB, "RAM available"))


def test_a_real_model_is_not_blamed():
    """The Qwen3.5-35B-A3B's own shapes name no key (nothing is above itself)."""
    from loaders.synth import PRESETS, _config
    c = _config(PRESETS["35b-a3b"], 248320, 40)
    assert culprit(lambda c, n: recurrent_state_bytes(c), c, 4096) is None
    est = memory.estimate(c, 4096)
    assert est.culprit is None and est.total < GiB


def test_a_fitting_estimate_passes(config):
    memory.check_host(memory.estimate(config, 4096), room=(GiB, "RAM available"))
    memory.check_host(memory.estimate(config, 4096), room=(None, ""))   # unknown: no refusal


def test_the_runtime_is_checked_against_its_cap(config):
    hostile = replace(config, ssm_d_state=1 << 20)
    est = memory.runtime_estimate(hostile, 4096)
    assert est.where == "VRAM" and est.kv == kv_bytes_per_position(hostile, 2) * 4096
    with pytest.raises(OffloadError, match=r"of VRAM .*--vram 8.00 GiB leaves 8.00 GiB; "
                                           r"qwen35moe.ssm.state_size = 1,048,576"):
        memory.check_vram(est, 8 * GiB, "--vram 8.00 GiB", "m.gguf")


def test_a_state_beyond_any_dimension_is_one_error(config):
    with pytest.raises(OffloadError, match=r"KV cache at 4,611,686,018,427,387,904 positions"):
        State(config, 1, 2**62, "cpu")


def test_a_state_the_room_cannot_hold_names_the_key(config, monkeypatch):
    monkeypatch.setattr(memory, "host_room", lambda: (64 << 20, "the memory cgroup's limit"))
    with pytest.raises(OffloadError, match=r"qwen35moe.ssm.state_size = 65,536"):
        State(replace(config, ssm_d_state=65536), 1, 128, "cpu")


def test_the_room_is_the_tightest_limit(monkeypatch):
    monkeypatch.setattr(memory, "host_ram_available", lambda: 20 * GiB)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    assert memory.host_room() == (20 * GiB, "RAM available")
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda lim: (
        (5 * GiB, resource.RLIM_INFINITY) if lim == resource.RLIMIT_AS else real(lim)))
    monkeypatch.setattr(memory, "_status_kib", lambda field: 2 * GiB if field == "VmSize" else None)
    assert memory.host_room() == (3 * GiB, "the address-space limit (ulimit -v)")
    monkeypatch.setattr(memory, "_cgroup_room", lambda: GiB)
    assert memory.host_room() == (GiB, "the memory cgroup's limit")
