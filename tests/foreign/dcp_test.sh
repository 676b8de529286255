#!/usr/bin/env bash
# Real PyTorch DCP checkpoints written by Debian's torch 1.13 (2 gloo processes,
# ShardedTensors split on dim 0, plain tensors, a bytes item) loaded by ckptctl
# into 3 other ranks, offline and through the daemon, and converted to the
# native format; every target compared byte for byte with torch's own values.
set -euo pipefail

CKPTCTL="$1"
CKPTD="$2"
GEN="$3"
CHECK="$4"
T="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }
py() { /usr/bin/python3 "$@"; }

py "$GEN" "$T/dcp"
D="$T/dcp"

for c in ckpt ckpt1; do
  "$CKPTCTL" inspect "$D/$c" | grep "format: *pytorch-dcp" >/dev/null || fail "inspect $c: format"
  "$CKPTCTL" inspect "$D/$c" --json | py -c "
import json, sys
j = json.load(sys.stdin)
assert j['format'] == 'pytorch-dcp', j['format']
t = j['tensors']
assert sorted(t) == ['bias', 'emb.i64', 'layers.0.w', 'layers.0.w_bf16', 'norm.f16', 'step'], sorted(t)
assert t['layers.0.w']['global_shape'] == [7, 5] and len(t['layers.0.w']['shards']) == 2
assert [s['shape'] for s in t['layers.0.w']['shards']] == [[4, 5], [3, 5]]
assert t['layers.0.w_bf16']['dtype'] == 'BF16' and t['step']['global_shape'] == []
"
  "$CKPTCTL" load "$D/$c" --layout "$D/layout.json" --strict=false --out "$T/out_$c" --json > "$T/report_$c.json"
  py -c "
import json
r = json.load(open('$T/report_$c.json'))
assert r['format'] == 'pytorch-dcp' and r['missing_keys'] == ['extra_state'], r
"
  py "$CHECK" "$D/expected" "$D/layout.json" "$T/out_$c"
done

# A tensor item that is a view into a larger storage (storage offset 15).
"$CKPTCTL" load "$D/view" --layout "$D/layout-view.json" --strict=false --out "$T/out_view" >/dev/null
py "$CHECK" "$D/expected" "$D/layout-view.json" "$T/out_view"

# A transposed (non-contiguous) tensor item: refused with a clear one-line error.
set +e
err=$("$CKPTCTL" inspect "$D/strided" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 1 ] || fail "strided tensor accepted (rc $rc)"
[ "$(echo "$err" | wc -l)" -eq 1 ] || fail "error is not one line: $err"
echo "$err" | grep "strides \[1,4\]" >/dev/null || fail "error does not name the strides: $err"
echo "$err" | grep "__0_0.distcp" >/dev/null || fail "error does not name the file: $err"
echo "$err" | grep "UNIMPLEMENTED" >/dev/null || fail "wrong code: $err"

# DCP has no versions.
set +e
"$CKPTCTL" inspect "$D/ckpt" --unique-id 1 >/dev/null 2>&1 && fail "--unique-id accepted"
set -e

# convert -> native, then the same load from the native copy.
"$CKPTCTL" convert "$D/ckpt" --out "$T/native" --unique-id 4 --json > "$T/convert.json"
py -c "
import json
r = json.load(open('$T/convert.json'))
assert r['source_format'] == 'pytorch-dcp' and r['skipped_items'] == ['extra_state'], r
assert r['tensors'] == 6 and r['files'] == 9, r
"
[ -f "$T/native/4.metadata" ] || fail "convert wrote no 4.metadata"
"$CKPTCTL" inspect "$T/native" | grep "format: *ckptd" >/dev/null || fail "converted format"
"$CKPTCTL" load "$T/native" --layout "$D/layout.json" --strict=false --out "$T/out_native" >/dev/null
py "$CHECK" "$D/expected" "$D/layout.json" "$T/out_native"

# Through the daemon: the same planner and executor serve a DCP checkpoint.
source "$(dirname "$0")/through_daemon.sh"
check_through_daemon "$D/ckpt1" "$D/layout.json" "$D/expected"
echo "PyTorch DCP test passed"
