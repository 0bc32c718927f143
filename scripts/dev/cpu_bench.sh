#!/usr/bin/env bash
# CPU-only throughput of the synthetic 35B-A3B against llama.cpp's CPU build, in one command (one
# device call, no network, ~9 minutes on a 16-core host):
#   1. builds our CPU extension (always: a carried or stale .so may be another commit's) and, at the
#      same time, llama.cpp's CPU-only llama-bench from .llama/llama.cpp-src.tar.gz into
#      $LLAMA_BUILD (default /tmp/llama-cpu; -DGGML_CUDA=OFF -DGGML_NATIVE=ON, kept between calls
#      on a warm machine) and the models: `ftpatch synth --preset $PRESET --type T` for each T of
#      $TYPES into $MODELS (default /tmp, never the repo); T = MIXED: Q4_K with IQ3_S experts
#      and a Q6_K head;
#   2. for each type, interleaved: ours
#        ftpatch bench MODEL --device cpu --threads $THREADS -p $PP -n $TG --reps $REPS
#      then llama.cpp's
#        llama-bench -m MODEL -ngl 0 -t $THREADS -p $PP -n $TG -r $LLAMA_REPS -o json
#      each under `timeout`, within the $TOTAL_LIMIT seconds of the whole run;
#   3. optionally (KERNELS=1) `ftpatch bench kernels --no-gpu` on every int8 ISA of the CPU;
#   4. a summary table, printed last (also $OUT/summary.txt).
# JSON and logs go to $OUT (default ./out). Ours runs each size once untimed, then $REPS times
# (default 1: a 35B decode of 128 tokens twice must fit beside llama.cpp's runs).
#   OUT=/tmp/cpu THREADS=16 scripts/dev/cpu_bench.sh          # the lead's run (carry .llama)
#   PRESET=tiny LLAMA_SKIP=1 PP=64 TG=16 scripts/dev/cpu_bench.sh   # a smoke test of the script
# LLAMA_SKIP=1: no llama.cpp (build nor runs). BUILD_CPU=0: use the native._cpu that imports.
# LLAMA_ARGS: more llama-bench flags (a run that dies of SIGILL is repeated with --repack 0).
set -u -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T_START=$SECONDS
OUT=${OUT:-$ROOT/out}
MODELS=${MODELS:-/tmp}
PY=${PYTHON:-python3}
PRESET=${PRESET:-35b-a3b}
TYPES=${TYPES:-IQ3_S Q4_K}
THREADS=${THREADS:-$(nproc)}
PP=${PP:-512}
TG=${TG:-128}
REPS=${REPS:-1}
LLAMA_REPS=${LLAMA_REPS:-2}
TOTAL_LIMIT=${TOTAL_LIMIT:-540}   # seconds for the whole run; each step gets what is left
LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama-cpu}
CPU_BUILD=${CPU_BUILD:-/tmp/b_cpu_bench}
LB=$LLAMA_BUILD/bin/llama-bench
mkdir -p "$OUT" "$MODELS"
left() { echo $((TOTAL_LIMIT - (SECONDS - T_START))); }
# a step's time limit: its own cap, or what is left of the run less a reserve for the later steps
limit() { local l; l=$(($(left) - $2)); ((l > $1)) && l=$1; ((l < 10)) && l=10; echo $l; }

WHEELS=${WHEELS:-$ROOT/.whl}   # wheels of missing packages (gguf, ...), as gpu_session.sh
if compgen -G "$WHEELS/*.whl" > /dev/null && ! $PY -c "import gguf" 2> /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl > "$OUT/setup.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
FT="$PY -m freetoken_patch.cli"
{ date -u; echo "cores $(nproc), threads $THREADS"; free -g | head -2; grep -m1 "model name" /proc/cpuinfo
  grep -m1 -o -w -E "avx512_vnni|avx512vnni" /proc/cpuinfo; $PY --version; git log --oneline -1; } >> "$OUT/setup.log" 2>&1

# ---- 1. builds and models, side by side -----------------------------------------------------------
t0=$SECONDS
if [[ "${BUILD_CPU:-1}" == 1 ]] || ! $PY -c "import native._cpu" 2> /dev/null; then
  ( cmake -S . -B "$CPU_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFTPATCH_CUDA=OFF \
      -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
      && cmake --build "$CPU_BUILD" -j "$(nproc)" && rm -f native/_cpu*.so && cp "$CPU_BUILD"/_cpu*.so native/
  ) > "$OUT/build.log" 2>&1 &
  PID_CPU=$!
fi
if [[ "${LLAMA_SKIP:-0}" != 1 && ! -x $LB ]]; then
  ( [[ -d /tmp/llama-src/llama.cpp ]] || { mkdir -p /tmp/llama-src && tar xzf .llama/llama.cpp-src.tar.gz -C /tmp/llama-src; } \
    && cmake -S /tmp/llama-src/llama.cpp -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
         -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && timeout "$(limit 300 300)" cmake --build "$LLAMA_BUILD" --target llama-bench -j "$(nproc)"
  ) > "$OUT/llama_build.log" 2>&1 &
  PID_LLAMA=$!
fi
PIDS_SYNTH=()
for t in $TYPES; do   # one process each (numpy, mostly one thread), beside the builds
  m="$MODELS/${PRESET}_${t,,}.gguf"
  [[ -f "$m" ]] && continue
  flags="--type $t"   # MIXED: a file of several types, as the published quant mixes are
  [[ $t == MIXED ]] && flags="--type Q4_K --expert-type IQ3_S --output-type Q6_K"
  ( $FT synth --preset "$PRESET" $flags -o "$m.part" && mv "$m.part" "$m" ) > "$OUT/synth_$t.log" 2>&1 &
  PIDS_SYNTH+=($!)
done
if [[ -n "${PID_CPU:-}" ]]; then
  wait "$PID_CPU"; echo "our CPU extension: build rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/setup.log"
fi
$PY -c "import native.ops as o; print('isa', o._cpu.isa(), o._cpu.available_isas())" 2>&1 | tee -a "$OUT/setup.log" \
  | grep -q "^isa" || { echo "native._cpu does not import: $OUT/build.log"; tail -20 "$OUT/build.log"; exit 1; }
for p in "${PIDS_SYNTH[@]}"; do wait "$p"; done
echo "models after $((SECONDS - t0)) s: $(ls -laL "$MODELS"/${PRESET}_*.gguf 2> /dev/null | awk '{printf "%s %.2f GB; ", $NF, $5 / 1e9}')" | tee -a "$OUT/setup.log"
if [[ -n "${PID_LLAMA:-}" ]]; then
  wait "$PID_LLAMA"; echo "llama-bench (CPU) build rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/setup.log"
fi
if [[ "${LLAMA_SKIP:-0}" != 1 && ! -x $LB ]]; then
  echo "no llama-bench yet (a second call on the warm machine resumes its build in $LLAMA_BUILD):"
  tail -3 "$OUT/llama_build.log"; LLAMA_SKIP=1
fi

# ---- 2. ours and llama.cpp's, interleaved ------------------------------------------------------------
n_types=$(wc -w <<< "$TYPES")
i=0
for t in $TYPES; do
  m="$MODELS/${PRESET}_${t,,}.gguf"
  [[ -f "$m" ]] || continue
  i=$((i + 1))
  # what is left, shared by the runs still to come (ours and llama.cpp's for each type)
  share=$(( $(left) / (2 * (n_types - i + 1)) ))
  t1=$SECONDS
  timeout "$(limit $((share + 30)) 0)" $FT bench "$m" --device cpu --threads "$THREADS" -p "$PP" -n "$TG" \
    --reps "$REPS" --ctx $((PP + TG + 64)) --out "$OUT/ours_$t.json" > "$OUT/ours_$t.log" 2>&1
  echo "ours $t: rc=$? in $((SECONDS - t1)) s: $(grep -E "^(pp|tg)" "$OUT/ours_$t.log" | tr '\n' ' ')"
  if [[ "${LLAMA_SKIP:-0}" != 1 ]]; then
    t1=$SECONDS
    lb_run() { timeout "$(limit $((share + 30)) 0)" "$LB" -m "$m" -ngl 0 -t "$THREADS" -p "$PP" -n "$TG" \
      -r "$LLAMA_REPS" ${LLAMA_ARGS:-} "$@" -o json > "$OUT/llama_$t.json" 2>> "$OUT/llama_$t.log"; }
    lb_run; rc=$?
    if ((rc == 132)); then   # SIGILL: seen on a VM whose CPUID reports AMX (Q4_K's repacked kernels)
      echo "llama.cpp $t: illegal instruction; again with --repack 0"; lb_run --repack 0; rc=$?
    fi
    echo "llama.cpp $t: rc=$rc in $((SECONDS - t1)) s"
  fi
done

# ---- 3. per-type kernel rates (optional) -------------------------------------------------------------
if [[ "${KERNELS:-0}" == 1 ]]; then
  KISAS=$($PY -c "import native._cpu as c; print(','.join(i for i in c.available_isas() if i != 'generic'))")
  timeout "$(limit 120 0)" $FT bench kernels --no-gpu --types "${KTYPES:-IQ3_S,Q4_K,Q6_K,Q8_0,F32}" \
    --moe-types IQ3_S,Q4_K --cpu-isas "$KISAS" --cpu-threads "$THREADS" --json > "$OUT/kernels.json" 2> "$OUT/kernels.log"
  echo "kernels: rc $? -> $OUT/kernels.json"
fi

# ---- 4. summary ---------------------------------------------------------------------------------------
$PY - "$OUT" "$PP" "$TG" "$THREADS" $TYPES <<'EOF' | tee "$OUT/summary.txt"
import json, sys
out, pp, tg, threads, types = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]

def ours(t):
    try:
        r = json.load(open(f"{out}/ours_{t}.json"))
    except (OSError, ValueError):
        return {}
    return {k: (v["median"], v["min"], v["max"]) for k, v in r.items() if k in (f"pp{pp}", f"tg{tg}")}

def llama(t):
    try:
        rows = json.load(open(f"{out}/llama_{t}.json"))
    except (OSError, ValueError):
        return {}
    res = {}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        s = r.get("samples_ts") or [r["avg_ts"]]
        res[key] = (r["avg_ts"], min(s), max(s))
    return res

fmt = lambda v: f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" if v else "-"
print(f"\nCPU only, {threads} threads (tok/s; ours: median (min-max), llama.cpp: mean (min-max))")
print(f"{'type':6s} {'test':7s} {'ours':>26s} {'llama.cpp':>26s} {'ours/llama':>10s}")
for t in types:
    a, b = ours(t), llama(t)
    for k in (f"pp{pp}", f"tg{tg}"):
        ratio = f"{a[k][0] / b[k][0]:10.2f}" if a.get(k) and b.get(k) else f"{'-':>10s}"
        print(f"{t:6s} {k:7s} {fmt(a.get(k)):>26s} {fmt(b.get(k)):>26s} {ratio}")
EOF
echo "total $((SECONDS - T_START)) s; logs and JSON in $OUT"
