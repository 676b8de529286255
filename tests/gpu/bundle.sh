#!/usr/bin/env bash
# Writes a self-contained GPU test bundle (issue 18) into DIR:
#
#   bash tests/gpu/bundle.sh DIR          (builds with --config=cuda first)
#   DIR/run.sh                            (on any x86-64 Linux with the NVIDIA driver)
#
# DIR/run.sh needs nothing but the bundle, the driver and a python3 (for the
# Python client's test: ${PYTHON:-python3} with numpy, grpcio, protobuf and,
# for its GPU part, torch with CUDA). Layout:
#   run.sh                 the runner (tests/gpu/bundle_run.sh)
#   ws/                    a runfiles tree mirroring the repository:
#     server/ckptd client/ckptctl tests/gpu/{gpu_delivery_test,gpu_ipc_test,ipc_client,gpu_bench}
#     client/python/ckptd/ + ckpt_pb2*.py, tests/python/testlib.py,
#     tests/python/torch_client_test.py, tests/gpu/torch_cuda_test.py, VERSION
#   lib/                   every shared library those binaries need that a plain
#                          Debian/Ubuntu machine with only the driver lacks
#                          (from ldd; glibc's own and the driver's are not
#                          bundled); binaries carry an rpath to it
#                          ($ORIGIN/../lib, $ORIGIN/../../lib), libraries $ORIGIN.
# CUDA's runtime is linked statically and NCCL is loaded with dlopen, so no
# libcudart or libnccl is bundled or needed; object storage is left out
# (--define=s3=0); the bundle stays under 48 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ $# -lt 1 ]; then
  echo "usage: bash tests/gpu/bundle.sh DIR" >&2
  exit 2
fi
DIR=$(realpath -m "$1")
LIMIT_MIB=48

if [ ! -x "${CKPTD_CUDA_PATH:-/usr/local/cuda}/bin/nvcc" ]; then
  echo "bundle: no CUDA toolkit at ${CKPTD_CUDA_PATH:-/usr/local/cuda}; nothing to build" >&2
  exit 1
fi
for tool in patchelf strip ldd; do
  command -v "$tool" >/dev/null || { echo "bundle: needs $tool (deploy/install-deps.sh)" >&2; exit 1; }
done

BAZEL_ARGS=()
if [ "${CI:-}" = "true" ]; then BAZEL_ARGS+=(--batch); fi
BINS=(server/ckptd client/ckptctl tests/gpu/gpu_delivery_test tests/gpu/gpu_ipc_test
      tests/gpu/ipc_client tests/gpu/gpu_bench)
targets=()
for b in "${BINS[@]}"; do targets+=("//${b%/*}:${b##*/}"); done
# --define=s3=0: no object storage in the bundle (libcurl and the libraries it
# pulls in, gnutls, ldap, kerberos, ..., would take it over the limit; the
# GPU tests do not use s3://).
bazel "${BAZEL_ARGS[@]}" build --config=cuda --define=s3=0 "${targets[@]}" //client/python:ckptd 2>&1 | tail -n 5
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bundle: bazel build --config=cuda failed" >&2; exit 1; }
BIN=$(bazel "${BAZEL_ARGS[@]}" info --config=cuda --define=s3=0 bazel-bin 2>/dev/null)

rm -rf "$DIR"
mkdir -p "$DIR/ws" "$DIR/lib"
W=$DIR/ws

# Binaries: stripped, rpath to lib/.
for b in "${BINS[@]}"; do
  mkdir -p "$W/${b%/*}"
  cp "$BIN/$b" "$W/$b"
  chmod u+w "$W/$b"
  strip --strip-unneeded "$W/$b"
  depth=$(echo "$b" | tr -cd / | wc -c)
  up=$(printf '../%.0s' $(seq $((depth + 1))))  # ws/<path>/.. up to DIR
  patchelf --force-rpath --set-rpath "\$ORIGIN/${up}lib" "$W/$b"
done

# Libraries: what ldd resolves, minus glibc's own, the dynamic loader and the
# driver's (those come with any machine that has the NVIDIA driver).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|libutil|libanl|libcuda\.so|libnvidia)'
declare -A seen=()
for b in "${BINS[@]}"; do
  while read -r name path; do
    [ -n "$path" ] || continue
    if echo "$name" | grep -Eq "$skip"; then continue; fi
    if [ -z "${seen[$name]:-}" ]; then
      seen[$name]=1
      cp -L "$path" "$DIR/lib/$name"
      chmod u+w "$DIR/lib/$name"
      strip --strip-unneeded "$DIR/lib/$name"
      patchelf --set-rpath '$ORIGIN' "$DIR/lib/$name"
    fi
  done < <(ldd "$BIN/$b" | awk '/=>/ && $3 ~ /^\// {print $1, $3}')
done
if ls "$DIR/lib" | grep -Eq '^lib(cudart|nccl)'; then
  echo "bundle: a binary links libcudart or libnccl dynamically (it must not):" >&2
  ls "$DIR/lib" | grep -E '^lib(cudart|nccl)' >&2
  exit 1
fi

# The Python client with its generated stubs, and the Python tests.
mkdir -p "$W/client/python/ckptd" "$W/tests/python" "$W/tests/gpu"
cp client/python/ckptd/*.py "$W/client/python/ckptd/"
rm -f "$W/client/python/ckptd/"ckpt_pb2*.py
cp "$BIN/client/python/ckpt_pb2.py" "$BIN/client/python/ckpt_pb2_grpc.py" "$W/client/python/"
cp tests/python/testlib.py "$W/tests/python/"
cp tests/gpu/torch_cuda_test.py "$W/tests/gpu/"
cp tests/python/torch_client_test.py "$W/tests/python/"  # the DCP reader/writer on the device's torch
cp VERSION "$W/VERSION"
cp tests/gpu/bundle_run.sh "$DIR/run.sh"
chmod -R u+w,a+rX "$DIR"
chmod +x "$DIR/run.sh"
git rev-parse --short HEAD > "$DIR/COMMIT" 2>/dev/null || echo unknown > "$DIR/COMMIT"

size_kib=$(du -sk "$DIR" | cut -f1)
echo "bundle: $DIR, $((size_kib / 1024)) MiB ($(ls "$DIR/lib" | wc -l) libraries; limit $LIMIT_MIB MiB)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "bundle: over $LIMIT_MIB MiB" >&2
  du -sk "$DIR"/lib/* "$W"/server/* "$W"/tests/gpu/* | sort -n | tail -n 10 >&2
  exit 1
fi
