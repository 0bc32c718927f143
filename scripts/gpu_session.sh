#!/usr/bin/env bash
# One device call: set up (wheels, prebuilt or freshly built extensions), then the stages named in
# $STAGES (default "tests kbench"): tests = every GPU test; kbench = ftpatch bench kernels;
# resident = every weight on the GPU (no cap): decode/prefill ceiling + a decode kernel profile;
# offload = synthetic 35B-A3B IQ3_S + ftpatch bench under VRAM caps (see $CAPS, $REGIMES).
# Logs and JSON go to $OUT; a short summary is printed last.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=" ${STAGES:-tests kbench} "
SUMMARY=()
t_start=$SECONDS
note() { SUMMARY+=("$*"); echo ">>> $*"; }

{ date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } > "$OUT/setup.log" 2>&1
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl >> "$OUT/setup.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
# prebuilt extensions (built for this Python and sm_90 on the dev machine), else build here
if compgen -G "$ROOT/.gpubin/*.so" > /dev/null; then cp "$ROOT"/.gpubin/*.so "$ROOT/native/"; fi
if ! $PY -c "import native._cpu, native._cuda" >> "$OUT/setup.log" 2>&1; then
  t0=$SECONDS
  rm -f "$ROOT"/native/_c*.so
  cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DFTPATCH_CUDA=ON -DFTPATCH_CUDA_ARCHS=90 \
    -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
    > "$OUT/build.log" 2>&1 && cmake --build /tmp/b -j "$(nproc)" >> "$OUT/build.log" 2>&1 && cp /tmp/b/_c*.so native/
  note "built extensions here in $((SECONDS - t0)) s (rc $?)"
else
  note "prebuilt extensions imported"
fi
$PY -c "import native.ops as o; print('cuda ext', o._cuda is not None, 'cpu ext', o._cpu is not None, o._cpu.isa())" 2>&1 | tee -a "$OUT/setup.log"

if [[ "$STAGES" == *" tests "* ]]; then
  t0=$SECONDS
  timeout ${TEST_LIMIT:-330} $PY -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=8 \
    ${TESTS:-tests/native tests/moe_offload tests/freetoken_patch} > "$OUT/pytest_gpu.log" 2>&1
  note "gpu tests rc=$? in $((SECONDS - t0)) s: $(grep -E 'passed|failed|error' "$OUT/pytest_gpu.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$OUT/pytest_gpu.log" | head -30
fi
if [[ "$STAGES" == *" kbench "* ]]; then
  t0=$SECONDS
  timeout 150 $PY -m freetoken_patch.cli bench kernels --json > "$OUT/kbench.json" 2> "$OUT/kbench.log"
  note "kernel bench rc=$? in $((SECONDS - t0)) s"
fi
if [[ "$STAGES" == *" offload "* || "$STAGES" == *" resident "* ]]; then
  t0=$SECONDS
  if [[ ! -f /tmp/35b.gguf ]]; then  # once per machine
    $PY -m freetoken_patch.cli synth --preset 35b-a3b --type IQ3_S -o /tmp/35b.gguf > /tmp/synth.log 2>&1
  fi
  note "synth 35b: $(tail -1 /tmp/synth.log) ($((SECONDS - t0)) s)"
fi
if [[ "$STAGES" == *" resident "* ]]; then
  t0=$SECONDS
  timeout 300 $PY scripts/dev/resident_decode.py /tmp/35b.gguf ${RESIDENT_ARGS:-} > "$OUT/resident.log" 2>&1
  note "resident rc=$? in $((SECONDS - t0)) s: $(head -2 "$OUT/resident.log" | tr '\n' ' ')"
fi
if [[ "$STAGES" == *" offload "* ]]; then
  for cap in ${CAPS:-8GiB}; do
    for regime in ${REGIMES:-model}; do
      # regimes: model, trace; suffixes -noprefetch (no next-layer guesses), -pfN (N guesses a
      # token), -fixed (no elastic cache), -serial (misses fetched before any expert computes),
      # -linkX (an emulated host-to-GPU link of X GB/s, e.g. -link11.8), -tN (N CPU threads)
      extra=""; [[ $regime == trace* ]] && extra="--trace"; [[ $regime == *-noprefetch* ]] && extra="$extra --no-prefetch"
      [[ $regime == *-fixed* ]] && extra="$extra --no-elastic"
      [[ $regime == *-serial* ]] && extra="$extra --no-overlap"
      [[ $regime =~ -pf([0-9]+) ]] && extra="$extra --prefetch-k ${BASH_REMATCH[1]}"
      [[ $regime =~ -link([0-9.]+) ]] && extra="$extra --link-gbps ${BASH_REMATCH[1]}"
      [[ $regime =~ -t([0-9]+) ]] && extra="$extra --threads ${BASH_REMATCH[1]}"
      t0=$SECONDS
      timeout ${BENCH_LIMIT:-240} $PY -m freetoken_patch.cli bench /tmp/35b.gguf --vram $cap $extra \
        -p ${PP:-512,2048} -n ${TG:-128} --reps ${REPS:-3} --json --out "$OUT/bench_${cap}_${regime}.json" \
        > /dev/null 2> "$OUT/bench_${cap}_${regime}.log"
      note "bench $cap $regime rc=$? in $((SECONDS - t0)) s: $(grep -E '^(pp|tg|VRAM)' "$OUT/bench_${cap}_${regime}.log" | tr '\n' ' ')"
    done
  done
fi
echo; echo "======== gpu_session summary ($((SECONDS - t_start)) s) ========"
printf '%s\n' "${SUMMARY[@]}"
