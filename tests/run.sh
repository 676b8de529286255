#!/usr/bin/env bash
# The project's test command (README "Run the tests"): installs the Debian
# packages, builds everything with Bazel (offline) and runs every test.
# Ends with "N passed, N failed" (test cases, from the JUnit XML files) and
# exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash deploy/install-deps.sh || { echo "install-deps failed"; echo "0 passed, 1 failed"; exit 1; }

BAZEL_ARGS=()
if [ "${CI:-}" = "true" ]; then BAZEL_ARGS+=(--batch); fi

bazel "${BAZEL_ARGS[@]}" build //... 2>&1 | tail -n 40
build_rc=${PIPESTATUS[0]}
if [ "$build_rc" -ne 0 ]; then
  echo "build failed (exit $build_rc)"
  echo "0 passed, 1 failed"
  exit 1
fi

bazel "${BAZEL_ARGS[@]}" test //... 2>&1 | tail -n 60
test_rc=${PIPESTATUS[0]}

# The GPU path (issue 8) must compile and link with CUDA wherever the toolkit
# is installed, GPU or not: one more test case. (The GPU tests themselves run
# with tests/gpu/run.sh on a machine with a GPU.)
EXTRA=()
if [ -x /usr/local/cuda/bin/nvcc ]; then
  bazel "${BAZEL_ARGS[@]}" build --config=cuda //server:ckptd //tests/gpu/... 2>&1 | tail -n 20
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then
    EXTRA+=(--extra "cuda build (--config=cuda //server:ckptd //tests/gpu/...)=pass")
  else
    EXTRA+=(--extra "cuda build (--config=cuda //server:ckptd //tests/gpu/...)=fail")
  fi
else
  echo "cuda build skipped: /usr/local/cuda/bin/nvcc not found"
  EXTRA+=(--extra "cuda build (no CUDA toolkit)=skip")
fi

/usr/bin/python3 tools/count_tests.py bazel-testlogs "$test_rc" "${EXTRA[@]}"
count_rc=$?
if [ "$test_rc" -ne 0 ] || [ "$count_rc" -ne 0 ]; then exit 1; fi
exit 0
