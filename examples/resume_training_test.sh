#!/usr/bin/env bash
# Runs examples/resume_training.py (docs/torch.md, README tour): 4 ranks train, save through
# ckptd, restart with 2 ranks and resume; the losses must continue where they stopped. Then
# the negative control: a restart that drops the optimizer state must fail the same check.
#   resume_training_test.sh CKPTD
set -uo pipefail
ckptd="$PWD/$1"
unset CKPTD_SOCKET CKPTD_JOB_ID RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT || true
out=$(/usr/bin/python3 -u examples/resume_training.py --ckptd "$ckptd" 2>&1)
rc=$?
echo "$out"
if [ $rc -ne 0 ] || ! grep -q "resume check: ok" <<<"$out"; then
  echo "FAIL: the resumed job did not continue where the first stopped (exit $rc)"
  exit 1
fi
out=$(/usr/bin/python3 -u examples/resume_training.py --ckptd "$ckptd" --drop-optimizer-state 2>&1)
rc=$?
echo "$out" | tail -n 7
if [ $rc -ne 1 ] || ! grep -q "resume check: FAILED" <<<"$out"; then
  echo "FAIL: the negative control (optimizer state dropped) passed the check (exit $rc)"
  exit 1
fi
echo "PASS"
