#!/usr/bin/env bash
# The GPU tests and benchmark from a bundle (tests/gpu/bundle.sh writes this
# file as DIR/run.sh). Needs only the bundle, the NVIDIA driver and, for the
# Python client's test, ${PYTHON:-python3} (numpy, grpcio, protobuf; torch
# with CUDA for its GPU part).
#
#   DIR/run.sh                    logs and summary.json to ${OUT:-DIR/out}
#
# On a machine where `nvidia-smi -L` lists a GPU a skipped test is a failure;
# with no GPU every test is skipped, the run says "no GPU" and exits 0.
# Last line: "N passed, N failed".
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
W=$B/ws
OUT=${OUT:-$B/out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
t0=$SECONDS

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  gpu=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 4
fi
echo "bundle $(cat "$B/COMMIT" 2>/dev/null); $(uname -m); $(ldd --version 2>&1 | head -n 1); gpu=$gpu"

passed=0
failed=0
skipped=0
results=()
# case NAME LIMIT_S COMMAND...: output to $OUT/NAME.log, the tail shown.
case_() {
  local name=$1 limit=$2 t=$SECONDS rc result why
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/$name.log"
  if [ "$rc" -eq 0 ] && grep -q "SKIP" "$OUT/$name.log"; then
    if [ "$gpu" -eq 1 ]; then
      result=failed why="FAILED (skipped on a machine with a GPU)"
    else
      result=skipped why="skipped (no GPU)"
    fi
  elif [ "$rc" -eq 0 ]; then
    result=passed why="passed"
  else
    result=failed why="FAILED (exit $rc; 124: ran past $limit s)"
  fi
  case $result in
    passed) passed=$((passed + 1)) ;;
    skipped) skipped=$((skipped + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
  echo "--- $name: $why"
  results+=("{\"name\": \"$name\", \"result\": \"$result\", \"exit\": $rc, \"seconds\": $((SECONDS - t))}")
}

# Every bundled binary must find all its libraries.
missing=$(for f in server/ckptd client/ckptctl tests/gpu/gpu_delivery_test tests/gpu/gpu_ipc_test \
    tests/gpu/ipc_client tests/gpu/gpu_bench; do
  ldd "$W/$f" 2>&1 | grep "not found" | sed "s|^|$f: |"
done)
if [ -n "$missing" ]; then
  echo "libraries not found:"
  echo "$missing"
  failed=$((failed + 1))
  results+=("{\"name\": \"libraries\", \"result\": \"failed\", \"exit\": 1, \"seconds\": 0}")
fi

export TEST_SRCDIR=$B TEST_WORKSPACE=ws
case_ ckptd_starts 30 "$W/server/ckptd" --version
case_ gpu_delivery_test 90 "$W/tests/gpu/gpu_delivery_test"
case_ gpu_ipc_test 150 "$W/tests/gpu/gpu_ipc_test"
# py_case NAME LIMIT SCRIPT: a Python test against the bundled binaries.
py_case() {
  case_ "$1" "$2" env -C "$W" CKPTD_BIN="$W/server/ckptd" CKPTCTL="$W/client/ckptctl" \
    PYTHONPATH="$W/client/python:$W/tests/python" PYTHONUNBUFFERED=1 "$PY" -u "$3"
}
# skip_case NAME WHY
skip_case() {
  echo "=== $1: skipped ($2)"
  skipped=$((skipped + 1))
  results+=("{\"name\": \"$1\", \"result\": \"skipped\", \"exit\": 0, \"seconds\": 0}")
}
if [ "$gpu" -eq 1 ] || "$PY" -c 'import numpy, grpc, google.protobuf' >/dev/null 2>&1; then
  py_case torch_cuda_test 150 tests/gpu/torch_cuda_test.py
else
  skip_case torch_cuda_test "no GPU, and $PY lacks numpy/grpcio/protobuf"
fi
# The torch client's and DCP reader/writer's suite on whatever torch the
# machine has (issue 37: the GPU machine's torch 2.x; here 1.13).
if "$PY" -c 'import numpy, grpc, google.protobuf, torch' >/dev/null 2>&1; then
  echo "=== torch: $("$PY" -c 'import torch; print(torch.__version__)')"
  py_case torch_client_test 240 tests/python/torch_client_test.py
else
  skip_case torch_client_test "$PY lacks numpy/grpcio/protobuf/torch"
fi
case_ gpu_bench 120 "$W/tests/gpu/gpu_bench" --json "$OUT/gpu_bench.json"

bench=null
[ -s "$OUT/gpu_bench.json" ] && bench=$(cat "$OUT/gpu_bench.json")
{
  echo "{\"gpu\": $gpu, \"passed\": $passed, \"failed\": $failed, \"skipped\": $skipped,"
  echo " \"seconds\": $((SECONDS - t0)), \"commit\": \"$(cat "$B/COMMIT" 2>/dev/null)\","
  echo " \"tests\": [$(IFS=,; echo "${results[*]}")],"
  echo " \"bench\": $bench}"
} >"$OUT/summary.json"

echo "total: $((SECONDS - t0)) s; summary: $OUT/summary.json"
if [ "$gpu" -eq 0 ]; then echo "no GPU: $skipped skipped"; fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
