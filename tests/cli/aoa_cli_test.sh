#!/usr/bin/env bash
# End-to-end test of `ckptctl load --aoa`: the bundled HuggingFace example
# (q/k/v as torch Linear [out, in]) loaded into a fused, transposed model at
# TP=2, directly and after resharding into a native checkpoint; checked with
# numpy by aoa_verify.py. Plus config errors naming the line.
set -euo pipefail

CKPTCTL="$1"
EXAMPLE_DIR="$(dirname "$(dirname "$2")")"
VERIFY="$3"
T="${TEST_TMPDIR:-$(mktemp -d)}"
fail() { echo "FAIL: $*" >&2; exit 1; }
SRC="$EXAMPLE_DIR/tiny-model/model.safetensors"

cat > "$T/aoa.txt" <<'AOA'
# HF q/k/v [out, in] -> one fused [in, q|k|v per head] per layer
model.layers.$LAYER_ID.self_attn.q_proj.weight^T, model.layers.$LAYER_ID.self_attn.k_proj.weight^T, model.layers.$LAYER_ID.self_attn.v_proj.weight^T -> layers.$LAYER_ID.qkv, fused_qkv, num_heads=8, num_key_value_groups=8
model.layers.$LAYER_ID.mlp.up_proj.weight^T -> layers.$LAYER_ID.up
model.embed_tokens.weight -> embed, dtype='float32'   # BF16 in the file
lm_head.weight -> _
AOA
/usr/bin/python3 "$VERIFY" layout "$SRC" "$T/layout.json"

# Straight from the HF directory.
"$CKPTCTL" load "$EXAMPLE_DIR/tiny-model" --layout "$T/layout.json" --out "$T/out1" --aoa "$T/aoa.txt" --json > "$T/r1.json"
/usr/bin/python3 "$VERIFY" check "$SRC" "$T/layout.json" "$T/out1" "$T/r1.json"

# Resharded first (TP=2 native checkpoint), then loaded through the same config.
"$CKPTCTL" shard "$EXAMPLE_DIR/tiny-model" --layout "$EXAMPLE_DIR/layout-tp2.json" --out "$T/tp2" --unique-id 2
"$CKPTCTL" load "$T/tp2" --layout "$T/layout.json" --out "$T/out2" --aoa="$T/aoa.txt" --json > "$T/r2.json"
/usr/bin/python3 "$VERIFY" check "$SRC" "$T/layout.json" "$T/out2" "$T/r2.json"

# Config errors: exit 1, one line naming the file, line and what is wrong.
printf 'model.embed_tokens.weight -> e\nq k -> x\n' > "$T/bad.txt"
set +e
err=$("$CKPTCTL" load "$EXAMPLE_DIR/tiny-model" --layout "$T/layout.json" --out "$T/o3" --aoa "$T/bad.txt" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 1 ] || fail "bad config: exit $rc"
[ "$(echo "$err" | wc -l)" -eq 1 ] || fail "error is not one line: $err"
echo "$err" | grep "bad.txt:2:3: expected ',' or '->'" >/dev/null || fail "parse error does not point at line 2 column 3: $err"
printf 'model.norm.weight -> layers.0.up\n' > "$T/bad2.txt"
set +e
err=$("$CKPTCTL" load "$EXAMPLE_DIR/tiny-model" --layout "$T/layout.json" --out "$T/o4" --aoa "$T/bad2.txt" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 1 ] || fail "shape mismatch: exit $rc"
echo "$err" | grep "bad2.txt:1 (\`model.norm.weight -> layers.0.up\`): shape mismatch" >/dev/null || fail "shape error: $err"
set +e
err=$("$CKPTCTL" load "$EXAMPLE_DIR/tiny-model" --layout "$T/layout.json" --out "$T/o5" --aoa "$T/missing.txt" 2>&1 >/dev/null); rc=$?
set -e
[ $rc -eq 1 ] && echo "$err" | grep "missing.txt" >/dev/null || fail "missing config file: $err"
echo "ckptctl --aoa test passed"
