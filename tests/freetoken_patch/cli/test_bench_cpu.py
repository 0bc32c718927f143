"""`ftpatch bench MODEL --device cpu`: the CPU-only path measured like the GPU bench, on a machine
without CUDA (a tiny synthetic model)."""
from __future__ import annotations

import json

import pytest

from freetoken_patch.cli import main
from native import ops

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")


def test_bench_cpu_writes_the_gpu_bench_json_shape(tiny_model, tmp_path):
    out = tmp_path / "cpu.json"
    threads = ops._cpu.threads()
    try:
        assert main(["bench", str(tiny_model), "--device", "cpu", "--threads", "1", "-p", "8,12",
                     "-n", "4", "--reps", "2", "--ctx", "64", "--out", str(out)]) == 0
        assert ops._cpu.threads() == 1                        # --threads reached the kernels
    finally:
        ops._cpu.set_threads(threads)
    r = json.loads(out.read_text())
    for key in ("pp8", "pp12", "tg4"):
        assert r[key]["reps"] == 2 and r[key]["min"] <= r[key]["median"] <= r[key]["max"], key
        assert r[key]["median"] > 0, key
    assert r["device"] == "cpu" and r["machine"]["cpu_threads"] == 1 and r["machine"]["isa"]
    assert r["method"]["gen"] == 4 and r["method"]["prompt_sizes"] == [8, 12]
    assert r["ttft_s"]["reps"] == 2 and "run" in r
    assert r["decode_path"] == "native loop"


@pytest.mark.parametrize("mode,forms", [("on", ["IQ3_S_N4"]), ("off", [])])
def test_bench_cpu_records_the_cpus_repacked_form(synth_model, tmp_path, mode, forms):
    out = tmp_path / "cpu.json"
    model = synth_model(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K")
    assert main(["bench", str(model), "--device", "cpu", "-p", "8", "-n", "2", "--reps", "1",
                 "--ctx", "64", "--cpu-repack", mode, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["machine"]["cpu_repacked"] == forms


def test_bench_cpu_says_when_decode_took_the_per_op_path(tiny_model, tmp_path, monkeypatch):
    from moe_offload.instrument import switches
    monkeypatch.setattr(switches, "CPU_PLAN", False)
    out = tmp_path / "cpu.json"
    assert main(["bench", str(tiny_model), "--device", "cpu", "-p", "8", "-n", "2", "--reps", "1",
                 "--ctx", "64", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["decode_path"] == "per-op"


def test_bench_cpu_refuses_a_cap_list(tiny_model):
    assert main(["bench", str(tiny_model), "--device", "cpu", "--vram", "4GiB,8GiB"]) == 1


def test_bench_cpu_drafts_with_the_mtp_head(synth_model, tmp_path):
    """--draft on the CPU: plain and speculative runs side by side, greedy tokens equal."""
    out = tmp_path / "spec.json"
    model = synth_model(mtp_agree=0.9, type="Q4_K", seed=1)
    assert main(["bench", str(model), "--device", "cpu", "-p", "8", "-n", "8", "--reps", "1",
                 "--ctx", "64", "--draft", "1,auto", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["speculative"]
    assert [r["draft"] for r in runs] == [1, "auto"]
    assert runs[0]["by_k"] == {"1": runs[0]["steps"]} and runs[0]["drafted"] > 0
    assert all(r["same_tokens"] and r["speculative_tps"]["median"] > 0 for r in runs)
    # the CPU model captures no graphs: the timed runs' count says so rather than leaving it out
    assert runs[0]["timed_captures"]["speculative"] == {"graphs": 0, "seconds": 0.0}


def test_bench_cpu_draft_needs_an_mtp_head(tiny_model, capsys):
    assert main(["bench", str(tiny_model), "--device", "cpu", "-p", "8", "-n", "2", "--reps", "1",
                 "--ctx", "64", "--draft", "1"]) == 1
    assert "MTP block" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--trace"], ["--link-gbps", "11.8"], ["--no-prefetch", "--host-head"],
                                   ["--draft-guess-layers", "2"]])
def test_bench_cpu_refuses_the_offload_runtimes_flags(tiny_model, flags, capsys):
    assert main(["bench", str(tiny_model), "--device", "cpu", *flags]) == 1
    err = capsys.readouterr().err
    assert flags[0] in err and "--device cpu" in err and len(err.strip().splitlines()) == 1


def test_bench_without_a_gpu_points_at_the_cpu_path(tiny_model, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from freetoken_patch.cli import main
    assert main(["bench", str(tiny_model), "--vram", "1GiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert "none is visible" in err and f"ftpatch bench {tiny_model} --device cpu" in err
