#!/usr/bin/env bash
# CPU-only throughput of the synthetic 35B-A3B in one command: builds the CPU extension if this
# Python cannot import it (or FTPATCH_BUILD_CPU=1), synthesizes the model at each type of $TYPES
# (default "IQ3_S Q4_K") into $MODELS (default /tmp, never the repo), runs
#   ftpatch bench MODEL --device cpu --threads $THREADS -p $PP -n $TG --reps $REPS
# for each, and `ftpatch bench kernels --no-gpu` on every int8 ISA of the CPU (per-type GB/s
# against the host's read bandwidth). JSON and logs go to $OUT (default ./out); a summary is printed last.
#   OUT=/tmp/cpu scripts/dev/cpu_bench.sh                 # all cores, pp512 / tg128, 3 reps
#   THREADS=16 TYPES=IQ3_S REPS=2 scripts/dev/cpu_bench.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
MODELS=${MODELS:-/tmp}
PY=${PYTHON:-python3}
TYPES=${TYPES:-IQ3_S Q4_K}
THREADS=${THREADS:-$(nproc)}
PP=${PP:-512}
TG=${TG:-128}
REPS=${REPS:-3}
mkdir -p "$OUT" "$MODELS"

WHEELS=${WHEELS:-$ROOT/.whl}   # wheels of missing packages (gguf, prompt_toolkit), as gpu_session.sh
if compgen -G "$WHEELS/*.whl" > /dev/null && ! $PY -c "import gguf" 2> /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl > "$OUT/setup.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [[ "${FTPATCH_BUILD_CPU:-0}" == 1 ]] || ! $PY -c "import native._cpu" 2> /dev/null; then
  t0=$SECONDS
  cmake -S . -B /tmp/b_cpu_bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DFTPATCH_CUDA=OFF \
    -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
    > "$OUT/build.log" 2>&1 && cmake --build /tmp/b_cpu_bench -j "$(nproc)" >> "$OUT/build.log" 2>&1 \
    && cp /tmp/b_cpu_bench/_cpu*.so native/ || { echo "CPU build failed: $OUT/build.log"; tail -20 "$OUT/build.log"; exit 1; }
  echo "built native._cpu in $((SECONDS - t0)) s"
fi
FT="$PY -m freetoken_patch.cli"
{ date -u; nproc; free -g | head -2; grep -m1 "model name" /proc/cpuinfo
  $PY -c "import native.ops as o; print('isa', o._cpu.isa(), o._cpu.available_isas())"; } | tee -a "$OUT/setup.log"

KTYPES=${KTYPES:-IQ3_S,Q4_K,Q5_K,Q6_K,Q3_K,IQ4_XS,Q8_0,F32}
KISAS=$($PY -c "import native._cpu as c; print(','.join(i for i in c.available_isas() if i != 'generic'))")
$FT bench kernels --no-gpu --types "$KTYPES" --moe-types IQ3_S,Q4_K --cpu-isas "$KISAS" \
  --cpu-threads "$THREADS" --json > "$OUT/kernels.json" 2> "$OUT/kernels.log"
echo "kernels: rc $? -> $OUT/kernels.json"
for t in $TYPES; do
  m="$MODELS/35b_${t,,}.gguf"
  [[ -f "$m" ]] || $FT synth --preset 35b-a3b --type "$t" -o "$m" > "$OUT/synth_$t.log" 2>&1
  $FT bench "$m" --device cpu --threads "$THREADS" -p "$PP" -n "$TG" --reps "$REPS" --ctx $((PP + TG + 64)) \
    --out "$OUT/cpu_$t.json" 2>&1 | tee "$OUT/bench_$t.log"
done
$PY - "$OUT" $TYPES <<'EOF'
import json, sys
out = sys.argv[1]
for t in sys.argv[2:]:
    try:
        r = json.load(open(f"{out}/cpu_{t}.json"))
    except OSError:
        print(f"{t}: no result"); continue
    tests = {k: v for k, v in r.items() if k[:2] in ("pp", "tg") and k[2:].isdigit()}
    print(t, r["machine"]["cpu_threads"], "threads", r["machine"]["isa"], "|",
          ", ".join(f"{k} {v['median']:.2f} tok/s ({v['min']:.2f}-{v['max']:.2f})" for k, v in tests.items()))
EOF
