#!/usr/bin/env bash
# README set-up command #1: builds ckptd and ckptctl, then runs them on the
# bundled example checkpoint (examples/tiny-model, a HuggingFace safetensors
# file): save it as a 2-rank tensor-parallel native checkpoint, start the
# daemon on it, load it through the daemon as 4 ranks split on dim 0 (twice:
# the second job is served from the daemon's cache), and merge it back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
bazel build //client:ckptctl //server:ckptd >/dev/null 2>&1 || bazel build //client:ckptctl //server:ckptd
CKPTCTL=bazel-bin/client/ckptctl
CKPTD=bazel-bin/server/ckptd
OUT="${1:-/tmp/ckptd-example}"
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== the bundled HuggingFace checkpoint"
$CKPTCTL inspect examples/tiny-model | sed -n 1,8p  # sed reads it all: no SIGPIPE under pipefail
echo
echo "== save it as 2 tensor-parallel ranks (native ckptd format) into $OUT/tp2"
$CKPTCTL shard examples/tiny-model --layout examples/layout-tp2.json --out "$OUT/tp2" --unique-id 1
echo
echo "== start ckptd serving $OUT"
SOCK="$OUT/ckptd.sock"
$CKPTD --socket "$SOCK" --root "$OUT" --cache-budget 1GiB >"$OUT/ckptd.log" 2>&1 &
DAEMON=$!
trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
echo
echo "== load through the daemon: 4 ranks (dim 0 split), resharded from the TP2 checkpoint"
$CKPTCTL load "$OUT/tp2" --layout examples/layout-tp4-dim0.json --out "$OUT/tp4" --daemon "$SOCK"
echo
echo "== the same job again: served from the daemon's data cache (0 bytes from storage)"
$CKPTCTL load "$OUT/tp2" --layout examples/layout-tp4-dim0.json --out "$OUT/tp4b" --daemon "$SOCK"
cmp "$OUT/tp4/rank0.safetensors" "$OUT/tp4b/rank0.safetensors" && echo "identical results"
echo
echo "== daemon status"
$CKPTCTL status --daemon "$SOCK"
echo
echo "== merge the TP2 checkpoint back into HuggingFace safetensors (2 files)"
$CKPTCTL merge "$OUT/tp2" --out "$OUT/merged" --shards 2
echo
echo "== daemon log"
kill -TERM $DAEMON; wait $DAEMON || true
trap - EXIT
cat "$OUT/ckptd.log"
