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

/usr/bin/python3 tools/count_tests.py bazel-testlogs "$test_rc"
count_rc=$?
if [ "$test_rc" -ne 0 ] || [ "$count_rc" -ne 0 ]; then exit 1; fi
exit 0
