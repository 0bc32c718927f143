"""The CPU half of the offload decode step, driven by a Python thread playing the GPU.

The worker follows the shared-memory protocol of csrc/offload_exchange.h: for each layer it waits
for gpu_flag >= step, computes the experts listed for it, writes y_host and sets cpu_flag. Here
the "GPU" writes the work lists and flags from Python, so the protocol and the math are checked
on any machine; the GPU side is covered by tests/moe_offload/test_runtime_gpu.py.
"""
import threading
import time

import numpy as np
import pytest
import torch

from loaders.quants import random_tensor
from native import offload_native as on
from native.ops import QTensor, _cpu, moe_ffn_ref as _exact_ref

pytestmark = pytest.mark.skipif(_cpu is None, reason="native._cpu is not built")

E, F, H, K, L, TMAX = 8, 256, 256, 3, 3, 4


def moe_ffn_ref(x, gate, up, down, ids, weights):
    """What the worker's kernels compute: the CPU kernels' integer scheme (native.numerics "cpu":
    int8 or int16 activations by weight type) where the active CPU ISA rounds activations, else
    the float reference."""
    if _cpu.accumulation(gate.qtype.name) != "f32":
        from native.numerics import _Emulation
        return _Emulation("cpu").moe_ffn(x, gate, up, down, ids, weights)
    return _exact_ref(x, gate, up, down, ids, weights)


def _banks(rng, types=("Q4_K", "IQ3_S", "Q8_0")):
    """Per layer: one host bank [E, gate|up|down] (like HostExpertBank) + reference QTensors."""
    out = []
    for li in range(L):
        specs = ((types[li % 3], (E, F, H)), (types[(li + 1) % 3], (E, F, H)), ("Q6_K", (E, H, F)))
        parts = [random_tensor(t, shp, rng).reshape(E, -1) for t, shp in specs]  # [E, bytes]
        bank = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=1)))
        ref = [QTensor.from_numpy(p.reshape(E * shp[1], -1), t, shp) for p, (t, shp) in zip(parts, specs)]
        offs = np.cumsum([0] + [p.shape[1] for p in parts])[:3]
        desc = {n: (r.qtype.type_id, bank.data_ptr() + int(o), bank.shape[1])
                for n, r, o in zip(("gate", "up", "down"), ref, offs)}
        desc.update(ff=F, n_experts=E)
        out.append((bank, ref, desc))
    return out


def test_worker_follows_the_protocol_and_matches_the_reference():
    rng = np.random.default_rng(3)
    banks = _banks(rng)
    ex = on.ExchangeBuffers.allocate(L, TMAX, K, H, pin=False)
    worker = on.make_worker(ex.as_dict(TMAX), [b[2] for b in banks], timeout_s=30)
    for step, T in ((1, 1), (2, 3), (3, 2)):
        ex.y_host.fill_(float("nan"))
        worker.begin_step(step, T)
        expected = []
        for li in range(L):
            x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32))
            ids = torch.from_numpy(rng.integers(0, E, size=(T, K))).to(torch.int32)
            ids[0, 0] = -1                       # a selection the GPU kept for itself
            w = torch.from_numpy(rng.random((T, K), dtype=np.float32))
            ex.cpu_ids[li, :T] = ids
            ex.cpu_w[li, :T] = w
            ex.x_host[li, :T] = x
            ex.gpu_flag[li] = step               # hand over layer li
            t0 = time.time()
            while int(ex.cpu_flag[li]) < step:   # the GPU's wait kernel
                if time.time() - t0 > 20:
                    try:
                        worker.wait_step()
                        why = "no error"
                    except RuntimeError as exc:
                        why = str(exc)
                    pytest.fail(f"worker did not answer layer {li} of step {step}: {why}")
                time.sleep(1e-4)
            g, u, d = banks[li][1]
            expected.append(moe_ffn_ref(x, g, u, d, ids.long(), w))
            got = ex.y_host[li, :T].clone()
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, expected[-1], rtol=2e-3, atol=2e-4)
        worker.wait_step()
    assert sum(worker.experts()) > 0 and all(b >= 0 for b in worker.busy_ns())


def test_worker_reports_a_gpu_that_never_comes():
    ex = on.ExchangeBuffers.allocate(1, 1, K, H, pin=False)
    rng = np.random.default_rng(0)
    worker = on.make_worker(ex.as_dict(1), [_banks(rng)[0][2]], timeout_s=0.2)
    worker.begin_step(1, 1)
    with pytest.raises(RuntimeError, match="did not reach MoE layer 0"):
        worker.wait_step()
    # it recovers: the next step works
    ex.cpu_ids[0, 0] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ex.x_host[0, 0] = 1.0
    worker.begin_step(2, 1)
    ex.gpu_flag[0] = 2
    worker.wait_step()
    assert int(ex.cpu_flag[0]) == 2


def test_worker_queues_steps_armed_ahead():
    """The host arms step 2 while step 1 is still running: the worker finishes 1, then 2."""
    rng = np.random.default_rng(2)
    ex = on.ExchangeBuffers.allocate(1, 1, K, H, pin=False)
    bank, ref, desc = _banks(rng)[0]
    worker = on.make_worker(ex.as_dict(1), [desc], timeout_s=30)
    ex.cpu_ids[0, 0] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ex.cpu_w[0, 0] = torch.tensor([0.5, 0.3, 0.2])
    ex.x_host[0, 0] = torch.from_numpy(rng.standard_normal(H, dtype=np.float32))
    worker.begin_step(1, 1)
    worker.begin_step(2, 1)
    assert worker.in_flight() == 2
    for step in (1, 2):
        ex.gpu_flag[0] = step
        t0 = time.time()
        while int(ex.cpu_flag[0]) < step:
            assert time.time() - t0 < 20, f"step {step} was not answered"
            time.sleep(1e-4)
        worker.wait_step(step)
    assert worker.in_flight() == 0
    want = moe_ffn_ref(ex.x_host[0, :1].clone(), *ref, ex.cpu_ids[0, :1].long(), ex.cpu_w[0, :1])
    torch.testing.assert_close(ex.y_host[0, :1], want, rtol=2e-3, atol=2e-4)


def test_worker_refuses_a_step_that_does_not_increase():
    ex = on.ExchangeBuffers.allocate(1, 1, K, H, pin=False)
    worker = on.make_worker(ex.as_dict(1), [_banks(np.random.default_rng(1))[0][2]], timeout_s=0.3)
    worker.begin_step(2, 1)
    with pytest.raises(ValueError, match="armed after step 2"):
        worker.begin_step(2, 1)
    with pytest.raises(RuntimeError):   # nobody plays the GPU: step 2 times out
        worker.wait_step()
