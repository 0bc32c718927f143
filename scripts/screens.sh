#!/usr/bin/env bash
# docs/screens/*.txt from the current CLI: `ftpatch chat` on the embedded default model in a
# real terminal (tmux, 100 x 40), driven by keystrokes, each screen taken with
# `tmux capture-pane -p` (the text a terminal shows, no escape codes). Timings and the model's
# gibberish differ from run to run; the screens show what the chat looks like, not speeds.
#
#   bash scripts/screens.sh [OUTDIR]        # default docs/screens
#   FTPATCH="python -m freetoken_patch.cli" bash scripts/screens.sh   # another way to run ftpatch
#
# Needs tmux (apt-get install tmux). The embedded model is built into a scratch cache
# ($FTPATCH_CACHE), so the user's cache and chat history are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/screens}
ftpatch=${FTPATCH:-ftpatch}
command -v tmux > /dev/null || { echo "scripts/screens.sh needs tmux: apt-get install tmux" >&2; exit 1; }
mkdir -p "$out"
cache=$(mktemp -d)
sock="ftpatch-screens-$$"
t() { tmux -L "$sock" "$@"; }
trap 't kill-server 2> /dev/null || true; rm -rf "$cache"' EXIT

# wait until the pane (with its scrollback) shows PATTERN (grep -E) at least N times
wait_for() {
  local pattern=$1 n=${2:-1} limit=${3:-120} start=$SECONDS
  until [ "$(t capture-pane -p -t chat -S -2000 | grep -cE -- "$pattern" || true)" -ge "$n" ]; do
    if (( SECONDS - start > limit )); then
      echo "scripts/screens.sh: no '$pattern' (x$n) after ${limit} s; the pane:" >&2
      t capture-pane -p -t chat >&2
      exit 1
    fi
    sleep 0.2
  done
}

# the visible screen, trailing spaces and trailing blank lines dropped
snap() {
  t capture-pane -p -t chat | sed -e 's/[[:space:]]*$//' \
    | awk '{ lines[NR] = $0 } END { n = NR; while (n > 0 && lines[n] == "") n--; for (i = 1; i <= n; i++) print lines[i] }' \
    > "$out/$1"
  echo "wrote $out/$1"
}

# wait until the chat's input prompt ("> ", nothing typed) is the last line on the screen
ready() {
  local start=$SECONDS
  until t capture-pane -p -t chat | grep -v '^[[:space:]]*$' | tail -1 | grep -qE '^>[[:space:]]*$'; do
    (( SECONDS - start > 120 )) && { echo "scripts/screens.sh: no input prompt" >&2; exit 1; }
    sleep 0.2
  done
}

say() { ready; t send-keys -t chat -l -- "$1"; t send-keys -t chat Enter; }

start() {   # a fresh chat with these flags; waits for its banner
  t kill-session -t chat 2> /dev/null || true
  t new-session -d -s chat -x 100 -y 40 \
    "FTPATCH_CACHE='$cache' $ftpatch chat $*; echo '[chat ended]'; sleep 600"
  wait_for "Ctrl-D quits" 1 300
}

# 1. a conversation and the commands
start --seed 1
say "Hi! What can you do?";                       wait_for "^TTFT " 1
say "Tell me about mixture-of-experts models.";   wait_for "^TTFT " 2
say "/stats";                                     wait_for "^context: " 1
say "/temp";                                      wait_for "^temperature " 1
say "/temp 0.2";                                  wait_for "^temperature " 2
say "/reset";                                     wait_for "^new conversation" 1
say "/nope";                                      wait_for "unknown command /nope" 1
ready
snap chat-tmux.txt

# 2. a long answer while it streams, 3. stopped with Ctrl-C: the conversation stays
start --seed 1 -n 3000
say "Go on, make it longer."
wait_for "tokens, .* tok/s \| Ctrl-C stops" 1
sleep 1.5
snap chat-tmux-streaming.txt
t send-keys -t chat C-c
wait_for "\| interrupted" 1
say "/stats";                                     wait_for "^context: " 1
ready
snap chat-tmux-ctrl-c.txt
