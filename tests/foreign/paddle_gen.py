#!/usr/bin/python3
"""Writes PaddlePaddle flex_checkpoint directories byte for byte as Paddle does (test helper).

    paddle_gen.py OUT_DIR

Paddle itself is not installable here, so this script recreates what its save path
pickles: dataclass records with Paddle's module paths (pickled by Python's own pickle
module as STACK_GLOBAL + EMPTY_TUPLE + NEWOBJ + BUILD), and data files that are
paddle.save'd state dicts of numpy arrays (pickled by numpy's own reducers).

  OUT_DIR/pd4    protocol-4 metadata and data files (paddle.distributed.flex_checkpoint.dcp),
                 shared (memoised) tuples and strings, replicas saved with replica ids,
                 bfloat16 stored as uint16, a flattened (ZeRO) tensor, a 120 KB array
                 (its payload lies outside pickle frames), a scalar; versions 1 and 3
  OUT_DIR/pd5    the same tensors with protocol-5 data files (numpy _frombuffer of BYTEARRAY8)
  OUT_DIR/pdst   the same with safetensors=True data files
  OUT_DIR/pdold  old-version metadata (paddle.distributed.checkpoint.metadata: no global
                 shape, flattening or replica ids; protocol 3) and an old paddle.save data
                 file (protocol 3) with a big param split into w@@.0, w@@.1 +
                 UnpackBigParamInfor@@
  OUT_DIR/pd2    a protocol-2 data file (array bytes as latin-1 text): ckptd refuses it
Each directory gets expected/<name>.npy (whole tensors; bf16 as uint16 bits) and a
layout.json of targets that differ from how the tensors were saved.
"""
import dataclasses
import json
import os
import pickle
import struct
import sys
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

NEW = "paddle.distributed.flex_checkpoint.dcp.metadata"
OLD = "paddle.distributed.checkpoint.metadata"


def _module(name):
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        n = ".".join(parts[:i])
        if n not in sys.modules:
            sys.modules[n] = types.ModuleType(n)
    return sys.modules[name]


def _place(cls, module, name):
    cls.__module__ = module
    cls.__qualname__ = name
    cls.__name__ = name
    setattr(_module(module), name, cls)
    return cls


# Paddle's records (field order as in Paddle's dataclasses).
@dataclass
class LocalTensorMetadata:
    global_offset: Tuple[int]
    local_shape: Tuple[int]
    dtype: str
    global_shape: Tuple[int] = None
    is_flattened: bool = False
    flattened_range: Tuple[int] = None


@dataclass(frozen=True)
class LocalTensorIndex:
    tensor_key: str
    global_offset: Tuple[int]
    is_flattened: bool = False
    flattened_range: Tuple[int] = None
    replica_id: int = 0
    local_shape: Tuple[int] = None


@dataclass
class Metadata:
    state_dict_metadata: Dict[str, List[LocalTensorMetadata]] = None
    storage_metadata: Dict[LocalTensorIndex, str] = None
    flat_mapping: Dict[str, Tuple[str]] = None
    model_type: str = None
    checkpoint_version: int = None
    erniebot_commit_id: str = None
    paddle_commit_id: str = None


_place(LocalTensorMetadata, NEW, "LocalTensorMetadata")
_place(LocalTensorIndex, NEW, "LocalTensorIndex")
_place(Metadata, NEW, "Metadata")


# The oldest records: fewer fields.
@dataclass
class OldLocalTensorMetadata:
    global_offset: Tuple[int]
    local_shape: Tuple[int]
    dtype: str


@dataclass(frozen=True)
class OldLocalTensorIndex:
    tensor_key: str
    global_offset: Tuple[int]


@dataclass
class OldMetadata:
    state_dict_metadata: Dict[str, List[OldLocalTensorMetadata]] = None
    storage_metadata: Dict[OldLocalTensorIndex, str] = None
    flat_mapping: Dict[str, Tuple[str]] = None


_place(OldLocalTensorMetadata, OLD, "LocalTensorMetadata")
_place(OldLocalTensorIndex, OLD, "LocalTensorIndex")
_place(OldMetadata, OLD, "Metadata")


def bf16_bits(x):
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def tensors():
    rng = np.random.default_rng(7)
    return {
        "linear.weight": ("float32", rng.standard_normal((6, 8)).astype(np.float32)),
        "linear.bias": ("float32", rng.standard_normal(8).astype(np.float32)),
        "emb": ("bfloat16", bf16_bits(rng.standard_normal((10, 4)))),
        "opt.moment1": ("float32", rng.standard_normal((4, 6)).astype(np.float32)),
        "big": ("float32", rng.standard_normal((300, 100)).astype(np.float32)),
        "step": ("int64", np.array(123456789012, dtype=np.int64)),
    }


def shards():
    """(key, rank, global_offset, local_shape, flattened_range or None, replica_id)."""
    return [
        ("linear.weight", 0, (0, 0), (3, 8), None, 0),
        ("linear.weight", 1, (3, 0), (3, 8), None, 0),
        ("linear.bias", 0, (0,), (8,), None, 0),
        ("linear.bias", 1, (0,), (8,), None, 1),  # save_replicas: a second copy
        ("emb", 0, (0, 0), (10, 2), None, 0),
        ("emb", 1, (0, 2), (10, 2), None, 0),
        ("opt.moment1", 0, (0, 0), (4, 6), (0, 10), 0),
        ("opt.moment1", 1, (0, 0), (4, 6), (10, 24), 0),
        ("big", 1, (0, 0), (300, 100), None, 0),
        ("step", 0, (), (), None, 0),
    ]


def local_value(full, off, shape, flat):
    sl = tuple(slice(o, o + s) for o, s in zip(off, shape))
    v = np.ascontiguousarray(full[sl])
    if flat:
        v = v.reshape(-1)[flat[0]:flat[1]].copy()
    return v


def write_safetensors(path, arrays):
    names = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16",
             np.dtype(np.int64): "I64"}
    header, blobs, off = {}, [], 0
    for k, a in arrays.items():
        b = a.tobytes()
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape),
                     "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_new(d, uid, data_protocol, safetensors=False):
    os.makedirs(d, exist_ok=True)
    vals = tensors()
    files = {0: {}, 1: {}}
    sdm, storage = {}, {}
    for key, rank, off, shape, flat, replica in shards():
        dtype, full = vals[key]
        fname = f"{rank}_{uid}.distcp"
        files[rank][key] = local_value(full, off, shape, flat)
        gshape = tuple(full.shape)
        if replica == 0:
            # One tuple object shared by both records: pickle memoises it (BINGET).
            sdm.setdefault(key, []).append(LocalTensorMetadata(
                off, shape, dtype, gshape, flat is not None, flat))
        storage[LocalTensorIndex(key, off, flat is not None, flat, replica, shape)] = fname
    for rank, arrays in files.items():
        path = os.path.join(d, f"{rank}_{uid}.distcp")
        if safetensors:
            write_safetensors(path, arrays)
            continue
        obj = dict(arrays)
        obj["StructuredToParameterName@@"] = {k: f"param_{i}" for i, k in enumerate(arrays)}
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=data_protocol)
    md = Metadata(sdm, storage, {k: ("model", k) for k in vals}, "llm", 1, "abc", "def")
    with open(os.path.join(d, f"{uid}.metadata"), "wb") as f:
        pickle.dump(md, f, protocol=4)
    return vals


def write_old(d):
    """Old metadata + an old paddle.save file (protocol 3) with a split big param."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(11)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    b = rng.standard_normal((4,)).astype(np.float32)
    sdm = {"w": [OldLocalTensorMetadata((0, 0), (6, 5), "float32")],
           "b": [OldLocalTensorMetadata((0,), (2,), "float32"),
                 OldLocalTensorMetadata((2,), (2,), "float32")]}
    storage = {OldLocalTensorIndex("w", (0, 0)): "0_0.distcp",
               OldLocalTensorIndex("b", (0,)): "0_0.distcp",
               OldLocalTensorIndex("b", (2,)): "1_0.distcp"}
    flat = w.reshape(-1)
    f0 = {"w@@.0": flat[:12].copy(), "w@@.1": flat[12:24].copy(), "w@@.2": flat[24:].copy(),
          "b": b[:2].copy(),
          "UnpackBigParamInfor@@": {"w": {"OriginShape": (6, 5),
                                          "slices": ["w@@.0", "w@@.1", "w@@.2"]}},
          "StructuredToParameterName@@": {"w": "linear_0.w_0", "b": "linear_0.b_0"}}
    with open(os.path.join(d, "0_0.distcp"), "wb") as f:
        pickle.dump(f0, f, protocol=3)
    with open(os.path.join(d, "1_0.distcp"), "wb") as f:
        pickle.dump({"b": b[2:].copy()}, f, protocol=3)
    with open(os.path.join(d, "0.metadata"), "wb") as f:
        pickle.dump(OldMetadata(sdm, storage, None), f, protocol=3)
    return {"w": ("float32", w), "b": ("float32", b)}


def write_protocol2(d):
    os.makedirs(d, exist_ok=True)
    a = np.arange(6, dtype=np.float32) + 0.5
    sdm = {"a": [LocalTensorMetadata((0,), (6,), "float32", (6,), False, None)]}
    storage = {LocalTensorIndex("a", (0,), False, None, 0, (6,)): "0_0.distcp"}
    with open(os.path.join(d, "0_0.distcp"), "wb") as f:
        pickle.dump({"a": a}, f, protocol=2)
    with open(os.path.join(d, "0.metadata"), "wb") as f:
        pickle.dump(Metadata(sdm, storage, None), f, protocol=4)


def save_expected(d, vals):
    e = os.path.join(d, "expected")
    os.makedirs(e, exist_ok=True)
    for k, (_, a) in vals.items():
        np.save(os.path.join(e, k + ".npy"), a)


def t(name, dtype, gshape, off, shape, src=None, flat=None):
    d = {"name": name, "dtype": dtype, "global_shape": list(gshape), "offset": list(off),
         "shape": list(shape), "source_dtype": src or dtype}
    if flat:
        d["flat_range"] = list(flat)
    return d


def write_layout(d, ranks):
    layout = {"world_size": len(ranks),
              "ranks": [{"rank": r, "tensors": ts} for r, ts in enumerate(ranks)]}
    with open(os.path.join(d, "layout.json"), "w") as f:
        json.dump(layout, f, indent=1)


NEW_LAYOUT = [
    [t("linear.weight", "F32", (6, 8), (0, 0), (6, 3)),
     t("linear.bias", "F32", (8,), (2,), (6,)),
     t("emb", "BF16", (10, 4), (0, 0), (4, 4)),
     t("opt.moment1", "F32", (4, 6), (0, 0), (2, 6)),
     t("big", "F32", (300, 100), (0, 0), (150, 100)),
     t("step", "I64", (), (), ())],
    [t("linear.weight", "F32", (6, 8), (0, 3), (6, 5)),
     t("emb", "F32", (10, 4), (4, 1), (6, 3), src="BF16"),
     t("opt.moment1", "F32", (4, 6), (0, 0), (4, 6), flat=(7, 19)),
     t("big", "F32", (300, 100), (150, 0), (150, 100), flat=(5, 14999)),
     t("model.missing", "F32", (2,), (0,), (2,))],
    [t("opt.moment1", "F32", (4, 6), (2, 0), (2, 6)),
     t("emb", "BF16", (10, 4), (0, 0), (10, 4), flat=(3, 37)),
     t("big", "F32", (300, 100), (17, 13), (200, 50))],
]

OLD_LAYOUT = [
    [t("w", "F32", (6, 5), (0, 1), (6, 3)), t("b", "F32", (4,), (1,), (2,))],
    [t("w", "F32", (6, 5), (2, 0), (3, 5), flat=(4, 13)), t("b", "F32", (4,), (0,), (4,))],
]


def main():
    out = sys.argv[1]
    for name, proto, st in (("pd4", 4, False), ("pd5", 5, False), ("pdst", 4, True)):
        d = os.path.join(out, name)
        if name == "pd4":
            write_new(d, 1, 4)  # an older version beside version 3
        vals = write_new(d, 3, proto, safetensors=st)
        save_expected(d, vals)
        write_layout(d, NEW_LAYOUT)
    d = os.path.join(out, "pdold")
    save_expected(d, write_old(d))
    write_layout(d, OLD_LAYOUT)
    write_protocol2(os.path.join(out, "pd2"))
    print("paddle_gen: wrote", out)


if __name__ == "__main__":
    main()
