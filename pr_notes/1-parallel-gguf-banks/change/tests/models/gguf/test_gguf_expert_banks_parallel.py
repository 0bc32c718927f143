"""GGUF expert banks filled by several threads hold the same bytes as a one-thread fill and as
the file, for quantized, float and per-layer mixed experts (CPU only: banks on device=cpu or
unpinned host banks)."""

import os
import struct

import numpy as np
import pytest
import torch

from freetoken.layers.quantization.ggml_types import row_bytes
from freetoken.models.gguf import experts as gguf_experts

Q4_K, Q6_K, Q8_0, IQ3_S, BF16 = 12, 14, 8, 21, 30
HIDDEN, FF, EXPERTS = 256, 512, 8


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_moe_gguf(path, layer_types, seed=0):
    """A GGUF v3 holding only routed experts: per layer (gate_up type, down type), random bytes."""
    rng = np.random.default_rng(seed)
    tensors = []
    for layer, (gu, dn) in enumerate(layer_types):
        for proj, t, k, rows in (("gate", gu, HIDDEN, FF), ("up", gu, HIDDEN, FF), ("down", dn, FF, HIDDEN)):
            data = rng.integers(0, 256, EXPERTS * rows * row_bytes(t, k), dtype=np.uint8).tobytes()
            tensors.append((f"blk.{layer}.ffn_{proj}_exps.weight", t, (k, rows, EXPERTS), data))
    kv = _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("qwen35moe")
    infos, offset = b"", 0
    for name, t, ne, data in tensors:
        infos += _gguf_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        infos += struct.pack("<IQ", t, offset)
        offset += -(-len(data) // 32) * 32
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + kv + infos)
        f.write(b"\0" * (-f.tell() % 32))
        for _, _, _, data in tensors:
            f.write(data + b"\0" * (-len(data) % 32))
    return str(path)


CASES = {
    "q4k": [(Q4_K, Q4_K)] * 3,
    "iq3s-q6k": [(IQ3_S, Q6_K)] * 3,
    "mixed-layers": [(IQ3_S, Q4_K), (Q8_0, Q6_K), (Q4_K, Q8_0)],
    "bf16": [(BF16, BF16)] * 2,
}


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture(autouse=True)
def _no_pin(monkeypatch):
    monkeypatch.setenv("FREETOKEN_SKIP_BANK_PIN", "1")  # host banks without a GPU


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["host", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_parallel_fill_matches_one_thread(tmp_path, case, device, monkeypatch):
    monkeypatch.setattr(gguf_experts, "_FILL_JOB_BYTES", 4096)  # many jobs a layer
    path = write_moe_gguf(tmp_path / "m.gguf", CASES[case])
    one = gguf_experts.load_gguf_expert_banks(path, len(CASES[case]), device=device, workers=1)
    many = gguf_experts.load_gguf_expert_banks(path, len(CASES[case]), device=device, workers=4)
    assert one.layer_tags == many.layer_tags and one.row_tail_bytes == many.row_tail_bytes
    for role in one.sources:
        for a, b in zip(one.sources[role], many.sources[role]):
            assert torch.equal(_bytes(a), _bytes(b))


@pytest.mark.parametrize("case", CASES)
def test_banks_hold_the_file_bytes(tmp_path, case):
    from freetoken.models.gguf.reader import gguf_tensor_index

    path = write_moe_gguf(tmp_path / "m.gguf", CASES[case], seed=1)
    banks = gguf_experts.load_gguf_expert_banks(path, len(CASES[case]), device=torch.device("cpu"), workers=3)
    index = gguf_tensor_index(path)
    for layer in range(len(CASES[case])):
        raw = {p: index[f"blk.{layer}.ffn_{p}_exps.weight"].data().reshape(EXPERTS, -1) for p in ("gate", "up", "down")}
        gate_up = _bytes(banks.sources["gate_up"][layer]).reshape(EXPERTS, 2, -1).numpy()
        np.testing.assert_array_equal(gate_up[:, 0], raw["gate"])
        np.testing.assert_array_equal(gate_up[:, 1], raw["up"])
        np.testing.assert_array_equal(_bytes(banks.sources["down"][layer]).reshape(EXPERTS, -1).numpy(), raw["down"])


def test_worker_count_from_environment(monkeypatch):
    monkeypatch.setenv("FREETOKEN_GGUF_LOAD_WORKERS", "3")
    assert gguf_experts.gguf_load_workers() == 3
    monkeypatch.delenv("FREETOKEN_GGUF_LOAD_WORKERS")
    assert gguf_experts.gguf_load_workers() == min(8, os.cpu_count() or 1)
