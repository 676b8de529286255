#!/usr/bin/env bash
# The GPU tests and the GPU benchmark (issue 8), one command:
#
#   bash tests/gpu/run.sh            (GPU_BENCH_GIB=2, GPU_BENCH_JSON=FILE optional)
#
# Builds with --config=cuda, then runs (each program skips with a message
# when no CUDA device exists):
#   gpu_delivery_test  bf16/f32 resharding into device buffers in process,
#                      byte-exact vs the host load; pinned cache memory
#   gpu_ipc_test       the real daemon + 2 and 4 client processes on one GPU,
#                      cuda_ipc delivery byte-exact vs shm; handles closed at
#                      job end and when a client dies
#   torch_cuda_test    the Python client: torch CUDA tensors as destinations
#   gpu_bench          pinned host -> device GB/s of the delivery path vs a
#                      plain cudaMemcpy from pinned memory (target >= 0.8)
# The runs take well under 5 minutes on a GPU node (the build comes first;
# it is incremental after tests/run.sh). Last line: "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "SKIP: no CUDA toolkit (/usr/local/cuda/bin/nvcc); nothing to build or run"
  echo "0 passed, 0 failed"
  exit 0
fi

BAZEL_ARGS=()
if [ "${CI:-}" = "true" ]; then BAZEL_ARGS+=(--batch); fi
t0=$SECONDS
bazel "${BAZEL_ARGS[@]}" build --config=cuda //server:ckptd //client:ckptctl //client/python:ckptd \
  //tests/gpu/... 2>&1 | tail -n 20
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "FAILED: bazel build --config=cuda"
  echo "0 passed, 1 failed"
  exit 1
fi
echo "build: $((SECONDS - t0)) s"

B=$PWD/bazel-bin
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

passed=0
failed=0
skipped=0
t1=$SECONDS
# run NAME LIMIT_S COMMAND...: one case; output kept to its last lines.
run() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name"
  local out rc
  out=$(timeout "$limit" "$@" 2>&1)
  rc=$?
  echo "$out" | tail -n 40
  if [ "$rc" -eq 0 ] && echo "$out" | grep "SKIP" >/dev/null; then
    skipped=$((skipped + 1))
    passed=$((passed + 1))
    echo "--- $name: skipped (counted as passed)"
  elif [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    echo "--- $name: passed"
  else
    failed=$((failed + 1))
    echo "--- $name: FAILED (exit $rc; 124: ran past ${limit} s)"
  fi
}

run gpu_delivery_test 90 "$B/tests/gpu/gpu_delivery_test"
run gpu_ipc_test 120 env TEST_SRCDIR="$B/tests/gpu/gpu_ipc_test.runfiles" TEST_WORKSPACE=ckptd \
  "$B/tests/gpu/gpu_ipc_test"
run torch_cuda_test 120 env CKPTD_BIN="$B/server/ckptd" CKPTCTL="$B/client/ckptctl" \
  PYTHONPATH="$PWD/client/python:$PWD/tests/python" /usr/bin/python3 -u tests/gpu/torch_cuda_test.py
run gpu_bench 120 "$B/tests/gpu/gpu_bench" --json "${GPU_BENCH_JSON:-/tmp/ckptd-gpu-bench.json}"

echo "tests + benchmark: $((SECONDS - t1)) s ($skipped skipped for want of a GPU)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
