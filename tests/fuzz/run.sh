#!/usr/bin/env bash
# Fuzzes ckptd's parsers of untrusted bytes with libFuzzer (tests/fuzz/).
#
#   tests/fuzz/run.sh [--runs N | --minutes N] [--keep] [target...]
#
# Builds the targets with --config=fuzz (clang-14, libFuzzer, ASan + UBSan),
# then runs each, one after the other, on a scratch COPY of its checked-in
# corpus (new inputs never land in tests/fuzz/corpus/), with its dictionary
# when it has one and per-target -max_len, -rss_limit_mb=512 and -timeout=5:
#   --runs N      stop after N executions per target (default 20000: CI)
#   --minutes N   fuzz each target for N minutes instead. A long run bounds each
#                 input with -malloc_limit_mb=512 and the whole process with
#                 -rss_limit_mb=2048: libFuzzer's own per-input tables grow with
#                 the corpus (past 512 MB under ASan after ~2,000 AOA inputs),
#                 which is not the parser's memory
#   --keep        keep the scratch directories (the grown corpora) and say where
# Targets default to all of them. Prints, per target, the executions and the
# coverage (libFuzzer's final "cov:" edges and "ft:" features) and the result.
# Any crash, leak, timeout or out-of-memory fails the target: its input is
# copied to tests/fuzz/<target>/crashes/ and dumped, and the script exits 1
# once every target ran.
set -uo pipefail
cd "$(dirname "$0")/../.."

ALL=(safetensors_header metadata_json pickle distcp_zip aoa layout_json config_yaml plan_codec fd_socket job_mac
     s3_answers fetch_spans)
declare -A MAX_LEN=(
  [safetensors_header]=16384 [metadata_json]=16384 [pickle]=16384 [distcp_zip]=8192
  [aoa]=4096 [layout_json]=16384 [config_yaml]=8192 [plan_codec]=8192 [fd_socket]=1024
  [job_mac]=2048 [s3_answers]=8192 [fetch_spans]=4096
)

runs=20000
minutes=""
keep=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; minutes=""; shift 2 ;;
    --runs=*) runs="${1#*=}"; minutes=""; shift ;;
    --minutes) minutes="$2"; shift 2 ;;
    --minutes=*) minutes="${1#*=}"; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")
for t in "${targets[@]}"; do
  [ -n "${MAX_LEN[$t]:-}" ] || { echo "run.sh: unknown target '$t' (known: ${ALL[*]})" >&2; exit 2; }
done

labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:$t"); done
echo "== bazel build --config=fuzz ${labels[*]}"
if ! bazel build --config=fuzz "${labels[@]}"; then
  echo "run.sh: the --config=fuzz build failed" >&2
  exit 1
fi
bin="$(bazel info --config=fuzz bazel-bin 2>/dev/null)/tests/fuzz"

# A smaller quarantine than ASan's 256 MiB, and allocation stacks of 10
# frames rather than 30 (ASan keeps every distinct one: recursive parsers
# such as yaml-cpp's make new ones all the time), keep a long run well under
# -rss_limit_mb=512, so an OOM report means the parser, not ASan.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:quarantine_size_mb=64:malloc_context_size=10:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

scratch_root="$(mktemp -d "${TMPDIR:-/tmp}/ckptd-fuzz.XXXXXX")"
[ "$keep" = 1 ] || trap 'rm -rf "$scratch_root"' EXIT

failed=0
summary=()
for t in "${targets[@]}"; do
  s="$scratch_root/$t"
  mkdir -p "$s/corpus" "$s/artifacts"
  cp tests/fuzz/corpus/"$t"/* "$s/corpus/"
  seeds=$(ls "$s/corpus" | wc -l)
  args=(-timeout=5 -max_len="${MAX_LEN[$t]}" -print_final_stats=1
        -artifact_prefix="$s/artifacts/")
  [ -f "tests/fuzz/dict/$t.dict" ] && args+=(-dict="$PWD/tests/fuzz/dict/$t.dict")
  if [ -n "$minutes" ]; then
    args+=(-max_total_time=$((minutes * 60)) -malloc_limit_mb=512 -rss_limit_mb=2048)
  else
    args+=(-runs="$runs" -rss_limit_mb=512)
  fi
  echo
  echo "== $t: $seeds seeds, ${args[*]}"
  (cd "$s" && "$bin/$t" "${args[@]}" "$s/corpus") >"$s/log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$s/log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$s/log" | tail -n 1 | awk '{print $2}')
  ft=$(grep -o 'ft: [0-9]*' "$s/log" | tail -n 1 | awk '{print $2}')
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$s/log" | tail -n 1)
  grown=$(ls "$s/corpus" | wc -l)
  found=$(ls "$s/artifacts" 2>/dev/null | grep -E '^(crash|leak|timeout|oom)-' || true)
  if [ $rc -ne 0 ] || [ -n "$found" ]; then
    failed=1
    result="FAILED (exit $rc)"
    echo "-- $t FAILED (exit $rc); libFuzzer's report:"
    grep -v -e '^#[0-9]' -e '^[[:space:]]*NEW_FUNC' "$s/log" | tail -n 60
    if [ -n "$found" ]; then
      mkdir -p "tests/fuzz/$t/crashes"
      for a in $found; do
        cp "$s/artifacts/$a" "tests/fuzz/$t/crashes/$a"
        echo "-- input tests/fuzz/$t/crashes/$a ($(stat -c %s "$s/artifacts/$a") bytes; reproduce:" \
             "$bin/$t tests/fuzz/$t/crashes/$a):"
        od -A d -c "$s/artifacts/$a" | head -n 24
      done
      result="$result: $(echo $found | tr ' ' ',')"
    fi
  else
    result="ok"
  fi
  line=$(printf '%-20s %10s execs  cov %-6s ft %-7s corpus %4s -> %-5s rss %5s MB  %s' \
         "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$seeds" "$grown" "${rss:-?}" "$result")
  echo "$line"
  summary+=("$line")
done

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
if [ "$keep" = 1 ]; then echo "scratch (grown corpora, logs): $scratch_root"; fi
exit $failed
