#!/usr/bin/env bash
# End-to-end test of the offline ckptctl subcommands on the bundled example,
# checked with an independent numpy reader of safetensors files.
set -euo pipefail

CKPTCTL="$1"
EXAMPLE_DIR="$(dirname "$(dirname "$2")")"
VERIFY="$3"
T="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }

# inspect (text and JSON)
out=$("$CKPTCTL" inspect "$EXAMPLE_DIR/tiny-model")
echo "$out" | grep "huggingface-safetensors" >/dev/null || fail "inspect text"
"$CKPTCTL" inspect "$EXAMPLE_DIR/tiny-model" --json > "$T/inspect.json"
/usr/bin/python3 -c "import json,sys; j=json.load(open('$T/inspect.json')); assert j['format']=='huggingface-safetensors' and len(j['tensors'])==18, j['format']"

# shard into TP2 (uid 5), then load as TP4-dim0 with --json
"$CKPTCTL" shard "$EXAMPLE_DIR/tiny-model" --layout "$EXAMPLE_DIR/layout-tp2.json" --out "$T/tp2" --unique-id 5
[ -f "$T/tp2/5.metadata" ] && [ -f "$T/tp2/0_5.safetensors" ] && [ -f "$T/tp2/1_5.safetensors" ] || fail "shard outputs"
# The same version again: refused (issue 38: it was overwritten silently), unchanged;
# --overwrite replaces it.
before=$(md5sum "$T/tp2/5.metadata")
set +e
err=$("$CKPTCTL" shard "$EXAMPLE_DIR/tiny-model" --layout "$EXAMPLE_DIR/layout-tp4-dim0.json" --out "$T/tp2" --unique-id 5 2>&1); rc=$?
set -e
[ $rc -ne 0 ] || fail "shard over an existing version succeeded"
echo "$err" | grep "version 5 already exists" | grep -e "--overwrite" >/dev/null || fail "shard over an existing version: $err"
[ "$(md5sum "$T/tp2/5.metadata")" = "$before" ] || fail "a refused shard changed 5.metadata"
[ ! -e "$T/tp2/2_5.safetensors" ] || fail "a refused shard wrote a data file"
"$CKPTCTL" shard "$EXAMPLE_DIR/tiny-model" --layout "$EXAMPLE_DIR/layout-tp2.json" --out "$T/tp2" --unique-id 5 --overwrite \
  || fail "shard --overwrite"
"$CKPTCTL" inspect "$T/tp2" --json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); assert j['unique_id']==5 and j['format']=='ckptd'"
"$CKPTCTL" load "$T/tp2" --layout "$EXAMPLE_DIR/layout-tp4-dim0.json" --out "$T/out" --json > "$T/report.json"
/usr/bin/python3 "$VERIFY" "$EXAMPLE_DIR/tiny-model/model.safetensors" "$EXAMPLE_DIR/layout-tp4-dim0.json" "$T/out" "$T/report.json"
# The same load read around the page cache (O_DIRECT): the same bytes.
"$CKPTCTL" load "$T/tp2" --layout "$EXAMPLE_DIR/layout-tp4-dim0.json" --out "$T/out-dio" --direct-io always --json > "$T/dio.json"
/usr/bin/python3 -c "import json; j=json.load(open('$T/dio.json')); assert j['bytes_read'] > 0 and j['bytes_read_direct'] == j['bytes_read'], j"
for f in "$T"/out/rank*.safetensors; do
  cmp -s "$f" "$T/out-dio/$(basename "$f")" || fail "--direct-io always: $(basename "$f") differs"
done
set +e
err=$("$CKPTCTL" load "$T/tp2" --layout "$EXAMPLE_DIR/layout-tp4-dim0.json" --out "$T/o-dio" --direct-io sometimes 2>&1 >/dev/null); rc=$?
set -e
[ $rc -ne 0 ] && echo "$err" | grep "'sometimes' is not one of never, auto, always" >/dev/null || fail "bad --direct-io: $err"

# merge back into HF shards and compare every tensor with the original
"$CKPTCTL" merge "$T/tp2" --out "$T/merged" --shards 3 --skip-postfix .nothing
[ -f "$T/merged/model.safetensors.index.json" ] || fail "merge index"
/usr/bin/python3 "$VERIFY" --merged "$EXAMPLE_DIR/tiny-model/model.safetensors" "$T/merged"

# Errors: one line on stderr naming the problem, non-zero exit, no output.
set +e
err=$("$CKPTCTL" load "$T/nonexistent" --layout "$EXAMPLE_DIR/layout-tp2.json" --out "$T/o2" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -ne 0 ] || fail "load of a missing checkpoint succeeded"
[ "$(echo "$err" | wc -l)" -eq 1 ] || fail "error is not one line: $err"
echo "$err" | grep "nonexistent" >/dev/null || fail "error does not name the path: $err"
[ ! -e "$T/o2" ] || fail "output written on error"

cp -r "$T/tp2" "$T/bad"
printf 'garbage' | dd of="$T/bad/1_5.safetensors" bs=1 seek=3 conv=notrunc status=none
set +e
err=$("$CKPTCTL" load "$T/bad" --layout "$EXAMPLE_DIR/layout-tp2.json" --out "$T/o3" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -ne 0 ] || fail "corrupt header accepted"
echo "$err" | grep "1_5.safetensors" >/dev/null || fail "error does not name the file: $err"

set +e
err=$("$CKPTCTL" lod x 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 2 ] || fail "unknown command accepted (exit $rc)"
echo "$err" | grep "unknown command 'lod'; the commands are: status, inspect, shard, load" >/dev/null \
  || fail "unknown command not named with the list of commands: $err"

# No daemon behind --daemon: an error at once (not after the 10 s connect
# timeout) naming the path, whether nothing is there, a file that is not a
# socket, or a socket nobody listens on.
S=$(mktemp -d /tmp/ckptctl-test.XXXXXX)  # short: Unix socket paths are limited to 107 bytes
trap 'rm -rf "$S"' EXIT
/usr/bin/python3 -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' "$S/stale.sock"
touch "$S/plain"
for target in "$S/none.sock" "$S/plain" "$S/stale.sock"; do
  start=$(date +%s%N)
  set +e
  err=$("$CKPTCTL" status --daemon "$target" 2>&1 >/dev/null); rc=$?
  set -e
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  [ $rc -eq 1 ] || fail "status --daemon $target: exit $rc"
  echo "$err" | grep "cannot connect to ckptd at $target" >/dev/null || fail "status error does not name $target: $err"
  [ $ms -lt 5000 ] || fail "status --daemon $target took $ms ms to fail"
done
set +e
help=$("$CKPTCTL" --help 2>/dev/null); rc=$?
set -e
[ $rc -eq 0 ] || fail "--help exits $rc (issue 38: 0)"
echo "$help" | grep "ckptctl merge" >/dev/null || fail "--help does not list merge"
for flag in --daemon= --layout= --strict= --transport=; do
  echo "$help" | grep -e "^  $flag" >/dev/null || fail "--help does not list $flag"
done
"$CKPTCTL" --helpfull | grep -e "^  --flagfile=" >/dev/null || fail "--helpfull lacks Abseil's flags"
"$CKPTCTL" --version | grep -E "^ckptctl [0-9]+\.[0-9]+ \(ckptd api level [0-9]+\)$" >/dev/null \
  || fail "--version: $("$CKPTCTL" --version)"
echo "ckptctl CLI test passed"
