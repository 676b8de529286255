#!/usr/bin/python3
"""Independent numpy check of `ckptctl load --aoa` on the bundled example (no ckptd code).

aoa_verify.py layout SRC.safetensors LAYOUT.json
    writes the target layout used by aoa_cli_test.sh.
aoa_verify.py check SRC.safetensors LAYOUT.json OUT_DIR REPORT.json
    each OUT_DIR/rank{r}.safetensors holds the layout's boxes of the model the
    test's AOA config describes, computed here with numpy from SRC.
"""
import json
import os
import sys

import numpy as np

from verify_outputs import read as read_raw  # the suite's independent safetensors reader


def read(path):
    """verify_outputs.read, with BF16 (read as raw '<u2') widened to float32:
    the bits are the high half."""
    out = read_raw(path)
    for name, a in out.items():
        if a.dtype == np.dtype("<u2"):
            out[name] = (a.astype("<u4") << 16).view("<f4")
    return out


def model(src):
    """The model tensors the AOA config of aoa_cli_test.sh builds, whole."""
    m = {}
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        q, k, v = (src[p + f"self_attn.{x}_proj.weight"].T for x in "qkv")
        # fused_qkv, num_heads=8, num_key_value_groups=8 along axis 1: per group
        # g, the query head g, then K_g, then V_g (head width 64 / 8 = 8).
        d, parts = 8, []
        for g in range(8):
            parts += [q[:, g * d:(g + 1) * d], k[:, g * d:(g + 1) * d], v[:, g * d:(g + 1) * d]]
        m[f"layers.{layer}.qkv"] = np.concatenate(parts, axis=1)
        m[f"layers.{layer}.up"] = src[p + "mlp.up_proj.weight"].T
    m["embed"] = src["model.embed_tokens.weight"]
    return m


def make_layout(src_path, out):
    shapes = {k: list(v.shape) for k, v in model(read(src_path)).items()}
    ranks = []
    for r in range(2):
        ts = []
        for name, shape in sorted(shapes.items()):
            dtype = "F32"
            if name.endswith("qkv"):  # column parallel
                off, shp = [0, r * shape[1] // 2], [shape[0], shape[1] // 2]
            else:  # row parallel
                off, shp = [r * shape[0] // 2, 0], [shape[0] // 2, shape[1]]
            ts.append({"name": name, "dtype": dtype, "global_shape": shape, "offset": off, "shape": shp})
        ranks.append({"rank": r, "tensors": ts})
    json.dump({"world_size": 2, "ranks": ranks}, open(out, "w"))


def check(src_path, layout_path, out_dir, report_path):
    want = model(read(src_path))
    layout = json.load(open(layout_path))
    report = json.load(open(report_path))
    assert report["missing_keys"] == [], report["missing_keys"]
    # lm_head is dropped; k/v/o and the norms are not in the model: unexpected.
    unexpected = set(report["unexpected_keys"])
    assert "lm_head.weight" not in unexpected, unexpected
    assert "model.layers.0.self_attn.o_proj.weight" in unexpected, unexpected
    assert not any("q_proj" in k or "k_proj" in k or "v_proj" in k for k in unexpected), unexpected
    checked = 0
    for rank in layout["ranks"]:
        got = read(os.path.join(out_dir, f"rank{rank['rank']}.safetensors"))
        for t in rank["tensors"]:
            sl = tuple(slice(o, o + s) for o, s in zip(t["offset"], t["shape"]))
            exp = want[t["name"]][sl]
            assert got[t["name"]].shape == exp.shape, (t["name"], got[t["name"]].shape, exp.shape)
            assert np.array_equal(got[t["name"]], exp.astype("<f4")), (rank["rank"], t["name"])
            checked += 1
    print(f"aoa: {checked} slices exact")


if __name__ == "__main__":
    if sys.argv[1] == "layout":
        make_layout(sys.argv[2], sys.argv[3])
    else:
        check(*sys.argv[2:6])
