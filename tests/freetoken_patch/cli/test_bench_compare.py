"""`ftpatch bench --vram A,B --compare-llama-bench BIN` without a GPU: ours is a stand-in
callable, llama-bench and nvidia-smi are scripts written here.

The fake llama-bench reads the flags ftpatch passes and prints `-o json` in llama-bench's shape (a
list of test objects: build_commit, model_filename, n_threads, n_gpu_layers, n_cpu_moe, n_prompt,
n_gen, avg_ns, avg_ts, stddev_ts, samples_ns, samples_ts, ...). While it runs it "uses" the VRAM
that $FAKE_VRAM ({n_cpu_moe: MiB}) gives for its --n-cpu-moe, by writing "pid, MiB" where the fake
nvidia-smi reads it. $FAKE_FAIL makes it exit 3 with an error line. Its throughput is made up:
pp N: 1000 - 10 * n_cpu_moe tok/s, tg N: 50 - n_cpu_moe tok/s (+ 0, 1, 2... per repetition).
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from rich.console import Console

from freetoken_patch.cli import bench_compare, build_parser, llama_bench
from loaders import open_model

GiB, MiB = 1 << 30, 1 << 20

LLAMA = r'''
import json, os, sys, time
a = sys.argv[1:]
def opt(*names, default=None):
    for n in names:
        if n in a:
            return a[a.index(n) + 1]
    return default
if os.environ.get("FAKE_FAIL"):
    print("llama_model_load: error loading model: fake failure", file=sys.stderr)
    sys.exit(3)
n_cpu_moe = int(opt("--n-cpu-moe", "-ncmoe", default="0"))
mib = json.loads(os.environ.get("FAKE_VRAM", "{}")).get(str(n_cpu_moe), 0)
with open(os.environ["FAKE_SMI_FILE"], "w") as f:
    f.write(f"{os.getpid()}, {mib}\n")
with open(os.environ["FAKE_SMI_FILE"] + ".calls", "a") as f:
    f.write(" ".join(a) + "\n")
time.sleep(float(os.environ.get("FAKE_SECONDS", "0.6")))
reps = int(opt("-r", default="5"))
rows = []
tests = [(int(p), 0) for p in opt("-p", default="512").split(",")] + [(0, int(opt("-n", default="128")))]
for n_p, n_g in tests:
    base = (1000.0 - 10 * n_cpu_moe) if n_g == 0 else (50.0 - n_cpu_moe)
    ts = [base + i for i in range(reps)]
    ns = [int((n_p or n_g) / t * 1e9) for t in ts]
    rows.append({"build_commit": "fake000", "build_number": 1, "cpu_info": "fake CPU",
                 "gpu_info": "fake GPU", "backends": "CUDA", "model_filename": opt("-m"),
                 "model_type": "qwen35moe fake", "model_size": 1, "model_n_params": 1,
                 "n_batch": 2048, "n_ubatch": 512, "n_threads": int(opt("-t", default="4")),
                 "n_gpu_layers": int(opt("-ngl", default="99")), "n_cpu_moe": n_cpu_moe,
                 "n_prompt": n_p, "n_gen": n_g, "n_depth": 0, "test_time": "2026-01-01T00:00:00Z",
                 "avg_ns": sum(ns) // reps, "stddev_ns": 0, "avg_ts": sum(ts) / reps,
                 "stddev_ts": 1.0, "samples_ns": ns, "samples_ts": ts})
os.remove(os.environ["FAKE_SMI_FILE"])
print(json.dumps(rows, indent=2))
'''

SMI = r'''
import os, sys
q = " ".join(sys.argv[1:])
try:
    pid, mib = open(os.environ["FAKE_SMI_FILE"]).read().split(",")
except (OSError, ValueError):
    pid, mib = None, 0
if "--query-compute-apps" in q and pid and not os.environ.get("FAKE_SMI_NO_PID"):
    print(f"{pid}, {int(mib)}")
elif "--query-gpu=memory.used" in q:
    print(1000 + int(mib))       # the device: 1000 MiB used by others, plus the fake's
'''


def write_script(folder: Path, name: str, body: str) -> Path:
    p = folder / name
    p.write_text(f"#!{sys.executable}\n{body}")
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return p


def install(folder: Path, monkeypatch, vram_mib: dict[int, int] | None = None) -> Path:
    """Both fakes in `folder`; bench_compare polls the fake nvidia-smi. Returns llama-bench's path."""
    smi = write_script(folder, "nvidia-smi", SMI)
    monkeypatch.setattr(llama_bench, "NVIDIA_SMI", str(smi))
    monkeypatch.setenv("FAKE_SMI_FILE", str(folder / "smi_state"))
    monkeypatch.setenv("FAKE_VRAM", json.dumps({str(k): v for k, v in (vram_mib or {}).items()}))
    return write_script(folder, "llama-bench", LLAMA)


def calls(folder: Path) -> list[str]:
    p = folder / "smi_state.calls"
    return p.read_text().splitlines() if p.exists() else []



def ours(cap: int, regime: str = "model routing") -> dict:
    """What bench.py's one-cap run returns, cut to the keys the comparison reads."""
    return {"machine": {"gpu": "stand-in", "host": "test", "cpu_threads": 3}, "model": {"path": "m"},
            "vram_cap": cap, "regime": regime,
            "pp512": {"median": 2000.0 + cap / GiB, "min": 1990.0, "max": 2010.0, "reps": 2, "all": []},
            "tg16": {"median": 100.0, "min": 99.0, "max": 101.0, "reps": 2, "all": []},
            "cache": {"hit_rate": 0.8}, "vram": {"nvidia_smi_peak": cap - 100 * MiB}}


def bench_args(model, *flags) -> argparse.Namespace:
    return build_parser().parse_args(["bench", str(model), "-p", "512", "-n", "16", "--reps", "2",
                                      *flags])


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), highlight=False)


def test_vram_takes_several_caps(tiny_model):
    assert bench_args(tiny_model).vram == [8 * GiB]
    assert bench_args(tiny_model, "--vram", "4GiB,6GiB, 512MiB").vram == [4 * GiB, 6 * GiB, 512 * MiB]


def test_one_cap_keeps_the_old_json(tiny_model, tmp_path):
    out = tmp_path / "one.json"
    args = bench_args(tiny_model, "--vram", "6GiB", "--out", str(out))
    seen = []
    assert bench_compare.run_cli(args, [512], quiet(), lambda a, s, c: seen.append(a.vram) or ours(a.vram)) == 0
    got = json.loads(out.read_text())
    assert seen == [6 * GiB]
    assert got["vram_cap"] == 6 * GiB and got["pp512"]["median"] == 2006.0   # the old keys, top level
    assert got["method"]["reps"] == 2 and got["method"]["prompt_sizes"] == [512]
    assert "kind" not in got and "date" in got["run"]


def test_fit_n_cpu_moe_is_the_smallest_that_fits(tiny_model):
    model = open_model(str(tiny_model))
    layers = model.config.n_layer
    totals = [llama_bench.llama_gpu_bytes(model, n, 528)["total"] for n in range(layers + 1)]
    assert all(a > b for a, b in zip(totals, totals[1:]))       # each layer's experts off the GPU
    for n in range(layers + 1):
        fit = llama_bench.fit_n_cpu_moe(model, totals[n], 528)
        assert fit["n_cpu_moe"] == n and fit["estimate"]["total"] == totals[n]
    assert llama_bench.fit_n_cpu_moe(model, totals[-1] - 1, 528)["n_cpu_moe"] is None


def test_caps_interleaved_with_llama_bench(tiny_model, tmp_path, monkeypatch):
    model = open_model(str(tiny_model))
    caps = [llama_bench.llama_gpu_bytes(model, n, 512)["total"] for n in (1, 3)]
    caps = [-(-c // MiB) * MiB for c in caps]                     # whole MiB: --vram takes sizes
    # at the estimated N the fake uses 1 MiB over the first cap: ftpatch must retry with N + 1
    over, under = caps[0] // MiB + 1, caps[0] // MiB - 50
    llama = install(tmp_path, monkeypatch, {1: over, 2: under, 3: caps[1] // MiB - 10})
    out = tmp_path / "caps.json"
    args = bench_args(tiny_model, "--vram", ",".join(f"{c // MiB}MiB" for c in caps), "--out", str(out),
                      "--compare-llama-bench", str(llama), "--llama-bench-args", "-fa 1")
    order = []

    def run_one(a, sizes, console):
        order.append(("ours", a.vram, len(calls(tmp_path))))
        if len(order) == 2:                   # the first cap is on disk before the second runs
            partial = json.loads(out.read_text())
            assert partial["complete"] is False and len(partial["runs"]) == 1
            assert partial["llama_bench"]["runs"][0]["n_cpu_moe"] == 2
        return ours(a.vram)
    assert bench_compare.run_cli(args, [512], quiet(), run_one) == 0
    got = json.loads(out.read_text())
    assert [o[1] for o in order] == caps and [o[2] for o in order] == [0, 2]   # ours, then theirs
    assert got["kind"] == "ftpatch-bench-caps" and got["caps"] == caps and "complete" not in got
    assert [r["vram_cap"] for r in got["runs"]] == caps
    first, second = got["llama_bench"]["runs"]
    assert first["n_cpu_moe_estimated"] == 1 and first["n_cpu_moe"] == 2
    assert [(a["n_cpu_moe"], a["over_cap"]) for a in first["attempts"]] == [(1, True), (2, False)]
    assert first["attempts"][0]["vram_peak"] == over * MiB and first["vram_method"] == "process"
    assert second["n_cpu_moe"] == 3 and len(second["attempts"]) == 1
    assert first["tests"]["pp512"]["median"] == 980.5 and first["tests"]["tg16"]["median"] == 48.5
    assert first["raw"][0]["n_cpu_moe"] == 2                      # llama-bench's own rows, kept
    cmd = calls(tmp_path)[0].split()
    for flag, value in (("-p", "512"), ("-n", "16"), ("-r", "2"), ("-t", "3"), ("-ngl", "99"),
                        ("--n-cpu-moe", "1"), ("-o", "json"), ("-fa", "1"), ("-m", str(tiny_model))):
        assert cmd[cmd.index(flag) + 1] == value
    row = got["comparison"][0]
    assert row["llama_n_cpu_moe"] == 2
    assert row["tests"]["pp512"] == {"ours": ours(caps[0])["pp512"]["median"], "llama": 980.5,
                                     "ratio": round(ours(caps[0])["pp512"]["median"] / 980.5, 3)}
    assert row["tests"]["tg16"]["ratio"] == round(100.0 / 48.5, 3)


@pytest.mark.parametrize("how", ["missing", "failing"])
def test_llama_bench_trouble_is_one_line_and_ours_is_written(tiny_model, tmp_path, monkeypatch, how):
    llama = install(tmp_path, monkeypatch)
    if how == "failing":
        monkeypatch.setenv("FAKE_FAIL", "1")
    binary = str(tmp_path / "no-such-llama-bench") if how == "missing" else str(llama)
    out = tmp_path / "caps.json"
    args = bench_args(tiny_model, "--vram", "4GiB,6GiB", "--out", str(out),
                      "--compare-llama-bench", binary)
    lines = []
    console = Console(file=open(os.devnull, "w"))
    console.print = lambda msg, **kw: lines.append(str(msg))
    assert bench_compare.run_cli(args, [512], console, lambda a, s, c: ours(a.vram)) == 0
    got = json.loads(out.read_text())
    assert [r["pp512"]["median"] for r in got["runs"]] == [2004.0, 2006.0]
    trouble = [ln for ln in lines if ln.startswith("llama-bench: ")]
    assert len(trouble) == 1 and "\n" not in trouble[0]
    assert ("not an executable" in trouble[0]) if how == "missing" else ("exited 3" in trouble[0] and
                                                                      "fake failure" in trouble[0])
    assert got["llama_bench"]["error"] and all(t["ratio"] is None for row in got["comparison"]
                                               for t in row["tests"].values())
    assert len(calls(tmp_path)) == 0                               # failing: not tried at the next cap


def test_parse_llama_json_takes_the_samples():
    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 2.0, "stddev_ts": 1.0, "samples_ts": [1.0, 3.0, 2.0]},
            {"n_prompt": 0, "n_gen": 128, "avg_ts": 5.0, "stddev_ts": 0.0}]
    t = llama_bench.parse_llama_json("build: fake (0)\n" + json.dumps(rows, indent=2))
    assert t["pp512"]["median"] == 2.0 and (t["pp512"]["min"], t["pp512"]["max"]) == (1.0, 3.0)
    assert t["tg128"]["median"] == 5.0 and t["tg128"]["avg_ts"] == 5.0


def test_vram_from_the_whole_device_where_processes_are_not_listed(tiny_model, tmp_path, monkeypatch):
    """nvidia-smi inside a container may list no pid of ours: the device's use above what it was
    before llama-bench started is taken instead."""
    llama = install(tmp_path, monkeypatch, {0: 300})
    monkeypatch.setenv("FAKE_SMI_NO_PID", "1")
    lb = llama_bench.LlamaBench(str(llama), str(tiny_model), open_model(str(tiny_model)), [64], 8, 1,
                                log=lambda m: None)
    att = lb.run_once(0, 2)
    assert att["vram_peak"] == 300 * MiB and att["vram_method"] == "device"


def test_real_llama_bench_json_is_read():
    """data/llama_bench_cpu_tiny.json: `llama-bench -m tiny.gguf -p 64 -n 16 -r 2 -t 2 -ngl 99
    --n-cpu-moe 1 -o json`, a CPU build of llama.cpp as vendored in llama-cpp-python 0.3.36, on
    the tiny synthetic model (2 shared cores: the numbers only test the reading)."""
    text = (Path(__file__).parent / "data" / "llama_bench_cpu_tiny.json").read_text()
    rows = llama_bench.llama_rows(text)
    assert [(r["n_prompt"], r["n_gen"], r["n_cpu_moe"]) for r in rows] == [(64, 0, 1), (0, 16, 1)]
    t = llama_bench.parse_llama_json(text)
    for name, r in zip(("pp64", "tg16"), rows):
        assert t[name]["median"] == pytest.approx(sum(r["samples_ts"]) / 2)
        assert (t[name]["min"], t[name]["max"]) == (min(r["samples_ts"]), max(r["samples_ts"]))
        assert t[name]["avg_ts"] == r["avg_ts"]
