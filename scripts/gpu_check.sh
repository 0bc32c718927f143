#!/usr/bin/env bash
# GPU check, run on a CUDA machine from anywhere in the repo: build native._cpu and native._cuda for
# the GPU at hand, run the GPU tests, run the kernel benchmark. Full logs and results go to $OUT
# (default ./out; at most 7 files, the device tool brings 8 back); a short summary is printed last.
#
#   OUT=/tmp/o scripts/gpu_check.sh            everything
#   GPU_CHECK_SKIP="bench" scripts/gpu_check.sh   skip stages: build, tests, others, bench
#
# Wheels the machine lacks (gguf, regex, prompt_toolkit, ...) are taken from ./.whl/*.whl if that
# folder exists (pip install --no-index --target /tmp/site, put on PYTHONPATH). Each stage has a
# time limit (build 240 s, kernel tests 150 s, other GPU tests 60 s, benchmark 120 s), so the
# summary comes back within the device tool's 10 minutes per command.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SKIP=" ${GPU_CHECK_SKIP:-} "
STATUS=()
T_START=$SECONDS

stage() {  # stage NAME LIMIT_S LOG COMMAND...: run, log (tee), record rc and time
    local name=$1 limit=$2 log=$3
    shift 3
    if [[ "$SKIP" == *" $name "* ]]; then STATUS+=("$name: skipped"); return 0; fi
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s) ===" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=$?
    local note=""
    [[ $rc == 124 || $rc == 137 ]] && note=" (timed out)"
    STATUS+=("$name: rc=$rc$note, $((SECONDS - t0))s")
    return $rc
}

# ---- environment ----------------------------------------------------------------------------------
{
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  nproc: $(nproc)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
    $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
    nvcc --version | tail -1 || true
    git -C "$ROOT" log --oneline -1 || true
} > "$OUT/setup.log" 2>&1
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    $PY -m pip install --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl >> "$OUT/setup.log" 2>&1 \
        || echo "wheel install failed (see setup.log)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
CAP=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')" 2>/dev/null || echo 90)
export FTPATCH_CUDA=ON FTPATCH_CUDA_ARCHS=${FTPATCH_CUDA_ARCHS:-$CAP}
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)

# ---- build: editable install, else CMake with the modules copied next to the sources -----------------
build() {
    if $PY -m pip install --no-build-isolation --no-deps -e . ; then return 0; fi
    echo "pip install -e failed; building with CMake in build/gpu"
    cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFTPATCH_CUDA=ON \
        -DFTPATCH_CUDA_ARCHS="$FTPATCH_CUDA_ARCHS" -DPython_EXECUTABLE="$(command -v "$PY")" \
        -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" &&
        cmake --build build/gpu && cp build/gpu/_c*.so native/
}
export -f build
export PY
stage build 240 "$OUT/build.log" bash -c 'build && $PY -c "
import native._cpu, native._cuda as c, native.ops as ops
print(\"native._cuda:\", c.__file__, c.device_limits(), \"ops uses cuda:\", ops._cuda is not None)"'

# ---- tests: the kernel tests first, then every other GPU test ------------------------------------
stage tests 150 "$OUT/pytest_native.log" $PY -m pytest -m gpu -q -p no:cacheprovider -rfE \
    --durations=5 tests/native
stage others 60 "$OUT/pytest_other.log" $PY -m pytest -m gpu -q -p no:cacheprovider -rfE \
    --ignore=tests/native

# ---- kernel benchmark ---------------------------------------------------------------------------
bench() {  # the CLI; its standalone module if the CLI cannot start (e.g. a wheel missing)
    if command -v ftpatch > /dev/null && ftpatch bench kernels --json "$@"; then return 0; fi
    echo "ftpatch bench kernels failed or is missing: running freetoken_patch.bench_kernels" >&2
    $PY -m freetoken_patch.bench_kernels --json "$@"
}
export -f bench
if [[ "$SKIP" != *" bench "* ]]; then
    t0=$SECONDS
    timeout --kill-after=10 120 bash -c bench > "$OUT/bench.json" 2> "$OUT/bench.log"
    rc=$?
    STATUS+=("bench: rc=$rc, $((SECONDS - t0))s")
else
    STATUS+=("bench: skipped")
fi

# ---- summary ------------------------------------------------------------------------------------
{
    echo
    echo "================ gpu_check summary ($((SECONDS - T_START))s) ================"
    head -3 "$OUT/setup.log"
    printf '%s\n' "${STATUS[@]}"
    for f in pytest_native pytest_other; do
        [[ -f "$OUT/$f.log" ]] && echo "$f: $(grep -E '(passed|failed|error|skipped)' "$OUT/$f.log" | tail -1)"
    done
    grep -E '^FAILED|^ERROR' "$OUT/pytest_native.log" 2>/dev/null | head -15
    $PY - "$OUT/bench.json" <<'EOF' || echo "bench: no results (see bench.log)"
import json, sys
r = json.load(open(sys.argv[1]))
bw = r["bandwidth"]
print(f"device copy {bw.get('device_copy_GBps', 0):.0f} GB/s, host read {bw.get('host_read_GBps', 0):.1f} GB/s, T={r['tokens']}")
shapes = list(dict.fromkeys(p["shape"] for p in r["matmul"]))
rows = {}
for p in r["matmul"]:
    rows.setdefault(p["type"], {})[p["shape"]] = p
if any("gpu_GBps" in p for p in r["matmul"]):
    print("GPU matmul GB/s (% of copy) H x O:".ljust(24) + "".join(s.rjust(14) for s in shapes))
for name, cells in rows.items():
    if "gpu_GBps" not in next(iter(cells.values())):
        continue
    print(f"  {name} ({cells[next(iter(cells))]['accum']})".ljust(24) + "".join(
        (f"{cells[s]['gpu_GBps']:.0f} ({cells[s]['gpu_pct']:.0f}%)" if s in cells else "-").rjust(14)
        for s in shapes))
hot = [n for n in ("Q4_K", "Q6_K", "IQ3_S", "IQ4_XS") if n in rows]
if hot and "cpu_GBps" in next(iter(rows[hot[0]].values())):
    print("CPU matmul GB/s (% of read) H x O:".ljust(24) + "".join(s.rjust(14) for s in shapes))
    for name in hot:
        cells = rows[name]
        print(f"  {name}".ljust(24) + "".join((f"{cells[s]['cpu_GBps']:.1f} ({cells[s]['cpu_pct']:.0f}%)"
              if s in cells else "-").rjust(14) for s in shapes))
for p in r["matmul"]:
    if "prefill_us" in p and p["type"] in ("Q4_K", "Q6_K", "IQ3_S", "IQ4_XS") and p["shape"] == "2048x8192":
        print(f"prefill T={p['prefill_tokens']} {p['type']} 2048x8192: {p['prefill_us']:.0f} us "
              f"(GEMM alone {p['prefill_gemm_us']:.0f} us), {p['prefill_TFLOPs']:.0f} TFLOP/s")
for p in r["moe"]:
    g = f"GPU {p['gpu_us']:.1f} us ({p['gpu_GBps']:.0f} GB/s)" if "gpu_us" in p else ""
    c = f"CPU {p['cpu_us']:.0f} us ({p['cpu_GBps']:.1f} GB/s)" if "cpu_us" in p else ""
    print(f"moe T=1 K=8 {p['type']}: {g}  {c}")
EOF
} 2>&1 | tee "$OUT/summary.txt"
