#!/usr/bin/env bash
# Starts (or stops) a throwaway single-node Ceph cluster with an S3 gateway
# (radosgw) for the object-storage tests: no root, no systemd, no /etc/ceph,
# data in the OSD's memory. Packages: radosgw ceph-mon ceph-osd ceph-common
# (deploy/install-deps.sh).
#
#   rgw.sh start DIR      starts it under DIR (created), prints the
#                         environment to point a client at it (eval-able)
#   rgw.sh stop DIR       kills its daemons and removes DIR
#
# The gateway's user has the access key and secret printed as
# AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY; bucket "ckptd-test" exists. A
# second user (CKPTD_TEST_S3_ACCESS2/_SECRET2) owns bucket "ckptd-test2".
set -euo pipefail

cmd=${1:?usage: rgw.sh start|stop DIR}
dir=${2:?usage: rgw.sh start|stop DIR}

stop() {
  for f in "$dir"/*.pid; do
    [ -f "$f" ] || continue
    kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  rm -rf "$dir"
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "rgw.sh: unknown command $cmd" >&2; exit 2; }

for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool ceph-authtool; do
  command -v "$b" >/dev/null || { echo "rgw.sh: $b missing (deploy/install-deps.sh installs it)" >&2; exit 1; }
done

free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mon_port=$(free_port)
rgw_port=$(free_port)
fsid=$(/usr/bin/python3 -c 'import uuid; print(uuid.uuid4())')
conf="$dir/ceph.conf"
cat > "$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
run dir = $dir/run
log file = $dir/log/\$name.log
admin socket = $dir/run/\$name.asok
auth cluster required = none
auth service required = none
auth client required = none
ms bind msgr1 = false
ms mon client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd objectstore = memstore
memstore device bytes = 4294967296
osd data = $dir/osd/\$name
mon data = $dir/mon/\$name
[mon]
paxos propose interval = 0.01
paxos min wait = 0.001
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw data = $dir/rgw
CONF
mkdir -p "$dir/run" "$dir/log" "$dir/mon/mon.a" "$dir/osd/osd.0" "$dir/rgw"

ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >/dev/null
ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" --keyring "$dir/mon.keyring"
ceph-mon -c "$conf" -i a --pid-file "$dir/mon.pid"
for _ in $(seq 100); do [ -s "$dir/mon.pid" ] && break; sleep 0.1; done

uuid=$(/usr/bin/python3 -c 'import uuid; print(uuid.uuid4())')
id=$(ceph -c "$conf" osd new "$uuid" 2>/dev/null)
ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >/dev/null 2>&1
ceph-osd -c "$conf" -i "$id" --pid-file "$dir/osd.pid" 2>>"$dir/log/osd-start.log"
radosgw -c "$conf" -n client.rgw.a --pid-file "$dir/rgw.pid" 2>>"$dir/log/rgw-start.log"

access=ckptdtestaccess
secret=ckptdtestsecret0123456789
radosgw-admin -c "$conf" user create --uid=ckptd --display-name=ckptd \
  --access-key="$access" --secret="$secret" >/dev/null 2>&1 || true

endpoint="http://127.0.0.1:$rgw_port"
# Ready once a signed request answers; then the test bucket.
ok=0
for _ in $(seq 300); do
  if curl -s -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" \
       --user "$access:$secret" -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' \
       -X PUT "$endpoint/ckptd-test" 2>/dev/null | grep -qE '^(200|409)$'; then
    ok=1; break
  fi
  sleep 0.1
done
if [ $ok != 1 ]; then
  echo "rgw.sh: the gateway at $endpoint did not answer in 30 s (logs in $dir/log)" >&2
  exit 1
fi
# A second user owning its own bucket (per-root credentials).
access2=ckptdtestaccess2
secret2=ckptdtestsecret2-0123456789
radosgw-admin -c "$conf" user create --uid=ckptd2 --display-name=ckptd2 \
  --access-key="$access2" --secret="$secret2" >/dev/null 2>&1 || true
code=$(curl -s -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" \
  --user "$access2:$secret2" -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' \
  -X PUT "$endpoint/ckptd-test2")
case "$code" in 200|409) ;; *) echo "rgw.sh: bucket ckptd-test2 for the second user: HTTP $code" >&2; exit 1 ;; esac
cat <<ENV
export AWS_ENDPOINT_URL=$endpoint
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
export CKPTD_TEST_S3_BUCKET=ckptd-test
export CKPTD_TEST_S3_BUCKET2=ckptd-test2
export CKPTD_TEST_S3_ACCESS2=$access2
export CKPTD_TEST_S3_SECRET2=$secret2
export CKPTD_TEST_RGW_DIR=$dir
ENV
