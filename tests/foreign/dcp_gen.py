#!/usr/bin/python3
"""Writes real PyTorch DCP checkpoints with Debian's torch 1.13 (test helper).

    dcp_gen.py OUT_DIR

Spawns two gloo processes on 127.0.0.1 that save, with
torch.distributed._shard.checkpoint.save_state_dict:
  OUT_DIR/ckpt      FileSystemWriter default: one file per item (__{rank}_{n}.distcp)
  OUT_DIR/ckpt1     single_file_per_rank=True: items at offsets in one file per rank
Each holds ShardedTensors split on dim 0 over the 2 ranks (ChunkShardingSpec), plain
tensors (replicated: saved once) and a non-tensor item (a bytes item). Then, in this
process, it writes two checkpoints by hand with torch's own Metadata classes and
torch.save items:
  OUT_DIR/view      a tensor item that is a view into a larger storage (storage offset)
  OUT_DIR/strided   a transposed tensor item (non-contiguous strides; ckptd refuses it)
The full values of every tensor go to OUT_DIR/expected/<name>.npy (bf16 as uint16 bits).

Under Python 3.11, importing torch.distributed._shard fails on a dataclass field default
in sharded_tensor/metadata.py; torch13_dcp.py (next to this file) installs a meta-path
finder that rewrites that one line at import time (system files stay untouched).
"""
import io
import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch13_dcp  # noqa: E402,F401  (the import patch: before torch.distributed._shard)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.distributed._shard.checkpoint as dcp  # noqa: E402
from torch.distributed._shard.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata)
from torch.distributed._shard.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed._shard.sharded_tensor import (  # noqa: E402
    init_from_local_shards, Shard, ShardMetadata)
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402

WORLD = 2


def full_values():
    g = torch.Generator().manual_seed(1234)
    return {
        # dim 0 split over 2 ranks: 7 rows -> chunks of 4 and 3
        "layers.0.w": torch.randn(7, 5, generator=g),
        "layers.0.w_bf16": torch.randn(6, 4, 3, generator=g).to(torch.bfloat16),
        "emb.i64": torch.arange(8 * 3, dtype=torch.int64).reshape(8, 3) * 1000003,
        # plain tensors (every rank holds the same value; DCP writes them once)
        "bias": torch.randn(5, generator=g),
        "norm.f16": torch.randn(4, 6, generator=g).to(torch.float16),
        "step": torch.tensor(17, dtype=torch.int32),
    }


SHARDED = ["layers.0.w", "layers.0.w_bf16", "emb.i64"]


def chunk_rows(n, rank):
    per = (n + WORLD - 1) // WORLD
    start = min(per * rank, n)
    return start, min(per * (rank + 1), n) - start


def worker(rank, out_dir, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    vals = full_values()
    sd = {}
    for name, t in vals.items():
        if name not in SHARDED:
            sd[name] = t.clone()
            continue
        shards_md = []
        for r in range(WORLD):
            s, n = chunk_rows(t.shape[0], r)
            shards_md.append(ShardMetadata(shard_offsets=[s] + [0] * (t.dim() - 1),
                                           shard_sizes=[n] + list(t.shape[1:]),
                                           placement=f"rank:{r}/cpu"))
        s, n = chunk_rows(t.shape[0], rank)
        local = [Shard(tensor=t[s:s + n].clone(), metadata=shards_md[rank])]
        sd[name] = init_from_local_shards(local, list(t.shape))
    sd["extra_state"] = {"lr": 0.25, "note": "not a tensor"}  # a bytes item
    dcp.save_state_dict(sd, dcp.FileSystemWriter(os.path.join(out_dir, "ckpt")))
    dcp.save_state_dict(sd, dcp.FileSystemWriter(os.path.join(out_dir, "ckpt1"),
                                                 single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def save_expected(out_dir, name, t):
    d = os.path.join(out_dir, "expected")
    os.makedirs(d, exist_ok=True)
    if t.dtype == torch.bfloat16:
        a = t.contiguous().view(torch.int16).numpy().view(np.uint16)
    else:
        a = t.contiguous().numpy()
    np.save(os.path.join(d, name + ".npy"), a)


def hand_written(out_dir, name, item, dirname):
    """A one-tensor DCP checkpoint: torch's Metadata classes, item = torch.save(item)."""
    d = os.path.join(out_dir, dirname)
    os.makedirs(d, exist_ok=True)
    buf = io.BytesIO()
    buf.write(b"\0" * 13)  # the item does not start the file
    off = buf.tell()
    torch.save(item, buf)
    length = buf.tell() - off
    with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
        f.write(buf.getvalue())
    size = torch.Size(item.shape)
    md = Metadata(
        state_dict_metadata={name: TensorStorageMetadata(
            properties=TensorProperties(dtype=item.dtype),
            size=size,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * item.dim()), sizes=size)])},
        planner_data={name: (name,)},
        storage_data={MetadataIndex(name, [0] * item.dim(), 0):
                      _StorageInfo("__0_0.distcp", off, length)})
    import pickle
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def write_layout(out_dir):
    """3 target ranks, none matching the 2 saving ranks: columns, rows across the chunk
    boundary, flattened ranges, a cast, a scalar, and a key that is not a tensor."""
    def t(name, dtype, gshape, off, shape, src=None, flat=None):
        d = {"name": name, "dtype": dtype, "global_shape": gshape, "offset": off,
             "shape": shape, "source_dtype": src or dtype}
        if flat:
            d["flat_range"] = flat
        return d
    ranks = [
        [t("layers.0.w", "F32", [7, 5], [0, 0], [7, 2]),
         t("layers.0.w_bf16", "BF16", [6, 4, 3], [0, 0, 0], [2, 4, 3]),
         t("emb.i64", "I64", [8, 3], [0, 0], [8, 3], flat=[5, 17]),
         t("bias", "F32", [5], [1], [3]),
         t("extra_state", "F32", [1], [0], [1])],
        [t("layers.0.w", "F32", [7, 5], [0, 2], [7, 2]),
         t("layers.0.w_bf16", "F32", [6, 4, 3], [2, 1, 0], [2, 3, 3], src="BF16"),
         t("emb.i64", "I64", [8, 3], [0, 0], [8, 3]),
         t("norm.f16", "F32", [4, 6], [0, 0], [4, 6], src="F16")],
        [t("layers.0.w", "F32", [7, 5], [3, 4], [4, 1]),
         t("layers.0.w_bf16", "BF16", [6, 4, 3], [0, 0, 0], [6, 4, 3], flat=[7, 61]),
         t("emb.i64", "I64", [8, 3], [3, 0], [3, 3]),
         t("norm.f16", "F16", [4, 6], [1, 2], [2, 3]),
         t("step", "I32", [], [], [])],
    ]
    layout = {"world_size": 3, "ranks": [{"rank": r, "tensors": ts} for r, ts in enumerate(ranks)]}
    with open(os.path.join(out_dir, "layout.json"), "w") as f:
        json.dump(layout, f, indent=1)
    view = {"world_size": 2, "ranks": [
        {"rank": 0, "tensors": [t("view", "F32", [4, 5], [0, 0], [2, 5])]},
        {"rank": 1, "tensors": [t("view", "F32", [4, 5], [1, 1], [3, 4], flat=[2, 9])]}]}
    with open(os.path.join(out_dir, "layout-view.json"), "w") as f:
        json.dump(view, f, indent=1)


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(out_dir, port), nprocs=WORLD, join=True,
                       start_method="fork")
    for name, t in full_values().items():
        save_expected(out_dir, name, t)
    big = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    view = big[3:7]  # storage offset 15, contiguous rows
    assert view.storage_offset() == 15
    hand_written(out_dir, "view", view, "view")
    save_expected(out_dir, "view", view)
    hand_written(out_dir, "strided", torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
                 "strided")
    write_layout(out_dir)
    print("dcp_gen: wrote", out_dir)


if __name__ == "__main__":
    main()
