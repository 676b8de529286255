#!/usr/bin/env bash
# Installs every Debian package ckptd needs to build, test and run. Idempotent:
# packages already present are not reinstalled, and apt-get update runs only
# when something is missing.
#
#   install-deps.sh             build + test + run (the default; tests/run.sh, examples/run.sh)
#   install-deps.sh --build     only what `bazel build //server:ckptd //client:ckptctl` needs
#   install-deps.sh --runtime   only the shared libraries the built binaries load
#                               (deploy/Containerfile's runtime stage)
#   install-deps.sh --print [--build|--runtime]   list the packages, install nothing
set -euo pipefail

# Everything Bazel's system_libs wiring (third_party/bazel/system_libs.bzl)
# asks pkg-config for must be here: the repository rule needs all of them.
BUILD_PACKAGES=(
  bazel-bootstrap build-essential pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libyaml-cpp-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libsimdjson-dev libspdlog-dev libfmt-dev libxxhash-dev liburing-dev zlib1g-dev
  prometheus-cpp-dev libsystemd-dev libssl-dev libcurl4-openssl-dev libexpat1-dev
  python3
  clang-14 libclang-rt-14-dev llvm-14
  patchelf
)
# (clang-14, its sanitizer/libFuzzer runtimes and llvm-symbolizer: the
# --config=clang/asan/fuzz builds of .bazelrc, run by tests/run.sh; patchelf:
# tests/gpu/bundle.sh points the bundled binaries at their own libraries.)
# Tests: Python client tests, manifest checks (python3-yaml), the systemd unit
# check (systemd-analyze), the metrics checks (promtool and the Prometheus
# server, from the prometheus package), the peer-plane tests' certificates
# (openssl), and `pip install client/python` into a venv, offline
# (python3-venv, python3-pip, python3-setuptools, python3-wheel; the stubs it
# generates need protobuf-compiler and protobuf-compiler-grpc, above),
# `python3 -m build` of its sdist and wheel (python3-build), and a throwaway
# Ceph S3 gateway for the object-storage tests (radosgw, ceph-mon, ceph-osd,
# ceph-common: tests/s3/rgw.sh; curl: its readiness probe and the tests'
# direct requests).
TEST_PACKAGES=(
  python3-numpy python3-grpcio python3-protobuf python3-torch
  python3-venv python3-pip python3-setuptools python3-wheel python3-build
  python3-yaml systemd prometheus openssl
  radosgw ceph-mon ceph-osd ceph-common curl
)
# What ckptd and ckptctl load at run time (tests/ops checks this list against
# `ldd` of the built binaries).
RUNTIME_PACKAGES=(
  libgrpc++1.51 libprotobuf32 libabsl20220623 libyaml-cpp0.7 libspdlog1.10 libfmt9
  libxxhash0 liburing2 libprometheus-cpp-pull1.0 libprometheus-cpp-core1.0 libsystemd0
  libsimdjson14 libssl3 libcurl4 libexpat1
)

mode=all
print=0
for arg in "$@"; do
  case "$arg" in
    --build) mode=build ;;
    --runtime) mode=runtime ;;
    --print) print=1 ;;
    *) echo "install-deps: unknown argument $arg" >&2; exit 2 ;;
  esac
done
case "$mode" in
  all) PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}") ;;
  build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  runtime) PACKAGES=("${RUNTIME_PACKAGES[@]}") ;;
esac
if [ "$print" -eq 1 ]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null

# The prometheus package is only here for its promtool and for tests that run
# their own server on loopback: on a machine run by systemd, its package
# enables and starts a Prometheus service on :9090; stop that one.
for p in "${missing[@]}"; do
  if [ "$p" = prometheus ] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    echo "install-deps: installed prometheus for its tools; its service is disabled" >&2
  fi
done
