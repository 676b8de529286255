#!/usr/bin/env bash
# Runs one Python client test with Debian's /usr/bin/python3 (not whichever
# python3 comes first on PATH), the `ckptd` package and its generated stubs
# from the runfiles on PYTHONPATH, and the daemon and ckptctl binaries.
#   run_py_test.sh TEST.py CKPTD CKPTCTL
set -euo pipefail
script="$1"
export CKPTD_BIN="$PWD/$2"
export CKPTCTL="$PWD/$3"
export PYTHONPATH="$PWD/client/python:$PWD/tests/python:$PWD/$(dirname "$script")"
unset CKPTD_SOCKET CKPTD_JOB_ID CKPTD_PROTO_DIR RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE \
  MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT SLURM_JOB_ID || true
exec /usr/bin/python3 -u "$script"
