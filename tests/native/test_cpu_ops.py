"""native.ops on CPU tensors: dispatch to native._cpu, strided expert views, `out`, skipped slots,
thread-count independence, and the GIL released during long calls."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch

from kernel_oracle import SEED, assert_close, matmul_reference, moe_reference, rng_for
from loaders.quants import QUANT_TYPES, random_tensor
from native import NativeError, ops

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")


def _normal(rng, *shape) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def _bank(name, e, o, h, rng):
    q = QUANT_TYPES[name]
    return ops.QTensor.from_numpy(random_tensor(q, (e, o, h), rng), q, (e, o, h), f"{name}_bank")


def test_ops_use_the_extension_and_agree_with_the_reference():
    rng = rng_for("ops")
    w = _bank("IQ3_S", 1, 40, 512, rng).expert(0)
    x = torch.from_numpy(rng.standard_normal((3, 512), dtype=np.float32))
    y = ops.matmul(x, w)
    w64, x64 = ops.dequantize_ref(w).double().numpy(), x.double().numpy()
    assert_close(y.numpy(), *matmul_reference(ops._cpu.accumulation("IQ3_S"), w64, x64), "ops.matmul")
    assert torch.equal(ops.dequantize(w.data, w.qtype, w.shape), ops.dequantize_ref(w))
    assert ops.matmul(x[0], w).shape == (40,)  # 1-D input


def test_float_rows_not_a_multiple_of_32_fall_back_to_the_reference():
    rng = rng_for("f16_48")
    q = QUANT_TYPES["F16"]
    w = ops.QTensor.from_numpy(random_tensor(q, (5, 48), rng), q, (5, 48))
    x = _normal(rng, 2, 48)
    torch.testing.assert_close(ops.matmul(x, w), ops.matmul_ref(x, w), msg=lambda m: f"{m} (seed {SEED})")


def test_moe_ffn_fused_gate_up_rows_views_out_and_skipped_slots():
    rng = rng_for("ops_moe")
    e, f, h, t, k = 8, 256, 512, 4, 3
    gate_up = _bank("Q4_K", e, 2 * f, h, rng)
    down = _bank("Q6_K", e, h, f, rng)
    gate, up = gate_up.rows(0, f), gate_up.rows(f, 2 * f)
    assert gate.data.data_ptr() == gate_up.data.data_ptr() and not gate.data.is_contiguous()
    assert gate.expert_stride == 2 * f * gate.row_bytes
    x = torch.from_numpy(rng.standard_normal((t, h), dtype=np.float32))
    ids = torch.tensor([[0, 3, 7], [3, -1, 1], [-1, -1, -1], [5, 0, 2]])  # int64, like topk
    weights = torch.from_numpy(rng.random((t, k), dtype=np.float32))
    out = torch.full((t, h), float("nan"))
    y = ops.moe_ffn(x, gate, up, down, ids, weights, out=out)
    assert y.data_ptr() == out.data_ptr()
    banks = [ops.dequantize_ref(q).double().numpy() for q in (gate, up, down)]
    kinds = [ops._cpu.accumulation(q.qtype.name) for q in (gate, up, down)]
    ref, bound = moe_reference(x.double().numpy(), *banks, ids.numpy(), weights.numpy(), kinds)
    assert_close(y.numpy(), ref, bound, "ops.moe_ffn on fused gate_up views")
    assert not y[2].any()  # every slot skipped
    with pytest.raises(NativeError, match="do not fit"):
        ops.moe_ffn(x, gate, up, gate, ids, weights)


def test_matmul_many_is_each_matmul():
    """ops.matmul_many: one native call on the CPU, [T, O_j] column views of one buffer, each
    equal to its own ops.matmul; 3-D inputs keep their leading dims."""
    rng = rng_for("matmul_many")
    ws = [_bank(n, 1, o, 512, rng).expert(0) for n, o in (("IQ3_S", 64), ("Q8_0", 32), ("F32", 1))]
    for x in (_normal(rng, 5, 512), _normal(rng, 1, 3, 512)):
        ys = ops.matmul_many(x, ws)
        for y, w in zip(ys, ws):
            assert y.shape == (*x.shape[:-1], w.shape[0])
            assert torch.equal(y, ops.matmul(x, w)), f"{w.name} (seed {SEED})"


def test_results_do_not_depend_on_the_thread_count():
    rng = rng_for("threads")
    e, f, h = 6, 256, 512
    gate, up, down = _bank("IQ4_XS", e, f, h, rng), _bank("IQ4_XS", e, f, h, rng), _bank("Q8_0", e, h, f, rng)
    x = _normal(rng, 5, h)
    ids = torch.from_numpy(rng.integers(0, e, (5, 4)))
    weights = torch.from_numpy(rng.random((5, 4), dtype=np.float32))
    n = ops._cpu.threads()
    try:
        ys = []
        for threads in (1, 2, 3):
            ops._cpu.set_threads(threads)
            assert ops._cpu.threads() == threads
            ys.append(ops.moe_ffn(x, gate, up, down, ids, weights))
    finally:
        ops._cpu.set_threads(n)
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), f"seed {SEED}"


def test_pinned_workers_run_one_per_cpu_and_give_the_same_results():
    """set_pin_threads puts each worker on its own allowed CPU (read back from /proc) and changes
    no result bit; off again, the workers may run anywhere."""
    n = ops._cpu.threads()
    cpus = sorted(os.sched_getaffinity(0))
    rng = rng_for("pin")
    w = _bank("Q4_K", 1, 256, 512, rng).expert(0)
    x = _normal(rng, 3, 512)
    want = ops.matmul(x, w)
    threads = min(2, len(cpus))
    try:
        ops._cpu.set_threads(threads)
        ops._cpu.set_pin_threads(True)
        assert ops._cpu.threads_pinned() == (threads > 1)
        assert torch.equal(ops.matmul(x, w), want)
        if threads > 1:   # the one worker is on cpus[1] and may run nowhere else
            masks = []
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/status") as f:
                    masks += [ln.split(":")[1].strip() for ln in f if ln.startswith("Cpus_allowed_list")]
            assert str(cpus[1]) in masks, masks
        ops._cpu.set_pin_threads(False)
        assert not ops._cpu.threads_pinned()
        assert torch.equal(ops.matmul(x, w), want)
    finally:
        ops._cpu.set_pin_threads(False)
        ops._cpu.set_threads(n)


def test_long_calls_release_the_gil():
    """While one thread is inside a native call, another runs Python code. No clock is read: the
    interpreter's switch interval is made so long that a thread holding the GIL is never asked to
    hand it over, so the main thread can only run (and say stop) while the worker sits in a call
    that released it. Were the GIL held, the worker would make all its calls before main ran."""
    rng = rng_for("gil")
    w = _bank("IQ3_S", 1, 2048, 2048, rng).expert(0)
    x = _normal(rng, 64, 2048)
    y = torch.full((64, 2048), float("nan"))
    # the extension's own entry point: ops.matmul's torch calls would release the GIL themselves
    assert w.data.is_contiguous()
    args = (w.qtype.type_id, w.data.data_ptr(), 2048, 2048, w.row_bytes, x.data_ptr(), 64, y.data_ptr(), 0)
    calls, most = [], 50
    started, stop = threading.Event(), threading.Event()

    def work():
        started.set()
        while not stop.is_set() and len(calls) < most:
            ops._cpu.matmul(*args)
            calls.append(None)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        stop.set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert 1 <= len(calls) < most, f"the main thread ran only after {len(calls)} native calls"
    torch.testing.assert_close(y, ops.matmul(x, w), rtol=0, atol=0)


def test_isa_env_override_and_bad_names():
    import os
    import subprocess
    import sys
    code = "import native._cpu as c; print(c.isa())"
    env = dict(os.environ, FTPATCH_CPU_ISA="generic")
    run = dict(env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(ops.__file__) + "/..")
    # cwd: the directory holding the imported package, so `python -c` finds the same build
    out = subprocess.run([sys.executable, "-c", code], **run)
    assert out.stdout.strip() == "generic"
    env.pop("FTPATCH_CPU_ISA")
    out = subprocess.run([sys.executable, "-c", code], **run)
    assert out.stdout.strip() == ops._cpu.available_isas()[-1]  # default: the best this CPU runs
    with pytest.raises(ValueError, match="not available"):
        ops._cpu.set_isa("avx1024")
