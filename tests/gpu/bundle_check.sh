#!/usr/bin/env bash
# Checks a GPU bundle (tests/gpu/bundle.sh DIR) on this CPU-only machine:
#
#   bash tests/gpu/bundle_check.sh DIR
#
# - DIR is under 48 MiB and its ckptd links no libcudart and no libnccl;
# - DIR/run.sh runs in a clean environment (env -i) inside a mount namespace
#   where the system's library directory holds only glibc and what the shell
#   tools need (no gRPC, protobuf, Abseil, yaml-cpp... and no CUDA toolkit),
#   says "no GPU", starts every bundled binary it can and exits 0.
# Needs root (or unprivileged user namespaces) for the mount namespace; where
# neither works it says so and fails, rather than passing unchecked.
set -euo pipefail
DIR=$(realpath "$1")
LIMIT_MIB=48
fail() { echo "bundle_check: FAILED: $*" >&2; exit 1; }

size_kib=$(du -sk "$DIR" | cut -f1)
[ "$size_kib" -le $((LIMIT_MIB * 1024)) ] || fail "bundle is $((size_kib / 1024)) MiB (limit $LIMIT_MIB)"
if ldd "$DIR/ws/server/ckptd" | grep -E 'libcudart|libnccl'; then
  fail "ckptd links libcudart or libnccl dynamically"
fi
echo "bundle_check: $((size_kib / 1024)) MiB; ckptd links neither libcudart nor libnccl"

MULTI=/usr/lib/x86_64-linux-gnu
mini=$(mktemp -d /tmp/ckptd-minilib.XXXXXX)
trap 'rm -rf "$mini"' EXIT
# glibc itself, then what the tools run.sh uses need (found with ldd).
for l in ld-linux-x86-64.so.2 libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 \
         libresolv.so.2; do
  [ -e "$MULTI/$l" ] && cp -L "$MULTI/$l" "$mini/"
done
for t in bash dirname mkdir uname head cat timeout tail grep sed env tr wc cut ls; do
  ldd "$(command -v "$t")" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do cp -L "$lib" "$mini/"; done
echo "bundle_check: system libraries inside the namespace: $(ls "$mini" | tr '\n' ' ')"

out=$DIR/out-clean
rm -rf "$out"
# (the library directory last: mount itself needs what it hides)
inner="{ [ ! -d /usr/local/cuda ] || mount -t tmpfs none /usr/local/cuda; } && \
  { [ ! -d /usr/local/lib ] || mount -t tmpfs none /usr/local/lib; } && \
  mount --bind '$mini' $MULTI && \
  exec env -i HOME=/tmp OUT='$out' '$DIR/run.sh'"
if unshare --mount --propagation private true 2>/dev/null; then
  ns=(unshare --mount --propagation private)
elif unshare --user --map-root-user --mount true 2>/dev/null; then
  ns=(unshare --user --map-root-user --mount)
else
  fail "cannot create a mount namespace here (needs root or user namespaces)"
fi
set +e
"${ns[@]}" bash -c "$inner" >"$DIR/clean-run.log" 2>&1
rc=$?
set -e
cat "$DIR/clean-run.log"
[ "$rc" -eq 0 ] || fail "run.sh exited $rc in the clean environment"
grep -q "^no GPU" "$DIR/clean-run.log" || fail "run.sh did not report 'no GPU'"
grep -q -- "--- ckptd_starts: passed" "$DIR/clean-run.log" || fail "the bundled ckptd did not start"
if grep -q "not found" "$DIR/clean-run.log"; then fail "a bundled binary lacks a library"; fi
echo "bundle_check: passed (clean environment, no system -dev libraries, no CUDA toolkit)"
