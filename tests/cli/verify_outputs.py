#!/usr/bin/python3
"""Independent check of ckptctl outputs with numpy (no ckptd code).

verify_outputs.py SRC.safetensors LAYOUT.json OUT_DIR REPORT.json
    each OUT_DIR/rank{r}.safetensors holds exactly the layout's boxes of SRC.
verify_outputs.py --merged SRC.safetensors MERGED_DIR
    the merged HF shards hold every tensor of SRC unchanged.
"""
import json
import os
import struct
import sys

import numpy as np

NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
      "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "u1"}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            f.seek(base + b)
            out[name] = np.frombuffer(f.read(e - b), dtype=NP[info["dtype"]]).reshape(info["shape"])
        return out


def main():
    if sys.argv[1] == "--merged":
        src = read(sys.argv[2])
        merged = {}
        index = json.load(open(os.path.join(sys.argv[3], "model.safetensors.index.json")))
        for f in sorted(set(index["weight_map"].values())):
            merged.update(read(os.path.join(sys.argv[3], f)))
        assert set(merged) == set(src), (set(merged) ^ set(src))
        for k, v in src.items():
            assert np.array_equal(merged[k], v), k
        total = sum(v.nbytes for v in src.values())
        assert index["metadata"]["total_size"] == total, (index["metadata"]["total_size"], total)
        print(f"merged: {len(src)} tensors identical")
        return
    src = read(sys.argv[1])
    layout = json.load(open(sys.argv[2]))
    report = json.load(open(sys.argv[4]))
    for key in ("bytes_read", "missing_keys", "unexpected_keys"):
        assert key in report, key
    assert report["missing_keys"] == [] and report["unexpected_keys"] == [], report
    assert report["bytes_read"] <= sum(v.nbytes for v in src.values())
    checked = 0
    for rank in layout["ranks"]:
        got = read(os.path.join(sys.argv[3], f"rank{rank['rank']}.safetensors"))
        for t in rank["tensors"]:
            full = src[t["name"]]
            sl = tuple(slice(o, o + s) for o, s in zip(t["offset"], t["shape"]))
            want = full[sl] if sl else full
            assert np.array_equal(got[t["name"]], want), (rank["rank"], t["name"])
            checked += 1
    print(f"load: {checked} rank tensors identical")


if __name__ == "__main__":
    main()
