#!/usr/bin/env bash
# One device call for batched decode under the cap (issue: ftpatch serve's 4 streams):
#   1. decode_many_runtime.py: B = 1 and 4 at each share of misses sent over PCIe ($FRACTIONS;
#      $MANY=0 skips it),
#   2. `ftpatch bench` at each of $BENCHES (cap:regime),
#   3. the server: its packages' import, then `bench serve` at $CLIENTS clients ($SERVE=0 skips).
# Setup (wheels, extensions) is scripts/gpu_session.sh's; logs and JSON go to $OUT.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
STAGES=setup bash scripts/gpu_session.sh > "$OUT/session.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site
t0=$SECONDS
[[ -f /tmp/35b.gguf ]] || $PY -m freetoken_patch.cli synth --preset 35b-a3b --type IQ3_S -o /tmp/35b.gguf > "$OUT/synth.log" 2>&1
echo ">>> synth $((SECONDS - t0)) s"
t0=$SECONDS
[[ ${MANY:-1} == 1 ]] && timeout ${MANY_LIMIT:-300} $PY scripts/dev/decode_many_runtime.py /tmp/35b.gguf --vram 8GiB --batches ${BATCHES:-1,4} \
  --fractions ${FRACTIONS:-auto,1.0,0.8,0.6} --steps ${STEPS:-48} ${MANY_ARGS:-} --json "$OUT/many.json" > "$OUT/many.log" 2>&1
echo ">>> decode_many rc=$? $((SECONDS - t0)) s"; grep '^{"B"' "$OUT/many.log" | cut -c1-400
# the single-stream bench at each cap and regime of $BENCHES (cap:regime, e.g. 8GiB:model
# 8GiB:link11.8-t8), as gpu_session.sh's offload stage names them
for br in ${BENCHES:-}; do
  cap=${br%%:*}; regime=${br#*:}; extra=""
  [[ $regime =~ link([0-9.]+) ]] && extra="$extra --link-gbps ${BASH_REMATCH[1]}"
  [[ $regime =~ -t([0-9]+) ]] && extra="$extra --threads ${BASH_REMATCH[1]}"
  [[ $regime == trace* ]] && extra="$extra --trace"
  t0=$SECONDS
  timeout ${BENCH_LIMIT:-150} $PY -m freetoken_patch.cli bench /tmp/35b.gguf --vram $cap $extra -p ${PP:-512} \
    -n ${TG:-128} --reps ${REPS:-3} --json --out "$OUT/bench_${cap}_${regime}.json" > /dev/null 2> "$OUT/bench_${cap}_${regime}.log"
  echo ">>> bench $cap $regime rc=$? $((SECONDS - t0)) s: $(grep -E '^(pp|tg)' "$OUT/bench_${cap}_${regime}.log" | tr '\n' ' ')"
done
if [[ ${SERVE:-1} == 1 ]]; then
  $PY -c "import fastapi, uvicorn, pydantic, httpx, freetoken_patch.server.app; print('serve packages import')" 2>&1 | tail -3
  t0=$SECONDS
  timeout ${SERVE_LIMIT:-240} $PY -m freetoken_patch.cli bench serve /tmp/35b.gguf --vram 8GiB --parallel 4 \
    --concurrency ${CLIENTS:-1,4} --requests ${REQUESTS:-8} --turns 1 --out "$OUT/serve.json" > "$OUT/serve.log" 2>&1
  echo ">>> bench serve rc=$? $((SECONDS - t0)) s"; tail -25 "$OUT/serve.log"
fi
