#!/usr/bin/env bash
# Claude Code against `ftpatch serve`: the smoke test of the README's agents section.
#
# Installs a pinned Claude Code from the npm registry (once, into a cache folder outside the
# repository), starts `ftpatch serve` (by default the embedded tiny model, whose replies are
# random: this checks the protocol, not the text), and runs `claude -p` in json and in
# stream-json mode against it with nonessential traffic off, each bounded by `timeout`. It
# passes when both runs exit 0 and report a result that is not an API error.
#
#   scripts/agents/claude_code.sh [--record FILE] [-- SERVE FLAGS...]
#
#   --record FILE   write every request Claude Code sends (headers, body; keys redacted) to FILE
#                   (scripts/agents/record_requests.py; how tests/fixtures/claude_code/ was made)
#   SERVE FLAGS     instead of the default "--ctx 65536 --allow-long-ctx" (the tiny model was
#                   trained for 4096 tokens; Claude Code's first request is ~9,500 of its tokens),
#                   e.g. -- model.gguf --vram 8GiB
#
# Environment: CLAUDE_CODE_VERSION (default below), CLAUDE_CODE_DIR (where it is installed),
# PYTHON (default python3), PORT (default a free one), SMOKE_TIMEOUT (seconds a run, 300),
# CLAUDE_CODE_MAX_OUTPUT_TOKENS (default 4096, not its 32000: the random model ends a reply
# with an end-of-turn token about one token in 1,500, and a reply cut at the limit makes
# Claude Code ask again and then fail).
# Exit status: 0 passed, 1 failed, 77 skipped (no node/npm, or the package cannot be installed).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${CLAUDE_CODE_VERSION:-2.1.332}
DIR=${CLAUDE_CODE_DIR:-${FTPATCH_CACHE:-$HOME/.cache/ftpatch}/claude-code-$VERSION}
PY=${PYTHON:-python3}
TIMEOUT=${SMOKE_TIMEOUT:-300}
RECORD=""
if [[ ${1:-} == --record ]]; then RECORD=$2; shift 2; fi
if [[ ${1:-} == -- ]]; then shift; SERVE=("$@"); else SERVE=(--ctx 65536 --allow-long-ctx); fi

skip() { echo "claude_code.sh: SKIP: $*" >&2; exit 77; }
command -v node >/dev/null || skip "node is not installed"
command -v npm >/dev/null || skip "npm is not installed"
claude="$DIR/node_modules/.bin/claude"
if ! "$claude" --version >/dev/null 2>&1; then
  echo "claude_code.sh: installing @anthropic-ai/claude-code@$VERSION into $DIR" >&2
  mkdir -p "$DIR"
  timeout 600 npm install --no-audit --no-fund --loglevel=error --prefix "$DIR" \
    "@anthropic-ai/claude-code@$VERSION" >&2 || skip "npm could not install the package"
fi
if ! "$claude" --version >/dev/null 2>&1; then   # its postinstall did not run: the wrapper
  wrapper="$DIR/node_modules/@anthropic-ai/claude-code/cli-wrapper.cjs"
  [[ -f $wrapper ]] || skip "the installed package has no runnable claude"
  claude_cmd=(node "$wrapper")
else
  claude_cmd=("$claude")
fi
"${claude_cmd[@]}" --version >&2 || skip "claude does not run here"

work=$(mktemp -d)
PORT=${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if [[ -n $RECORD ]]; then
  server=("$PY" scripts/agents/record_requests.py --record "$RECORD")
else
  # -P: import the installed package (with its built extension) rather than a source tree in
  # the working folder, where one imports at all that way
  if "$PY" -P -c 'import freetoken_patch' 2>/dev/null; then
    server=("$PY" -P -m freetoken_patch.cli serve)
  else
    server=("$PY" -m freetoken_patch.cli serve)
  fi
fi
"${server[@]}" "${SERVE[@]}" --port "$PORT" > "$work/server.log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
for _ in $(seq 600); do
  "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/server.log" >&2; echo "claude_code.sh: FAIL: the server did not start" >&2; exit 1; }
  sleep 0.5
done

mkdir -p "$work/home" "$work/project"
run_claude() {   # $1: output format; the rest: claude's flags
  local fmt=$1; shift
  (cd "$work/project" && HOME="$work/home" CLAUDE_CONFIG_DIR="$work/home/.claude" \
    ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_API_KEY=smoke-test \
    ANTHROPIC_MODEL=default ANTHROPIC_SMALL_FAST_MODEL=default \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
    CLAUDE_CODE_MAX_OUTPUT_TOKENS=${CLAUDE_CODE_MAX_OUTPUT_TOKENS:-4096} \
    timeout "$TIMEOUT" "${claude_cmd[@]}" -p "say hi" --output-format "$fmt" "$@")
}
status=0
for fmt in json stream-json; do
  extra=(); [[ $fmt == stream-json ]] && extra=(--verbose)
  if ! run_claude "$fmt" "${extra[@]}" > "$work/out.$fmt" 2> "$work/err.$fmt"; then
    echo "claude_code.sh: FAIL: claude -p --output-format $fmt exited non-zero" >&2
    tail -5 "$work/err.$fmt" >&2; status=1; continue
  fi
  # the result: one JSON object (json), the last `result` line (stream-json)
  if ! "$PY" - "$work/out.$fmt" "$fmt" <<'PY'
import json, sys
path, fmt = sys.argv[1], sys.argv[2]
objs = []
for line in open(path, encoding="utf-8", errors="replace"):
    line = line.strip()
    if line.startswith("{"):
        try:
            objs.append(json.loads(line))
        except ValueError:
            pass
res = [o for o in objs if o.get("type") == "result"]
if not res:
    sys.exit(f"no result object in the {fmt} output")
r = res[-1]
if r.get("is_error") or r.get("subtype") != "success":
    sys.exit(f"{fmt}: an error result: {str(r.get('result'))[:300]!r} "
             f"(api_error_status {r.get('api_error_status')})")
print(f"claude_code.sh: {fmt}: ok ({r.get('num_turns')} turn(s), "
      f"{r.get('usage', {}).get('input_tokens')} input tokens, stop {r.get('stop_reason')})",
      file=sys.stderr)
PY
  then status=1; fi
done
grep -E "^method=" "$work/server.log" >&2 || true
[[ $status == 0 ]] && echo "claude_code.sh: PASS (Claude Code $VERSION)" >&2
exit $status
