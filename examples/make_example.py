#!/usr/bin/python3
"""Writes the bundled example: a tiny HuggingFace-style safetensors checkpoint
(written with plain numpy + struct, independent of ckptd's writer) and the
layouts examples/run.sh uses. Deterministic; rerun to regenerate.

Usage: /usr/bin/python3 examples/make_example.py [OUT_DIR]
"""
import json
import os
import struct
import sys

import numpy as np


def write_safetensors(path, tensors):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def bf16(a):
    # round-to-nearest-even float32 -> bfloat16 bits
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "tiny-model")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(7)
    hidden, ffn, vocab, layers = 64, 128, 256, 2
    tensors = {"model.embed_tokens.weight": ("BF16", bf16(rng.standard_normal((vocab, hidden))))}
    for l in range(layers):
        p = f"model.layers.{l}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{proj}.weight"] = ("F32", rng.standard_normal((hidden, hidden)).astype(np.float32))
        tensors[p + "mlp.up_proj.weight"] = ("F32", rng.standard_normal((ffn, hidden)).astype(np.float32))
        tensors[p + "mlp.down_proj.weight"] = ("F32", rng.standard_normal((hidden, ffn)).astype(np.float32))
        tensors[p + "input_layernorm.weight"] = ("F32", np.ones(hidden, np.float32))
    tensors["model.norm.weight"] = ("F32", np.ones(hidden, np.float32))
    tensors["lm_head.weight"] = ("BF16", bf16(rng.standard_normal((vocab, hidden))))
    tensors["step"] = ("I64", np.array(1000, dtype=np.int64))
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)

    def layout(world, split_dim_for):
        ranks = []
        for r in range(world):
            ts = []
            for name, (dtype, arr) in tensors.items():
                shape = list(arr.shape)
                offset = [0] * len(shape)
                local = list(shape)
                d = split_dim_for(name, shape)
                if d is not None:
                    chunk = -(-shape[d] // world)
                    offset[d] = min(r * chunk, shape[d])
                    local[d] = max(0, min(chunk, shape[d] - offset[d]))
                ts.append({"name": name, "dtype": dtype, "global_shape": shape, "offset": offset, "shape": local})
            ranks.append({"rank": r, "tensors": ts})
        return {"world_size": world, "ranks": ranks}

    def col_parallel(name, shape):  # Megatron-style TP: rows of q/k/v/up, cols of o/down
        if len(shape) != 2:
            return None
        if any(k in name for k in ("o_proj", "down_proj")):
            return 1
        return 0

    def zero_like(name, shape):  # dim 0 everywhere it exists
        return 0 if len(shape) >= 1 else None

    here = os.path.dirname(out.rstrip("/")) or "."
    with open(os.path.join(here, "layout-tp2.json"), "w") as f:
        json.dump(layout(2, col_parallel), f, indent=1)
    with open(os.path.join(here, "layout-tp4-dim0.json"), "w") as f:
        json.dump(layout(4, zero_like), f, indent=1)


if __name__ == "__main__":
    main()
