#!/usr/bin/env bash
# The GPU tests and the GPU benchmark from a source tree with Bazel and the
# CUDA toolkit (a development GPU machine):
#
#   bash tests/gpu/run.sh          (BUNDLE=DIR to keep the bundle elsewhere)
#
# Builds the self-contained bundle (tests/gpu/bundle.sh) and runs it
# (DIR/run.sh): the same runner a bare GPU machine uses, so what passes here
# is what is carried there. On a machine where `nvidia-smi -L` lists a GPU a
# skipped test is a failure. Last line: "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${BUNDLE:-/tmp/ckptd-gpu-bundle}
if ! bash tests/gpu/bundle.sh "$BUNDLE"; then
  echo "FAILED: tests/gpu/bundle.sh"
  echo "0 passed, 1 failed"
  exit 1
fi
exec "$BUNDLE/run.sh"
