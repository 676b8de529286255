#!/usr/bin/env bash
# The project's test command (README "Set-up", docs/testing.md): installs the Debian
# packages, builds everything with Bazel (offline) and runs every test.
# Then the sanitizer pass (Hardening III): the whole suite again under
# --config=asan (clang-14, ASan + UBSan, -Werror=thread-safety in core/ and
# server/), the multi-threaded core and daemon-library tests under
# --config=tsan (TSAN_TARGETS), and a short run of every libFuzzer target
# (tests/fuzz/run.sh).
# CKPTD_SANITIZERS=0 skips that pass (counted as skipped, never as passed).
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

# The GPU path must compile and link with CUDA wherever the toolkit is
# installed, GPU or not, and its bundle (issue 18: what a bare GPU machine
# runs, tests/gpu/bundle.sh) must build and run in a clean environment here
# (tests/gpu/bundle_check.sh: no system -dev libraries, "no GPU", exit 0).
# Two more test cases. (The GPU tests themselves run from the bundle, DIR/run.sh,
# on a machine with a GPU.)
EXTRA=()
if [ -x /usr/local/cuda/bin/nvcc ]; then
  BUNDLE=$(mktemp -d /tmp/ckptd-gpu-bundle.XXXXXX)
  if bash tests/gpu/bundle.sh "$BUNDLE" 2>&1 | tail -n 20 && [ "${PIPESTATUS[0]}" -eq 0 ]; then
    EXTRA+=(--extra "gpu bundle (--config=cuda build, tests/gpu/bundle.sh)=pass")
    if bash tests/gpu/bundle_check.sh "$BUNDLE" 2>&1 | tail -n 12 && [ "${PIPESTATUS[0]}" -eq 0 ]; then
      EXTRA+=(--extra "gpu bundle in a clean environment (tests/gpu/bundle_check.sh)=pass")
    else
      EXTRA+=(--extra "gpu bundle in a clean environment (tests/gpu/bundle_check.sh)=fail")
    fi
  else
    EXTRA+=(--extra "gpu bundle (--config=cuda build, tests/gpu/bundle.sh)=fail")
  fi
  rm -rf "$BUNDLE"
else
  echo "cuda build skipped: /usr/local/cuda/bin/nvcc not found"
  EXTRA+=(--extra "gpu bundle (no CUDA toolkit) [needs: nvcc]=skip")
fi

# bazel-testlogs follows the last build's configuration: name the directory.
TESTLOGS=$(bazel "${BAZEL_ARGS[@]}" info bazel-testlogs 2>/dev/null)

ALSO=()
if [ "${CKPTD_SANITIZERS:-1}" = "0" ]; then
  EXTRA+=(--extra "sanitizer pass (CKPTD_SANITIZERS=0) [needs: CKPTD_SANITIZERS unset]=skip")
elif ! command -v clang-14 >/dev/null; then
  EXTRA+=(--extra "sanitizer pass (no clang-14)=fail")
else
  bazel "${BAZEL_ARGS[@]}" test --config=asan //... 2>&1 | tail -n 40
  asan_rc=${PIPESTATUS[0]}
  ALSO+=(--also "asan=$(bazel "${BAZEL_ARGS[@]}" info --config=asan bazel-testlogs 2>/dev/null)=$asan_rc")
  # ThreadSanitizer over the tests whose threads are ours (executor, cache,
  # fd socket, arena pool, NCCL transfer scheduling, save and hardening
  # paths), plus the canary that proves a race is reported. Not the tests
  # that run gRPC servers: Debian's gRPC is not instrumented and hands work
  # between its threads in ways TSan cannot see (docs/testing.md).
  TSAN_TARGETS=(//tests/unit:all //tests/gpu:nccl_schedule_test //tests/gpu:pinned_arena_test
                //tests/tsan:race_canary_test)
  bazel "${BAZEL_ARGS[@]}" test --config=tsan "${TSAN_TARGETS[@]}" 2>&1 | tail -n 30
  tsan_rc=${PIPESTATUS[0]}
  ALSO+=(--also "tsan=$(bazel "${BAZEL_ARGS[@]}" info --config=tsan bazel-testlogs 2>/dev/null)=$tsan_rc")
  if [ -f tests/fuzz/run.sh ]; then
    if bash tests/fuzz/run.sh --runs "${CKPTD_FUZZ_RUNS:-20000}" 2>&1 | tail -n 40; then
      EXTRA+=(--extra "fuzzing pass (tests/fuzz/run.sh)=pass")
    else
      EXTRA+=(--extra "fuzzing pass (tests/fuzz/run.sh)=fail")
    fi
  fi
fi

# In CI a skip whose prerequisite this machine has is a failure.
STRICT=()
if [ "${CI:-}" = "true" ]; then STRICT+=(--strict-skips); fi
/usr/bin/python3 tools/count_tests.py "$TESTLOGS" "$test_rc" "${ALSO[@]}" "${EXTRA[@]}" "${STRICT[@]}"
count_rc=$?
if [ "$test_rc" -ne 0 ] || [ "$count_rc" -ne 0 ]; then exit 1; fi
exit 0
