#!/usr/bin/python3
"""Checks `ckptctl load` outputs byte for byte against the framework's own values.

    check_load.py EXPECTED_DIR LAYOUT.json OUT_DIR

EXPECTED_DIR holds <tensor>.npy with each whole tensor as the framework saved it
(bfloat16 as uint16 bits). For every rank and target of the layout, OUT_DIR/rank{r}.safetensors
must hold exactly the target's box (or flattened range of it), cast to the target dtype
where it differs (only exact casts are used by the tests: F16 -> F32, BF16 -> F32).
Reads safetensors with its own parser (no ckptd code).
"""
import json
import os
import struct
import sys

import numpy as np

NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
      "U16": np.uint16, "BOOL": np.bool_}
ALIASES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
           "int32": "I32", "float64": "F64", "bool": "BOOL", "uint8": "U8"}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        out[name] = (t["dtype"], t["shape"], data[base + b:base + e])
    return out


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main():
    exp_dir, layout_path, out_dir = sys.argv[1:4]
    layout = json.load(open(layout_path))
    checked = 0
    for rank in layout["ranks"]:
        got = read_safetensors(os.path.join(out_dir, f"rank{rank['rank']}.safetensors"))
        for t in rank["tensors"]:
            name = t["name"]
            path = os.path.join(exp_dir, name + ".npy")
            if not os.path.exists(path):
                assert name not in got, f"rank {rank['rank']}: missing key {name} was written"
                continue
            full = np.load(path)
            src_dtype = t.get("source_dtype")
            dtype = ALIASES.get(t["dtype"], t["dtype"])
            assert list(full.shape) == t["global_shape"], (name, full.shape, t["global_shape"])
            sl = tuple(slice(o, o + s) for o, s in zip(t["offset"], t["shape"]))
            want = full[sl]
            if dtype != src_dtype and src_dtype is not None:
                if src_dtype == "BF16":
                    want = bf16_to_f32(want)
                want = want.astype(NP[dtype])
            want = np.ascontiguousarray(want).reshape(-1)
            if "flat_range" in t:
                a, b = t["flat_range"]
                want = want[a:b]
            assert name in got, f"rank {rank['rank']}: {name} not in output"
            gd, gshape, gbytes = got[name]
            assert gd == dtype, (name, gd, dtype)
            if gbytes != want.astype(NP[dtype]).tobytes():
                g = np.frombuffer(gbytes, dtype=NP[dtype])
                raise AssertionError(f"rank {rank['rank']} {name}: got {g} want {want}")
            checked += 1
    print(f"check_load: {checked} targets byte-exact")
    assert checked > 0


if __name__ == "__main__":
    main()
