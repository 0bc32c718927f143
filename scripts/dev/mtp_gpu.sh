#!/usr/bin/env bash
# Speculative decoding (MTP) on the GPU machine, in one device call (budget 8 min): the GPU tests
# (verify = decode, speculative == plain greedy under a cap, the MTP experts in the ledger), then
# `ftpatch bench --draft $DRAFTS --phase-times` on a synthetic 35B-A3B (IQ3_S) whose MTP head
# agrees with the trunk at 0.8 (model routing, then --trace) and at 0.3 (model routing; the
# same file, its MTP embedding rewritten in place by mtp_reagree.py: one 17 GB synthesis).
# Set up like scripts/gpu_session.sh (carried wheels in .whl/, prebuilt .gpubin/*.so, else a
# build). Logs and JSON in $OUT; a summary last. Usage: OUT=... scripts/dev/mtp_gpu.sh
# Knobs: DRAFTS (1,2,auto), GEN (128), REPS (2), RUNS (a subset of the three, or agree0.3_trace),
# TESTS=0 (skip them).
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CAP=${CAP:-8GiB}
DRAFTS=${DRAFTS:-1,2,auto}
GEN=${GEN:-128}
REPS=${REPS:-2}
RUNS=" ${RUNS:-agree0.8 agree0.8_trace agree0.3} "   # which benches to run
TESTS=${TESTS:-1}                                   # 0: skip the tests
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl > "$OUT/setup.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if compgen -G "$ROOT/.gpubin/*.so" > /dev/null; then cp "$ROOT"/.gpubin/*.so "$ROOT/native/"; fi
if ! $PY -c "import native._cpu, native._cuda" >> "$OUT/setup.log" 2>&1; then
  rm -f "$ROOT"/native/_c*.so
  cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DFTPATCH_CUDA=ON -DFTPATCH_CUDA_ARCHS=90 \
    -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
    > "$OUT/build.log" 2>&1 && cmake --build /tmp/b -j "$(nproc)" >> "$OUT/build.log" 2>&1 && cp /tmp/b/_c*.so native/
fi
SUMMARY=()
if [[ $TESTS == 1 ]]; then
  timeout 150 $PY -m pytest tests/moe_offload/test_mtp_gpu.py tests/moe_offload/test_mtp_head.py \
    tests/moe_offload/test_mtp_spec.py -q -rs > "$OUT/mtp_tests.log" 2>&1
  SUMMARY+=("tests rc=$?: $(tail -1 "$OUT/mtp_tests.log")")
fi
m=/tmp/35b-mtp.gguf
bench() {   # name, extra flags
  local name=$1; shift
  timeout 170 $PY -m freetoken_patch.cli bench "$m" --vram "$CAP" -p 64 -n "$GEN" --reps "$REPS" \
    --draft "$DRAFTS" --phase-times --json "$@" > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.log"
  local rc=$?
  SUMMARY+=("== $name rc=$rc: $(grep -h '^tg' "$OUT/bench_$name.log" | tail -1)")
  while IFS= read -r line; do SUMMARY+=("  $line"); done < <(grep -h '^speculative' "$OUT/bench_$name.log")
  SUMMARY+=("  budget MiB: $($PY -c 'import json, sys; r = json.load(open(sys.argv[1]))
print({k: round(v / 2**20) for k, v in r["budget"].items()}, "slots", r["slots_per_layer"])' \
    "$OUT/bench_$name.json" 2>&1 | tail -1)")
}
if [[ -f $m ]] || $PY -m freetoken_patch.cli synth --preset 35b-a3b --type IQ3_S --mtp-agree 0.8 \
    -o "$m" > "$OUT/synth.log" 2>&1; then
  [[ $RUNS == *" agree0.8 "* ]] && bench agree0.8
  [[ $RUNS == *" agree0.8_trace "* ]] && bench agree0.8_trace --trace
  if [[ $RUNS == *" agree0.3 "* || $RUNS == *" agree0.3_trace "* ]]; then
    if $PY scripts/dev/mtp_reagree.py "$m" 0.3 >> "$OUT/synth.log" 2>&1; then
      [[ $RUNS == *" agree0.3 "* ]] && bench agree0.3
      [[ $RUNS == *" agree0.3_trace "* ]] && bench agree0.3_trace --trace
    else SUMMARY+=("reagree 0.3 failed"); fi
  fi
else
  SUMMARY+=("synth failed")
fi
rm -f "$m"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
