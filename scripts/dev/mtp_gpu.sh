#!/usr/bin/env bash
# Speculative decoding (MTP) on the GPU machine, in one device call (about 10 min): the GPU tests
# of the verify step and of speculative == plain greedy under a cap, then `ftpatch bench --draft`
# on a synthetic 35B-A3B (IQ3_S) whose MTP head agrees with the trunk at $RATES, at $CAP.
# Set up like scripts/gpu_session.sh (carried wheels in .whl/, prebuilt .gpubin/*.so, else a
# build). Logs and JSON in $OUT; a summary last. Usage: OUT=... scripts/dev/mtp_gpu.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CAP=${CAP:-8GiB}
RATES=${RATES:-"0.5 0.8 0.95"}
DRAFTS=${DRAFTS:-"1 3 auto"}
GEN=${GEN:-128}
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
$PY -m pytest tests/moe_offload/test_mtp_gpu.py tests/moe_offload/test_mtp_head.py \
  tests/moe_offload/test_mtp_spec.py -q -rs > "$OUT/mtp_tests.log" 2>&1
SUMMARY+=("tests rc=$?: $(tail -1 "$OUT/mtp_tests.log")")
for rate in $RATES; do
  m=/tmp/35b-mtp$rate.gguf
  [[ -f $m ]] || $PY -m freetoken_patch.cli synth --preset 35b-a3b --type IQ3_S --mtp-agree "$rate" \
    -o "$m" > "$OUT/synth_$rate.log" 2>&1 || { SUMMARY+=("synth $rate failed"); continue; }
  for k in $DRAFTS; do
    $PY -m freetoken_patch.cli bench "$m" --vram "$CAP" -p 512 -n "$GEN" --reps 2 --draft "$k" \
      --json > "$OUT/bench_mtp${rate}_k$k.json" 2> "$OUT/bench_mtp${rate}_k$k.log"
    SUMMARY+=("rate $rate --draft $k rc=$?: $(grep -h '^speculative' "$OUT/bench_mtp${rate}_k$k.log" | tail -1)")
  done
  rm -f "$m"    # 17 GB each; the disk holds about three
done
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
