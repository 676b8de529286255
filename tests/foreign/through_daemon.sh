# Sourced by the foreign-format tests: loads a checkpoint through a real
# ckptd and checks the outputs. Uses the caller's CKPTD, CKPTCTL, CHECK, T,
# fail and py.
#
#   check_through_daemon CKPT LAYOUT EXPECTED
check_through_daemon() {
  local ckpt="$1" layout="$2" expected="$3"
  S="$(mktemp -d /tmp/ckptd-foreign.XXXXXX)"
  "$CKPTD" --socket "$S/ckptd.sock" --root "$T" --cache-budget 64MiB >"$T/ckptd.log" 2>&1 &
  DAEMON=$!
  trap 'kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true; rm -rf "$S"' EXIT
  for _ in $(seq 200); do [ -S "$S/ckptd.sock" ] && break; sleep 0.05; done
  "$CKPTCTL" load "$ckpt" --layout "$layout" --strict=false --out "$T/out_daemon" \
      --daemon "$S/ckptd.sock" >/dev/null || { cat "$T/ckptd.log"; fail "load through ckptd"; }
  py "$CHECK" "$expected" "$layout" "$T/out_daemon"
}
