#!/usr/bin/env bash
# README set-up command #1: builds ckptd's tools and runs them on the bundled
# example checkpoint (examples/tiny-model, a HuggingFace safetensors file):
# inspect it, save it as a 2-rank tensor-parallel native checkpoint, reshard
# that into a 4-rank layout, and merge it back into HuggingFace shards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
bazel build //client:ckptctl >/dev/null 2>&1 || bazel build //client:ckptctl
CKPTCTL=bazel-bin/client/ckptctl
OUT="${1:-/tmp/ckptd-example}"
rm -rf "$OUT"

echo "== inspect the bundled HuggingFace checkpoint"
$CKPTCTL inspect examples/tiny-model | head -n 12
echo
echo "== save it as 2 tensor-parallel ranks (native ckptd format) into $OUT/tp2"
$CKPTCTL shard examples/tiny-model --layout examples/layout-tp2.json --out "$OUT/tp2" --unique-id 1
ls -l "$OUT/tp2"
echo
echo "== reshard: load the TP2 checkpoint as 4 ranks split on dim 0"
$CKPTCTL load "$OUT/tp2" --layout examples/layout-tp4-dim0.json --out "$OUT/tp4"
echo
echo "== merge back into HuggingFace safetensors (2 files)"
$CKPTCTL merge "$OUT/tp2" --out "$OUT/merged" --shards 2
ls -l "$OUT/merged"
