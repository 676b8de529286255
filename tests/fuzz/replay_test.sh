#!/usr/bin/env bash
# The regression test of one fuzz target (tests/fuzz/fuzz.bzl): runs the
# target binary once over every seed file of its corpus. In the normal build
# the binary is linked with replay_main.cc; under --config=fuzz it is a
# libFuzzer binary, which also runs file arguments once each and exits.
set -euo pipefail
bin="$1"
shift
if [ $# -eq 0 ]; then
  echo "replay_test: no corpus files for $bin" >&2
  exit 1
fi
exec "$bin" "$@"
