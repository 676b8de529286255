"""ckptd.dcp.DaemonStorageReader and DaemonStorageWriter under PyTorch DCP's own
load_state_dict / save_state_dict (Debian's torch 1.13), against a real ckptd daemon.

The checkpoints: real DCP checkpoints written by torch itself (dcp_gen.py: 2 gloo
ranks, ShardedTensors split on dim 0, plain tensors, a non-tensor item), a ckptd
checkpoint saved through the daemon and a HuggingFace safetensors file written here
by hand. Every value is compared exactly with the full tensors dcp_gen.py saved as
.npy (or the arrays written here), never with another ckptd load; destination
tensors start poisoned (NaN or a sentinel) so an element not written shows.
"""
import collections
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import torch
    import torch.multiprocessing as mp
    import torch13_dcp  # noqa: F401  (the Python 3.11 import patch for torch 1.13)
    import torch.distributed as dist
    import torch.distributed._shard.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import (Shard, ShardMetadata,
                                                         init_from_local_shards)
except ImportError:
    torch = None

import ckptd
import testlib

if torch is not None:
    from ckptd.dcp import DaemonStorageReader, DaemonStorageWriter

WORLD = 2
POISON_INT = -7777777


def expected(gen_dir, name):
    a = np.load(os.path.join(gen_dir, "expected", name + ".npy"))
    if a.dtype == np.uint16:  # bf16 bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def poisoned(shape, dtype):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, POISON_INT, dtype=dtype)


def same(a, b):
    """Bit-exact equality (bf16 and f16 through their bits; NaN never equals)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16)) and not a.isnan().any()
    return torch.equal(a, b)


def cols(n, rank):
    per = -(-n // WORLD)
    start = min(per * rank, n)
    return start, min(per * (rank + 1), n) - start


def sharded_last_dim(full, rank, dtype):
    """A torch ShardedTensor of `full`'s shape split on its last dim over WORLD ranks,
    this rank's shard poisoned."""
    d = full.dim() - 1
    mds = []
    for r in range(WORLD):
        s, n = cols(full.shape[d], r)
        mds.append(ShardMetadata(shard_offsets=[0] * d + [s],
                                 shard_sizes=list(full.shape[:d]) + [n], placement=f"rank:{r}/cpu"))
    local = poisoned(mds[rank].shard_sizes, dtype)
    return init_from_local_shards([Shard(tensor=local, metadata=mds[rank])], list(full.shape))


def load_worker(rank, gen_dir, path, sock, init_file, out_dir):
    """Rank `rank` of a 2-rank gloo job: DCP's load_state_dict with a DaemonStorageReader,
    split on the last dim (the checkpoint is split on dim 0), then checks every value."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    w, wb, emb = (expected(gen_dir, n) for n in ("layers.0.w", "layers.0.w_bf16", "emb.i64"))
    sd = {
        "layers.0.w": sharded_last_dim(w, rank, torch.float32),
        "layers.0.w_bf16": sharded_last_dim(wb, rank, torch.bfloat16),
        "emb.i64": poisoned(emb.shape, torch.int64),           # whole, on every rank
        "bias": poisoned((5,), torch.float32),
        "norm.f16": poisoned((4, 6), torch.float32),           # stored F16: ckptd casts
        "extra_state": {"lr": -1.0},                           # a bytes item
    }
    reader = DaemonStorageReader(path, socket=sock)
    dcp.load_state_dict(sd, storage_reader=reader)
    bad = []
    for name, full in (("layers.0.w", w), ("layers.0.w_bf16", wb)):
        shard = sd[name].local_shards()[0]
        off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        want = full[tuple(slice(o, o + s) for o, s in zip(off, size))]
        if not same(shard.tensor, want.contiguous()):
            bad.append(name)
    if not same(sd["emb.i64"], emb):
        bad.append("emb.i64")
    if not same(sd["bias"], expected(gen_dir, "bias")):
        bad.append("bias")
    if not same(sd["norm.f16"], expected(gen_dir, "norm.f16").float()):
        bad.append("norm.f16")
    if sd["extra_state"] != {"lr": 0.25, "note": "not a tensor"}:
        bad.append(f"extra_state={sd['extra_state']!r}")
    rep = reader.last_report
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"bad": bad, "job_id": rep.job_id, "rank": rank,
                   "bytes_read": rep.bytes_read, "transport": rep.transport,
                   "bytes_from_files": rep.bytes_from_files}, f)
    dist.destroy_process_group()


def two_shards_worker(rank, gen_dir, path, sock, init_file, out_dir):
    """Rank 0 holds two shards of layers.0.w (rows 0-1 and 2-3), rank 1 rows 4-6."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    rows = [(0, 2, 0), (2, 2, 0), (4, 3, 1)]
    mds = [ShardMetadata(shard_offsets=[s, 0], shard_sizes=[n, 5], placement=f"rank:{r}/cpu")
           for s, n, r in rows]
    local = [Shard(tensor=poisoned(m.shard_sizes, torch.float32), metadata=m)
             for m, (_, _, r) in zip(mds, rows) if r == rank]
    sd = {"layers.0.w": init_from_local_shards(local, [7, 5])}
    t0 = time.monotonic()
    try:
        dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(path, socket=sock))
        err = None
    except BaseException as e:  # noqa: B902 (torch 1.13's CheckpointException)
        err = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": err, "seconds": time.monotonic() - t0}, f)
    dist.destroy_process_group()


class Evil:
    """Unpickling it runs `touch MARKER` (what a malicious bytes entry can hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def reference():
    """What the writer tests save: {name: full tensor}, the same in every process."""
    g = torch.Generator().manual_seed(99)
    return {
        "w": torch.randn(9, 6, generator=g),                             # split on dim 0
        "w_bf16": torch.randn(4, 10, generator=g).to(torch.bfloat16),    # split on dim 1
        "emb": torch.arange(5 * 3, dtype=torch.int64).reshape(5, 3) * 999983,  # replicated
        "scale": torch.tensor(2.5, dtype=torch.float64),                 # 0-d, replicated
    }


def rows_of(n, rank):
    return cols(n, rank)


def save_worker(rank, path, sock, overwrite, bump, init_file, out_dir):
    """Rank `rank` of 2 saves reference() (+ bump) with DCP's save_state_dict through
    a DaemonStorageWriter: ShardedTensors, replicated plain tensors, a bytes item."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    ref = {k: (v + bump if v.is_floating_point() else v + int(bump)) for k, v in reference().items()}
    sd = {}
    for name, dim in (("w", 0), ("w_bf16", 1)):
        full = ref[name]
        mds = []
        for r in range(WORLD):
            s, n = cols(full.shape[dim], r)
            off, size = [0, 0], list(full.shape)
            off[dim], size[dim] = s, n
            mds.append(ShardMetadata(shard_offsets=off, shard_sizes=size, placement=f"rank:{r}/cpu"))
        md = mds[rank]
        local = full[tuple(slice(o, o + z) for o, z in zip(md.shard_offsets, md.shard_sizes))]
        sd[name] = init_from_local_shards([Shard(tensor=local.clone(), metadata=md)],
                                          list(full.shape))
    sd["emb"], sd["scale"] = ref["emb"].clone(), ref["scale"].clone()
    sd["extra"] = {"step": 1000 + int(bump), "names": ["a", "b"]}
    writer = DaemonStorageWriter(path, socket=sock, overwrite=overwrite)
    err = None
    try:
        dcp.save_state_dict(sd, storage_writer=writer)
    except BaseException as e:  # noqa: B902 (torch 1.13's CheckpointException)
        err = str(e)
    rep = writer.last_report
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": err, "items": [i.name for i in rep.items] if rep else None}, f)
    dist.destroy_process_group()


def write_safetensors(path, tensors):
    """A HuggingFace safetensors file, by hand: {name: numpy array}."""
    header, blobs, off = {}, [], 0
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    for k, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def spawn(worker, *args):
    """Runs worker(rank, *args, init_file, out_dir) in WORLD spawned processes; returns
    what each rank wrote to out_dir/rank{r}.json."""
    out = tempfile.mkdtemp(prefix="out-", dir=os.environ.get("TEST_TMPDIR"))
    mp.start_processes(worker, args=(*args, os.path.join(out, "pg-init"), out),
                       nprocs=WORLD, join=True, start_method="spawn")
    reps = []
    for r in range(WORLD):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            reps.append(json.load(f))
    return reps


@unittest.skipIf(torch is None, "torch is not installed [needs: torch]")
class DaemonStorageReaderTest(testlib.DaemonTestCase):
    @classmethod
    def prepare(cls, root):
        cls.gen = os.path.join(root, "gen")
        subprocess.run([sys.executable, os.path.join(HERE, "dcp_gen.py"), cls.gen], check=True,
                       stdout=subprocess.DEVNULL)

    def bytes_read(self):
        return int(ckptd.status(socket=self.sock)["bytes_read_total"])

    def spawn_load(self, path, worker=load_worker):
        return spawn(worker, self.gen, path, self.sock)

    def test_two_gloo_ranks_reshard_a_dcp_checkpoint_reading_each_byte_once(self):
        path = os.path.join(self.root, "ckpt-cold")  # a copy no other case loaded
        shutil.copytree(os.path.join(self.gen, "ckpt"), path)
        info = ckptd.inspect(path, socket=self.sock)
        self.assertEqual(info.format, "pytorch-dcp")
        before = self.bytes_read()
        reps = self.spawn_load(path)
        for rep in reps:
            self.assertEqual(rep["bad"], [], rep)
        self.assertEqual(reps[0]["job_id"], reps[1]["job_id"])  # one ckptd job
        self.assertTrue(reps[0]["job_id"].startswith("dcp-"), reps[0]["job_id"])
        # Both ranks together need every byte of the tensors they load (all but
        # "step"): the node read each once, the daemon or (file views) the rank
        # that needed it.
        cold = self.bytes_read() - before
        by_ranks = sum(rep["bytes_from_files"] for rep in reps)
        self.assertEqual(cold + by_ranks,
                         sum(t.bytes for n, t in info.tensors.items() if n != "step"))
        # A restart: served from the daemon's cache, nothing read from storage.
        reps = self.spawn_load(path)
        for rep in reps:
            self.assertEqual(rep["bad"], [], rep)
            self.assertEqual(rep["bytes_read"], 0, rep)
        self.assertEqual(self.bytes_read() - before, cold)

    def test_two_local_shards_of_one_tensor_fail_every_rank_before_the_daemon(self):
        reps = self.spawn_load(os.path.join(self.gen, "ckpt"), two_shards_worker)
        for rep in reps:  # rank 0's refusal reaches rank 1 through DCP's plan step
            self.assertIn("'layers.0.w': this rank holds more than one shard", rep["error"] or "")
            self.assertIn("[INVALID_ARGUMENT]", rep["error"])
            self.assertLess(rep["seconds"], 30)  # nobody waited at the daemon's barrier

    def test_no_dist_loads_every_format_ckptd_reads(self):
        # DCP, one file per rank (items at offsets).
        sd = {"layers.0.w": poisoned((7, 5), torch.float32),
              "emb.i64": poisoned((8, 3), torch.int64)}
        dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(
            os.path.join(self.gen, "ckpt1"), socket=self.sock), no_dist=True)
        self.assertTrue(same(sd["layers.0.w"], expected(self.gen, "layers.0.w")))
        self.assertTrue(same(sd["emb.i64"], expected(self.gen, "emb.i64")))
        # ckptd's own format, saved through the daemon.
        rng = np.random.default_rng(7)
        a = rng.standard_normal((6, 10)).astype(np.float32)
        native = os.path.join(self.root, "native")
        ckptd.save_state_dict({"w": a}, native, rank=0, world_size=1, socket=self.sock)
        sd = {"w": poisoned((6, 10), torch.float32)}
        reader = DaemonStorageReader(native, socket=self.sock)
        dcp.load_state_dict(sd, storage_reader=reader, no_dist=True)
        self.assertTrue(same(sd["w"], torch.from_numpy(a)))
        self.assertEqual(reader.last_report.missing_keys, [])
        # HuggingFace safetensors.
        hf = os.path.join(self.root, "hf")
        os.makedirs(hf)
        b = np.arange(12, dtype=np.int64).reshape(3, 4) * 1000003
        write_safetensors(os.path.join(hf, "model.safetensors"), {"emb": b, "w": a})
        sd = {"emb": poisoned((3, 4), torch.int64), "w": poisoned((6, 10), torch.float64)}
        dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(hf, socket=self.sock),
                            no_dist=True)
        self.assertTrue(same(sd["emb"], torch.from_numpy(b)))
        self.assertTrue(same(sd["w"], torch.from_numpy(a).double()))  # F32 -> F64 cast

    def test_a_bytes_entry_that_would_run_code_is_refused(self):
        path = os.path.join(self.root, "evil-bytes")
        marker = os.path.join(self.root, "ran")
        sd = {"w": torch.arange(6, dtype=torch.float32), "evil": Evil(marker),
              "counts": collections.Counter("aab")}
        dcp.save_state_dict(sd, dcp.FileSystemWriter(path), no_dist=True)
        self.assertFalse(os.path.exists(marker))
        load = {"w": poisoned((6,), torch.float32), "evil": None}
        with self.assertRaises(BaseException) as cm:
            dcp.load_state_dict(load, storage_reader=DaemonStorageReader(path, socket=self.sock),
                                no_dist=True)
        self.assertIn("bytes entry 'evil' holds objects other than plain values and tensors",
                      str(cm.exception))
        self.assertIn("allow_pickle=True", str(cm.exception))
        self.assertFalse(os.path.exists(marker))
        # allow_pickle=True trusts the checkpoint, as DCP's own reader does (shown with a
        # harmless object weights_only refuses).
        load = {"w": poisoned((6,), torch.float32), "counts": None}
        dcp.load_state_dict(load, storage_reader=DaemonStorageReader(
            path, socket=self.sock, allow_pickle=True), no_dist=True)
        self.assertEqual(load["counts"], collections.Counter("aab"))
        self.assertTrue(same(load["w"], torch.arange(6, dtype=torch.float32)))

    def test_entries_outside_the_checkpoint_directory_are_refused(self):
        from ckptd.dcp import _read_plain_file
        d = os.path.join(self.gen, "ckpt")
        for name in ("../gen/ckpt/.metadata", "/etc/passwd", "..", ""):
            with self.assertRaises(ckptd.CkptdError, msg=name) as cm:
                _read_plain_file(d, name, 0, 1, "bytes entry 'x'", 1 << 20)
            self.assertIn("is not a file name in the checkpoint directory", cm.exception.message)
        os.symlink(".metadata", os.path.join(self.root, "link"))
        with self.assertRaises(ckptd.CkptdError):  # no symlinks
            _read_plain_file(self.root, "link", 0, 1, "x", 1 << 20)
        os.mkfifo(os.path.join(self.root, "fifo"))
        with self.assertRaises(ckptd.CkptdError) as cm:  # no FIFO (nothing hangs)
            _read_plain_file(self.root, "fifo", 0, 1, "x", 1 << 20)
        self.assertIn("not a regular file", cm.exception.message)
        with self.assertRaises(ckptd.CkptdError) as cm:  # a range past the end
            _read_plain_file(d, ".metadata", 0, 1 << 40, "x", 1 << 50)
        self.assertIn("outside the file", cm.exception.message)

    def test_the_daemon_reads_only_the_checkpoints_own_files(self):
        """ReadCheckpointFile (what DaemonStorageReader uses where it cannot open the
        files: object storage): the metadata file and the data files, whole or in
        ranges across its 2 MiB pieces, byte-exact; nothing else in the directory,
        nothing past the end, no file that no longer holds what the metadata says."""
        path = os.path.join(self.root, "ckpt-files")
        shutil.copytree(os.path.join(self.gen, "ckpt"), path)
        for extra in ("notes.txt", "__9_0.distcp"):  # files its metadata does not name
            with open(os.path.join(path, extra), "w") as f:
                f.write("not the checkpoint's")
        # A data file of 5 MiB: read in three pieces.
        native = os.path.join(self.root, "native-files")
        ckptd.save_state_dict({"w": np.arange(5 << 18, dtype=np.float32)}, native, rank=0,
                              world_size=1, socket=self.sock)
        big = sorted(ckptd.inspect(native, socket=self.sock).files)[0]
        with open(os.path.join(native, big), "rb") as f:
            want = f.read()
        self.assertGreater(len(want), 5 << 20)
        with ckptd.Client(self.sock) as c:
            self.assertEqual(c.read_checkpoint_file(native, big), want)
            self.assertEqual(c.read_checkpoint_file(native, big, (2 << 20) - 7, 3 << 20),
                             want[(2 << 20) - 7:(5 << 20) - 7])
        info = ckptd.inspect(path, socket=self.sock)
        data_file = sorted(info.files)[0]
        with ckptd.Client(self.sock) as c:
            for name in (".metadata", data_file):
                with open(os.path.join(path, name), "rb") as f:
                    want = f.read()
                self.assertEqual(c.read_checkpoint_file(path, name), want, name)
                self.assertEqual(c.read_checkpoint_file(path, name, 3, 5), want[3:8], name)
            for name, code, says in (
                    ("notes.txt", "NOT_FOUND", "not a file of the checkpoint"),
                    ("__9_0.distcp", "NOT_FOUND", "not a file of the checkpoint"),
                    ("../ckpt-files/.metadata", "NOT_FOUND", "not a file of the checkpoint")):
                with self.assertRaises(ckptd.CkptdError, msg=name) as cm:
                    c.read_checkpoint_file(path, name)
                self.assertEqual(cm.exception.code, code, name)
                self.assertIn(says, cm.exception.message)
            size = os.path.getsize(os.path.join(path, data_file))
            with self.assertRaises(ckptd.CkptdError) as cm:
                c.read_checkpoint_file(path, data_file, size + 1, 1)
            self.assertEqual(cm.exception.code, "OUT_OF_RANGE")
            with self.assertRaises(ckptd.CkptdError) as cm:
                c.read_checkpoint_file(path, data_file, 0, size + 1)
            self.assertEqual(cm.exception.code, "OUT_OF_RANGE")
            with self.assertRaises(ckptd.CkptdError) as cm:
                c.read_checkpoint_file(path, ".metadata", limit=10)
            self.assertEqual(cm.exception.code, "RESOURCE_EXHAUSTED")
            for n in (0, (2 << 20) + 1):  # the RPC itself: 1 byte to 2 MiB a call
                req = c._pb2.ReadCheckpointFileRequest(path=path, file=".metadata", length=n)
                with self.assertRaises(ckptd.CkptdError) as cm:
                    c._call("ReadCheckpointFile", req, 10)
                self.assertEqual(cm.exception.code, "INVALID_ARGUMENT", n)
            # A data file rewritten after its metadata was read: opened again, and
            # its header, broken now, fails the read naming it.
            with open(os.path.join(path, data_file), "r+b") as f:
                f.write(b"\x01")
            with self.assertRaises(ckptd.CkptdError) as cm:
                c.read_checkpoint_file(path, data_file)
            self.assertEqual(cm.exception.code, "DATA_LOSS", cm.exception.message)
            self.assertIn(data_file, cm.exception.message)

    def test_a_tensor_of_another_shape_fails_naming_it(self):
        sd = {"bias": poisoned((6,), torch.float32)}  # the checkpoint's bias is [5]
        with self.assertRaises(BaseException) as cm:
            dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(
                os.path.join(self.gen, "ckpt"), socket=self.sock), no_dist=True)
        self.assertIn("'bias': this rank's tensor of shape (6,)", str(cm.exception))
        self.assertIn("does not fit the checkpoint's (5,)", str(cm.exception))
        self.assertTrue(torch.isnan(sd["bias"]).all())  # nothing was loaded

    def test_non_contiguous_destination_is_filled_through_a_copy(self):
        base = poisoned((5, 7), torch.float32)
        sd = {"layers.0.w": base.t()}  # [7, 5], strides (1, 7)
        dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(
            os.path.join(self.gen, "ckpt"), socket=self.sock), no_dist=True)
        self.assertTrue(same(base.t().contiguous(), expected(self.gen, "layers.0.w")))

    def test_a_tensor_the_checkpoint_lacks_fails_naming_it(self):
        sd = {"bias": poisoned((5,), torch.float32), "nope": torch.zeros(3)}
        # DCP's planner finds it (torch 1.13's CheckpointException is a BaseException).
        with self.assertRaises(BaseException) as cm:
            dcp.load_state_dict(sd, storage_reader=DaemonStorageReader(
                os.path.join(self.gen, "ckpt"), socket=self.sock), no_dist=True)
        self.assertIn("KeyError: 'nope'", str(cm.exception))
        self.assertTrue(torch.isnan(sd["bias"]).all())  # nothing was loaded

    def test_metadata_pickle_with_code_is_refused_not_run(self):
        bad = os.path.join(self.root, "evil")
        os.makedirs(bad)
        for f in os.listdir(os.path.join(self.gen, "ckpt")):
            if f != ".metadata":
                shutil.copy(os.path.join(self.gen, "ckpt", f), os.path.join(bad, f))
        marker = os.path.join(self.root, "pwned")
        # A pickle that would call os.system when unpickled by plain pickle.load.
        payload = (b"\x80\x02cos\nsystem\nq\x00X" + struct.pack("<I", len("touch " + marker))
                   + ("touch " + marker).encode() + b"\x85R.")
        # ckptd itself reads the real metadata (its safe reader refuses the pickle),
        # so write the evil one where only the client's bytes-entry pass looks.
        with open(os.path.join(self.gen, "ckpt", ".metadata"), "rb") as f:
            good = f.read()
        with open(os.path.join(bad, ".metadata"), "wb") as f:
            f.write(payload)
        reader = DaemonStorageReader(bad, socket=self.sock)
        with self.assertRaises(ckptd.CkptdError):
            reader.read_metadata()
        self.assertFalse(os.path.exists(marker))
        # And the client's own unpickler, fed the same bytes directly.
        from ckptd.dcp import _MetadataUnpickler
        import io
        with self.assertRaises(ckptd.CkptdError) as cm:
            _MetadataUnpickler(io.BytesIO(payload)).load()
        self.assertIn("os.system", str(cm.exception))
        self.assertFalse(os.path.exists(marker))
        # Protocol 4 follows dotted names from an allowed module to anything: refused.
        def global4(module, name):
            m, n = module.encode(), name.encode()
            return b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93."
        for module, name in (("torch.distributed._shard.checkpoint.filesystem",
                              "torch.cuda._memory_viz.subprocess.Popen"),
                             ("torch.distributed._shard.checkpoint.metadata", "torch.Tensor"),
                             ("torch.distributed._shard.checkpoint.metadata", "Metadata.__init__")):
            with self.assertRaises(ckptd.CkptdError, msg=name) as cm:
                _MetadataUnpickler(io.BytesIO(global4(module, name))).load()
            self.assertIn(f"{module}.{name}", str(cm.exception))
        # A torch class outside DCP's metadata modules is refused too.
        st = b"\x80\x02ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n."
        with self.assertRaises(ckptd.CkptdError) as cm:
            _MetadataUnpickler(io.BytesIO(st)).load()
        self.assertIn("torch.distributed._shard.sharded_tensor.api.ShardedTensor",
                      str(cm.exception))
        self.assertIsNotNone(_MetadataUnpickler(io.BytesIO(good)).load())


@unittest.skipIf(torch is None, "torch is not installed [needs: torch]")
class DaemonStorageWriterTest(testlib.DaemonTestCase):
    def save(self, path, overwrite=False, bump=0.0):
        return spawn(save_worker, path, self.sock, overwrite, bump)

    def load_with(self, path, reader):
        """Loads every saved value whole (no_dist) with `reader`; returns the state dict."""
        sd = {"w": poisoned((9, 6), torch.float32), "w_bf16": poisoned((4, 10), torch.bfloat16),
              "emb": poisoned((5, 3), torch.int64), "scale": poisoned((), torch.float64),
              "extra": None}
        dcp.load_state_dict(sd, storage_reader=reader, no_dist=True)
        return sd

    def check(self, sd, bump=0.0):
        for k, v in reference().items():
            want = v + bump if v.is_floating_point() else v + int(bump)
            self.assertTrue(same(sd[k], want), k)
        self.assertEqual(sd["extra"], {"step": 1000 + int(bump), "names": ["a", "b"]})

    def test_two_ranks_save_and_both_dcp_and_ckptd_read_it_back(self):
        path = os.path.join(self.root, "saved")
        reps = self.save(path)
        for rep in reps:
            self.assertIsNone(rep["error"], rep)
        # Each rank wrote its own shard; DCP's planner put the replicated values
        # and the bytes item on one rank only.
        self.assertEqual(sorted(reps[0]["items"] + reps[1]["items"]),
                         sorted(["w", "w", "w_bf16", "w_bf16", "emb", "scale", "extra"]))
        self.assertEqual(sorted(f for f in os.listdir(path) if not f.startswith(".")),
                         ["__0_0.distcp", "__1_0.distcp"])
        # PyTorch's own reader (torch.load on every item).
        self.check(self.load_with(path, dcp.FileSystemReader(path)))
        # ckptd: inspect, and DaemonStorageReader.
        info = ckptd.inspect(path, socket=self.sock)
        self.assertEqual(info.format, "pytorch-dcp")
        self.assertEqual(sorted(info.tensors), ["emb", "scale", "w", "w_bf16"])
        self.assertEqual(info.tensors["w_bf16"].dtype_name, "BF16")
        self.assertIs(info.tensors["w_bf16"].dtype, torch.bfloat16)
        self.check(self.load_with(path, DaemonStorageReader(path, socket=self.sock)))
        # Saving again without overwrite: ALREADY_EXISTS on every rank, files untouched.
        reps = self.save(path, bump=1.0)
        for rep in reps:
            self.assertIn("already holds a PyTorch DCP checkpoint", rep["error"] or "")
        self.check(self.load_with(path, dcp.FileSystemReader(path)))
        # With overwrite: the new values, for both readers.
        for rep in self.save(path, overwrite=True, bump=1.0):
            self.assertIsNone(rep["error"], rep)
        self.check(self.load_with(path, dcp.FileSystemReader(path)), bump=1.0)
        self.check(self.load_with(path, DaemonStorageReader(path, socket=self.sock)), bump=1.0)

    def test_commit_refuses_metadata_that_does_not_match_the_files(self):
        path = os.path.join(self.root, "mismatch")
        for rep in self.save(path):
            self.assertIsNone(rep["error"], rep)
        md = dcp.FileSystemReader(path).read_metadata()
        os.unlink(os.path.join(path, ".metadata"))  # as before the commit
        # Every item shifted by one byte: no longer a torch.save archive.
        for k, v in list(md.storage_data.items()):
            md.storage_data[k] = type(v)(v.relative_path, v.offset + 1, v.length)
        import pickle
        blob = pickle.dumps(md)
        pending = os.path.join(path, ".ckptd-dcp-pending")
        self.assertFalse(os.path.exists(pending))  # the commit removed it
        # No save wrote data files since the last commit: refused.
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.commit_dcp_metadata(path, blob, "job-a", socket=self.sock)
        self.assertEqual(cm.exception.code, "FAILED_PRECONDITION")
        self.assertIn("no pytorch-dcp save wrote data files there", cm.exception.message)
        # Job a's files were replaced by job b's (as when two saves race): a's commit
        # is refused, naming both.
        with open(pending, "w") as f:
            f.write("job-b")
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.commit_dcp_metadata(path, blob, "job-a", socket=self.sock)
        self.assertEqual(cm.exception.code, "FAILED_PRECONDITION")
        self.assertIn("last written by save job 'job-b', not by 'job-a'", cm.exception.message)
        # The right job, but metadata that does not match the files.
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.commit_dcp_metadata(path, blob, "job-b", socket=self.sock)
        self.assertIn("does not describe the files there", cm.exception.message)
        self.assertFalse(os.path.exists(os.path.join(path, ".metadata")))
        # Not a pickle at all.
        with self.assertRaises(ckptd.CkptdError):
            ckptd.commit_dcp_metadata(path, b"{}", "job-b", socket=self.sock)
        self.assertFalse(os.path.exists(os.path.join(path, ".metadata")))
        self.assertTrue(os.path.exists(pending))  # still job b's to commit


if __name__ == "__main__":
    testlib.main("dcp_storage_test")
