#!/usr/bin/env bash
# Checks deploy/systemd/ckptd.service with `systemd-analyze verify` (which
# needs ExecStart's binary to exist: the test points it at the freshly built
# ckptd instead of /usr/bin/ckptd), requires verify to print nothing (it only
# warns about unknown keys and bad values, with exit status 0), checks the
# directives operators rely on, the shipped config against the unit, and the
# sysusers.d file.
#   systemd_unit_test.sh CKPTD UNIT SYSUSERS CONFIG
set -euo pipefail
ckptd="$(realpath "$1")"
unit="$2"
sysusers="$(realpath "$3")"
config="$4"
tmp="$(mktemp -d "${TEST_TMPDIR:-/tmp}/unit-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

command -v systemd-analyze >/dev/null || fail "systemd-analyze missing (deploy/install-deps.sh installs systemd)"

# verify UNIT_FILE: exit 0 and not a line of output.
verify() {
  local out rc=0
  out="$(systemd-analyze verify --man=no "$1" 2>&1)" || rc=$?
  if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
    echo "systemd-analyze verify $1 (exit $rc):"
    echo "$out"
    return 1
  fi
}

sed "s#/usr/bin/ckptd#${ckptd}#g" "$unit" > "$tmp/ckptd.service"
verify "$tmp/ckptd.service" || fail "the unit does not verify cleanly"
echo "ok: systemd-analyze verify"

# The check is not vacuous: a misspelt key and a bad value are caught.
sed 's/^ProtectSystem=strict/ProtectSystem=strictest/' "$tmp/ckptd.service" > "$tmp/bad1.service"
! verify "$tmp/bad1.service" >/dev/null || fail "verify accepted ProtectSystem=strictest"
sed 's/^LimitMEMLOCK=infinity/LimitMEMLOK=infinity/' "$tmp/ckptd.service" > "$tmp/bad2.service"
! verify "$tmp/bad2.service" >/dev/null || fail "verify accepted LimitMEMLOK"
echo "ok: verify catches bad keys and values"

# Directives the deployment relies on.
for d in 'Type=notify' 'NotifyAccess=main' 'User=ckptd' 'Group=ckptd' 'RuntimeDirectory=ckptd' \
         'LimitMEMLOCK=infinity' 'ProtectSystem=strict' 'PrivateTmp=yes' 'NoNewPrivileges=yes' \
         'Restart=on-failure' 'ExecStart=/usr/bin/ckptd --config /etc/ckptd/ckptd.yaml' \
         'ExecStartPre=/usr/bin/ckptd --check-config /etc/ckptd/ckptd.yaml' \
         'ReadOnlyPaths=/data/checkpoints' 'WantedBy=multi-user.target'; do
  grep -qxF "$d" "$unit" || fail "missing directive: $d"
done
echo "ok: directives"

# The shipped config (installed as /etc/ckptd/ckptd.yaml) fits the unit: it is
# valid, its socket lies in the RuntimeDirectory, its roots are the
# ReadOnlyPaths, and TimeoutStopSec leaves drain_timeout room.
# (--check-config requires the roots to exist: they move beneath a temporary directory.)
tmp_roots="$(mktemp -d)"
mkdir -p "$tmp_roots/data/checkpoints"
sed "s|/data/checkpoints|$tmp_roots/data/checkpoints|g" "$config" >"$tmp_roots/ckptd.yaml"
"$ckptd" --check-config "$tmp_roots/ckptd.yaml" >/dev/null || fail "config/ckptd.yaml is not valid"
rm -rf "$tmp_roots/data"
"$ckptd" --check-config "$tmp_roots/ckptd.yaml" >/dev/null 2>&1 && fail "--check-config passed a missing root"
rm -rf "$tmp_roots"
eff="$("$ckptd" --config "$config" --print-config)"
sock="$(sed -n 's/^socket: //p' <<<"$eff")"
[ "$(dirname "$sock")" = /run/ckptd ] || fail "socket $sock is not in RuntimeDirectory /run/ckptd"
roots="$(awk '/^roots:/{f=1;next} /^[a-z_]+:/{f=0} f && /^ *- /{sub(/^ *- */,""); print}' <<<"$eff" | tr '\n' ' ')"
ro="$(sed -n 's/^ReadOnlyPaths=//p' "$unit")"
[ "${roots% }" = "$ro" ] || fail "roots '$roots' != ReadOnlyPaths '$ro'"
drain="$(sed -n 's/^drain_timeout: \([0-9]*\)s$/\1/p' <<<"$eff")"
stop="$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s$/\1/p' "$unit")"
[ -n "$drain" ] && [ -n "$stop" ] && [ "$stop" -gt "$drain" ] || fail "TimeoutStopSec=${stop}s must exceed drain_timeout ${drain}s"
echo "ok: config/ckptd.yaml fits the unit"

# sysusers.d creates the user and group the unit runs as.
mkdir -p "$tmp/root/etc"
out="$(systemd-sysusers --dry-run --root="$tmp/root" "$sysusers" 2>&1)" || fail "systemd-sysusers: $out"
grep -q "Creating group 'ckptd'" <<<"$out" || fail "sysusers creates no ckptd group: $out"
grep -q "Creating user 'ckptd'" <<<"$out" || fail "sysusers creates no ckptd user: $out"
echo "ok: sysusers"
