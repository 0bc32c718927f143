#!/usr/bin/env bash
# One device call (repeat it until it says "compare rc="): build llama.cpp's llama-bench (CUDA,
# sm_90) from .llama/llama.cpp-src.tar.gz into $LLAMA_BUILD (default build/llama.cpp; kept between
# calls on a warm machine), then ftpatch bench at each cap of $CAPS with --compare-llama-bench, then the report.
# Source: llama.cpp as vendored in the PyPI sdist llama-cpp-python 0.3.36 (models/, docs/,
# tests/, examples/ removed). Carry: .llama .whl (and .gpubin if built here). To make the tarball
# (no network on the GPU machine): pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36,
# untar it, and pack its vendor/llama.cpp (less models/ docs/ tests/ examples/) as
# .llama/llama.cpp-src.tar.gz with the folder named llama.cpp (.llama/ is git-ignored).
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LLAMA_BUILD=${LLAMA_BUILD:-$ROOT/build/llama.cpp}
LB=$LLAMA_BUILD/bin/llama-bench
if [[ ! -x $LB ]]; then
  t0=$SECONDS
  [[ -d /tmp/llama.cpp ]] || tar xzf .llama/llama.cpp-src.tar.gz -C /tmp
  cmake -S /tmp/llama.cpp -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    > "$OUT/llama_cmake.log" 2>&1 || { echo "llama.cpp cmake failed:"; tail -20 "$OUT/llama_cmake.log"; exit 1; }
  timeout ${BUILD_LIMIT:-540} cmake --build "$LLAMA_BUILD" --target llama-bench -j "$(nproc)" > "$OUT/llama_build.log" 2>&1
  rc=$?
  echo "llama-bench build rc=$rc in $((SECONDS - t0)) s: $(tail -1 "$OUT/llama_build.log")"
  [[ -x $LB ]] || { echo "not built yet: call again (the build goes on from where it stopped)"; exit 0; }
fi
lb_help=$("$LB" --help 2>&1 || true)   # (not piped into grep -q: pipefail would see its SIGPIPE)
grep -q -- "--n-cpu-moe" <<< "$lb_help" || { echo "this llama-bench has no --n-cpu-moe:"; echo "$lb_help" | head -5; exit 1; }

# the Python side: scripts/gpu_session.sh's set-up (wheels into /tmp/site; the extensions from
# .gpubin/ or built there), then the same paths here
STAGES=none OUT="$OUT" bash scripts/gpu_session.sh > "$OUT/session.log" 2>&1
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import native._cpu, native._cuda" || { echo "extensions do not import:"; tail -20 "$OUT/session.log"; exit 1; }
if [[ ! -f /tmp/35b.gguf ]]; then
  $PY -m freetoken_patch.cli synth --preset 35b-a3b --type IQ3_S -o /tmp/35b.gguf > /tmp/synth.log 2>&1
fi
t0=$SECONDS
timeout ${COMPARE_LIMIT:-560} $PY -m freetoken_patch.cli bench /tmp/35b.gguf --vram "${CAPS:-8GiB,6GiB,4GiB}" \
  -p ${PP:-512,2048} -n ${TG:-128} --reps ${REPS:-3} --compare-llama-bench "$LB" \
  --out "$OUT/compare.json" > "$OUT/compare.log" 2>&1
echo "compare rc=$? in $((SECONDS - t0)) s"
grep -E "^(pp|tg|VRAM|llama-bench|cap|--)" "$OUT/compare.log" | tail -40
[[ -f $OUT/compare.json ]] && $PY -m freetoken_patch.cli bench report "$OUT/compare.json" -o "$OUT/report.html"
