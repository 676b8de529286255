#!/usr/bin/env bash
# Runs the suite several times in a row on a machine kept busy by
# stress-ng, to find tests that depend on timing (issue 20: "5 times in a
# row under stress-ng --cpu 2 with no flake").
#
#   tests/stress.sh [--runs N] [--cpu N] [target...]
#
#   --runs N   how many times (default 5); every run re-executes every test
#              (--nocache_test_results), the build is reused
#   --cpu N    stress-ng CPU workers kept running the whole time (default 2,
#              one per core here); 0 runs without load
#   target     Bazel test targets (default //...)
# Prints, per run, its duration and Bazel's summary; a run is green when
# Bazel passed it and none of the JUnit files it wrote records a failure or
# an error. The failed targets are listed with the first lines of their logs
# (copied to $STRESS_OUT, default /tmp/ckptd-stress, as run<k>-<target>.log);
# at the end "K of N runs green"; exits 1 if any run had a failure. Needs
# stress-ng (Debian package stress-ng).
set -uo pipefail
cd "$(dirname "$0")/.."

runs=5
cpu=2
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --cpu) cpu="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "stress.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(//...)
out="${STRESS_OUT:-/tmp/ckptd-stress}"
mkdir -p "$out"

if [ "$cpu" -gt 0 ]; then
  command -v stress-ng >/dev/null || { echo "stress.sh: stress-ng is not installed (apt-get install stress-ng)" >&2; exit 2; }
  stress-ng --cpu "$cpu" --quiet &
  stress_pid=$!
  trap 'kill "$stress_pid" 2>/dev/null; wait "$stress_pid" 2>/dev/null' EXIT
  echo "== stress-ng --cpu $cpu (pid $stress_pid)"
fi

echo "== bazel build ${targets[*]}"
bazel build "${targets[@]}" 2>&1 | tail -n 3
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "stress.sh: the build failed" >&2; exit 1; }
testlogs="$(bazel info bazel-testlogs 2>/dev/null)"

green=0
for k in $(seq 1 "$runs"); do
  marker="$out/run$k.start"
  touch "$marker"
  t0=$(date +%s)
  bazel test --nocache_test_results "${targets[@]}" > "$out/run$k.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - t0 ))
  # This run's results only: the JUnit files written since it started (the
  # testlogs directory also holds older runs, e.g. run_1_of_4 directories).
  bad="$(find "$testlogs" -name test.xml -newer "$marker" -print0 |
         xargs -0 -r grep -lE '(failures|errors)="[1-9]' | sed "s|^$testlogs/||; s|/test.xml$||")"
  files=$(find "$testlogs" -name test.xml -newer "$marker" | wc -l)
  echo "== run $k of $runs: bazel exit $rc, ${took} s, $files result files: $(grep -E '^Executed ' "$out/run$k.txt" | tail -n 1)"
  for t in $(grep -E '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FLAKY)' "$out/run$k.txt" | awk '{print $1}'); do
    rel="${t#//}"; bad="$bad"$'\n'"${rel/://}"
  done
  bad="$(echo "$bad" | sed '/^$/d' | sort -u)"
  if [ "$rc" -eq 0 ] && [ -z "$bad" ]; then
    green=$((green + 1))
    continue
  fi
  for rel in $bad; do
    log="$testlogs/$rel/test.log"
    name="run$k-$(echo "$rel" | tr '/' '_').log"
    [ -f "$log" ] && cp "$log" "$out/$name"
    echo "   FAILED //$rel (log: $out/$name)"
    grep -m 5 -E 'FAIL|Failure|Error|error:|timed out' "$log" 2>/dev/null | cut -c1-200 | sed 's/^/     /'
  done
done
echo "$green of $runs runs green"
[ "$green" -eq "$runs" ]
