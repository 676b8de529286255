#!/usr/bin/env bash
# PaddlePaddle flex_checkpoint directories built byte for byte as Paddle writes
# them (protocol-4 and protocol-5 numpy arrays, safetensors data files,
# memoised metadata, an old-version metadata with a split big param) loaded
# resharded by ckptctl, offline and through the daemon, and converted;
# compared byte for byte with the values the files were made from.
set -euo pipefail

CKPTCTL="$1"
CKPTD="$2"
GEN="$3"
CHECK="$4"
T="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }
py() { /usr/bin/python3 "$@"; }

py "$GEN" "$T/pd"
P="$T/pd"

for d in pd4 pd5 pdst pdold; do
  "$CKPTCTL" inspect "$P/$d" --json > "$T/inspect_$d.json"
  py -c "
import json
j = json.load(open('$T/inspect_$d.json'))
assert j['format'] == 'paddle-flex-checkpoint', j['format']
if '$d' != 'pdold':
    t = j['tensors']
    assert j['unique_id'] == 3, j['unique_id']
    assert t['emb']['dtype'] == 'BF16' and t['emb']['global_shape'] == [10, 4]
    assert [s['replica_id'] for s in t['linear.bias']['shards']] == [0, 1]
    assert [s.get('flat_range') for s in t['opt.moment1']['shards']] == [[0, 10], [10, 24]]
    assert t['step']['global_shape'] == []
else:
    w = j['tensors']['w']
    assert w['global_shape'] == [6, 5] and len(w['shards']) == 3, w   # 3 split pieces
    assert [s['flat_range'] for s in w['shards']] == [[0, 12], [12, 24], [24, 30]]
"
  "$CKPTCTL" load "$P/$d" --layout "$P/$d/layout.json" --strict=false --out "$T/out_$d" --json > "$T/report_$d.json"
  py "$CHECK" "$P/$d/expected" "$P/$d/layout.json" "$T/out_$d"
done
py -c "
import json
r = json.load(open('$T/report_pd4.json'))
assert r['missing_keys'] == ['model.missing'], r['missing_keys']
"

# The older version of pd4 is still readable.
"$CKPTCTL" load "$P/pd4" --unique-id 1 --layout "$P/pd4/layout.json" --strict=false --out "$T/out_pd4_v1" >/dev/null
py "$CHECK" "$P/pd4/expected" "$P/pd4/layout.json" "$T/out_pd4_v1"

# Protocol-2 arrays cannot be read in place: a clear one-line error.
set +e
err=$("$CKPTCTL" load "$P/pd2" --layout "$P/pd4/layout.json" --strict=false --out "$T/o2" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 1 ] || fail "protocol-2 array accepted (rc $rc)"
[ "$(echo "$err" | wc -l)" -eq 1 ] || fail "error is not one line: $err"
echo "$err" | grep "0_0.distcp" >/dev/null || fail "error does not name the file: $err"
echo "$err" | grep "protocol 2" >/dev/null || fail "error does not say why: $err"

# convert: the split pieces are joined back into one whole shard.
"$CKPTCTL" convert "$P/pdold" --out "$T/native_old" --json > "$T/convert_old.json"
"$CKPTCTL" inspect "$T/native_old" --json | py -c "
import json, sys
j = json.load(sys.stdin)
assert j['format'] == 'ckptd' and j['unique_id'] == 0
w = j['tensors']['w']['shards']
assert len(w) == 1 and 'flat_range' not in w[0] and w[0]['shape'] == [6, 5], w
"
"$CKPTCTL" load "$T/native_old" --layout "$P/pdold/layout.json" --strict=false --out "$T/out_native_old" >/dev/null
py "$CHECK" "$P/pdold/expected" "$P/pdold/layout.json" "$T/out_native_old"
"$CKPTCTL" convert "$P/pd5" --out "$T/native5" --unique-id 7 >/dev/null
"$CKPTCTL" load "$T/native5" --layout "$P/pd5/layout.json" --strict=false --out "$T/out_native5" >/dev/null
py "$CHECK" "$P/pd5/expected" "$P/pd5/layout.json" "$T/out_native5"

# Through the daemon.
source "$(dirname "$0")/through_daemon.sh"
check_through_daemon "$P/pd5" "$P/pd5/layout.json" "$P/pd5/expected"
echo "Paddle flex_checkpoint test passed"
