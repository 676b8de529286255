"""The Python client with numpy only (no torch): a real ckptd daemon, the
bundled example checkpoint, values checked with an independent safetensors
reader."""
import json
import mmap
import os
import shutil
import socket as pysocket
import subprocess
import sys
import time
import unittest

import numpy as np

import ckptd
from ckptd import client as ckclient
import testlib

EXAMPLES = testlib.runfile("examples")


def split(global_shape, dim, world, r):
    """(offset, shape) of rank r when dim `dim` is split over `world` ranks."""
    off, shp = [0] * len(global_shape), list(global_shape)
    chunk = -(-global_shape[dim] // world)
    off[dim] = min(r * chunk, global_shape[dim])
    shp[dim] = max(0, min(chunk, global_shape[dim] - off[dim]))
    return tuple(off), tuple(shp)


run_ranks = testlib.run_ranks


def _shmem_pmd_kb(addr):
    """kB of huge pages (ShmemPmdMapped) of this process's mapping holding addr."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("ShmemPmdMapped:"):
                return int(line.split()[1])
    return -1


class NumpyClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.hf = os.path.join(cls.root, "tiny-model")
        shutil.copytree(os.path.join(EXAMPLES, "tiny-model"), cls.hf)
        cls.ref = testlib.read_safetensors(os.path.join(cls.hf, "model.safetensors"))
        cls.tp2 = os.path.join(cls.root, "tp2")
        subprocess.run([testlib.CKPTCTL, "shard", cls.hf, "--layout",
                        os.path.join(EXAMPLES, "layout-tp2.json"), "--out", cls.tp2,
                        "--unique_id", "5"], check=True, stdout=subprocess.DEVNULL)
        cls.daemon = testlib.Daemon(cls.root)
        cls.sock = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc}"

    def full(self, name):
        """The reference value: float32 for BF16 tensors."""
        dt, a = self.ref[name]
        return testlib.bf16_to_f32(a) if dt == "BF16" else a

    # --- loads ---

    def test_load_whole_hf_checkpoint(self):
        sd = {}
        for name, (dt, a) in self.ref.items():
            if dt == "BF16":  # numpy has no bf16: its bits in uint16, declared BF16
                sd[name] = ckptd.ShardedTensor(np.zeros(a.shape, np.uint16), a.shape,
                                               dtype="BF16")
            else:
                sd[name] = np.zeros(a.shape, a.dtype)
        r = ckptd.load_state_dict(sd, self.hf, socket=self.sock)
        self.assertEqual(r.missing_keys, [])
        self.assertEqual(r.unexpected_keys, [])
        self.assertEqual(r.format, "huggingface-safetensors")
        # Same uid as the daemon: "auto" lets the daemon write the arrays (or,
        # for bytes its cache holds, copies them here from its cache).
        self.assertIn(r.transport, ("cache_view", "process_memory"))
        self.assertEqual(r.zero_copy, r.transport == "process_memory")
        total = sum(a.nbytes for _, a in self.ref.values())
        self.assertEqual(r.bytes_delivered, total)
        for name, (dt, a) in self.ref.items():
            got = sd[name].local if dt == "BF16" else sd[name]
            np.testing.assert_array_equal(got, a, err_msg=name)
        for k in ("list_s", "plan_s", "read_s", "copy_s", "wait_s", "client_rpc_s", "total_s"):
            self.assertIn(k, r.timings)

    def test_aoa_fuse_and_transpose(self):
        p = "model.layers.0.self_attn."
        q, k, v = (self.full(p + n + "_proj.weight") for n in ("q", "k", "v"))
        up = self.full("model.layers.0.mlp.up_proj.weight")
        sd = {"qkv": ckptd.ShardedTensor(np.zeros((96, 64), np.float32), (192, 64), (96, 0)),
              "up_t": np.zeros(up.T.shape, np.float32)}
        aoa = [f"{p}q_proj.weight, {p}k_proj.weight, {p}v_proj.weight -> qkv, axis=0",
               "model.layers.0.mlp.up_proj.weight^T -> up_t"]
        r = ckptd.load_state_dict(sd, self.hf, socket=self.sock, aoa=aoa)
        self.assertEqual(r.missing_keys, [])
        np.testing.assert_array_equal(sd["qkv"].local, np.concatenate([q, k, v])[96:])
        np.testing.assert_array_equal(sd["up_t"], up.T)

    def test_bf16_cast_to_float32_and_f32_to_float64(self):
        sd = {"lm_head.weight": np.zeros((256, 64), np.float32),
              "model.norm.weight": np.zeros(64, np.float64),
              "step": np.zeros((), np.int64)}
        r = ckptd.load_state_dict(sd, self.hf, socket=self.sock)
        self.assertEqual(r.missing_keys, [])
        np.testing.assert_array_equal(sd["lm_head.weight"], self.full("lm_head.weight"))
        np.testing.assert_array_equal(sd["model.norm.weight"],
                                      self.full("model.norm.weight").astype(np.float64))
        self.assertEqual(int(sd["step"]), int(self.ref["step"][1]))

    def test_resharded_load_4_ranks(self):
        """tp2 checkpoint (uid 5) -> 4 ranks: dim 1 splits, a flat range, replicas."""
        names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight"]

        def rank(r):
            sd = {"model": {"norm": {"weight": np.zeros(64, np.float32)}}}
            for n in names:
                g = self.ref[n][1].shape
                off, shp = split(g, 1, 4, r)
                sd[n] = ckptd.ShardedTensor(np.zeros(shp, np.float32), g, off)
            g = self.ref["model.layers.1.mlp.down_proj.weight"][1].shape
            n = g[0] * g[1]
            fr = (r * n // 4, (r + 1) * n // 4)
            sd["model.layers.1.mlp.down_proj.weight"] = ckptd.ShardedTensor(
                np.zeros(fr[1] - fr[0], np.float32), g, flat_range=fr)
            rep = ckptd.load_state_dict(sd, self.tp2, rank=r, world_size=4, job_id="reshard4",
                                        socket=self.sock)
            return sd, rep

        out = run_ranks(4, rank)
        for r, (sd, rep) in enumerate(out):
            self.assertEqual(rep.missing_keys, [])
            self.assertEqual(rep.unique_id, 5)
            self.assertEqual(rep.format, "ckptd")
            self.assertGreater(rep.checksums_verified, 0)
            np.testing.assert_array_equal(sd["model"]["norm"]["weight"],
                                          self.full("model.norm.weight"))
            for n in names:
                off, shp = split(self.ref[n][1].shape, 1, 4, r)
                want = self.full(n)[:, off[1]:off[1] + shp[1]]
                np.testing.assert_array_equal(sd[n].local, want, err_msg=f"{n} rank {r}")
            flat = self.full("model.layers.1.mlp.down_proj.weight").reshape(-1)
            fr = sd["model.layers.1.mlp.down_proj.weight"].flat_range
            np.testing.assert_array_equal(sd["model.layers.1.mlp.down_proj.weight"].local,
                                          flat[fr[0]:fr[1]])
        # Each needed byte range was read once for the whole job.
        self.assertEqual(len({rep.bytes_read for _, rep in out}), 1)

    def test_nested_missing_and_skipped_keys(self):
        sentinel = np.full(8, 7.0, np.float32)
        sd = {"model": {"norm": {"weight": np.zeros(64, np.float32)},
                        "extra": {"weight": sentinel}},
              "epoch": 3, "param_groups": [{"lr": 0.1}]}
        r = ckptd.load_state_dict(sd, self.hf, socket=self.sock, strict=False)
        self.assertEqual(r.missing_keys, ["model.extra.weight"])
        self.assertEqual(sorted(r.skipped_keys), ["epoch", "param_groups"])
        self.assertIn("lm_head.weight", r.unexpected_keys)
        np.testing.assert_array_equal(sentinel, np.full(8, 7.0, np.float32))  # untouched
        np.testing.assert_array_equal(sd["model"]["norm"]["weight"],
                                      self.full("model.norm.weight"))

    def test_strict_missing_key_fails(self):
        sd = {"model.norm.weight": np.zeros(64, np.float32), "nope": np.zeros(2, np.float32)}
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict(sd, self.hf, socket=self.sock, strict=True)
        self.assertEqual(cm.exception.code, "NOT_FOUND")
        self.assertIn("nope", cm.exception.message)

    def test_written_as_for_torch(self):
        """issue 37: a script written as for torch works as its author expects:
        loads are strict by default (a typo'd prefix raises, naming the first
        keys and how many), errors are the builtins a script catches
        (FileNotFoundError, ValueError, PermissionError), and pickle as
        themselves."""
        import pickle
        typo = {f"modle.layers.{i}.weight": np.zeros(4, np.float32) for i in range(12)}
        with self.assertRaises(FileNotFoundError) as cm:
            ckptd.load_state_dict(typo, self.hf, socket=self.sock)
        err = cm.exception
        self.assertIsInstance(err, ckptd.NotFoundError)
        self.assertIsInstance(err, ckptd.CkptdError)
        self.assertEqual(err.code, "NOT_FOUND")
        self.assertIn("modle.layers.0.weight", err.message)
        self.assertIn("(12 missing)", err.message)
        back = pickle.loads(pickle.dumps(err))
        self.assertIs(type(back), ckptd.NotFoundError)
        self.assertEqual((back.code, back.message), (err.code, err.message))
        # No checkpoint there.
        with self.assertRaises(FileNotFoundError):
            ckptd.load_state_dict({"x": np.zeros(1, np.float32)},
                                  os.path.join(self.root, "no-such-checkpoint"), socket=self.sock)
        # A box outside the tensor: a bad argument.
        with self.assertRaises(ValueError) as cm:
            ckptd.load_state_dict(
                {"model.norm.weight": ckptd.ShardedTensor(np.zeros(8, np.float32), (64,), (60,))},
                self.hf, socket=self.sock)
        self.assertIsInstance(cm.exception, ckptd.InvalidArgumentError)
        # Outside the daemon's roots.
        with self.assertRaises(PermissionError):
            ckptd.load_state_dict({"x": np.zeros(1, np.float32)}, "/etc", socket=self.sock)
        # Still a CkptdError with its code, for code written before.
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict(typo, self.hf, socket=self.sock)
        self.assertEqual(cm.exception.code, "NOT_FOUND")

    def test_zero_copy_arena(self):
        arena = ckptd.SharedArena(1 << 20)
        w = arena.empty((128, 64), np.float32)
        b = arena.empty(64, np.float32)
        sd = {"model.layers.0.mlp.up_proj.weight": w, "model.layers.0.input_layernorm.weight": b}
        r = ckptd.load_state_dict(sd, self.tp2, socket=self.sock)
        self.assertTrue(r.zero_copy)
        np.testing.assert_array_equal(w, self.full("model.layers.0.mlp.up_proj.weight"))
        np.testing.assert_array_equal(b, self.full("model.layers.0.input_layernorm.weight"))
        self.assertEqual(r.transport, "shm")
        # A tensor outside the arena: the daemon writes them all in place
        # (process_memory; cache_view: copied here from its cache when it
        # holds them), or stages them in a segment (shm: one copy more).
        for transport in ("auto", "shm"):
            sd["model.norm.weight"] = np.zeros(64, np.float32)
            w[:] = 0
            r = ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport=transport)
            self.assertIn(r.transport, ("cache_view", "process_memory") if transport == "auto"
                          else ("shm",))
            self.assertEqual(r.zero_copy, r.transport == "process_memory")
            np.testing.assert_array_equal(w, self.full("model.layers.0.mlp.up_proj.weight"))
            np.testing.assert_array_equal(sd["model.norm.weight"], self.full("model.norm.weight"))

    def test_arena_borrowed_from_the_daemon(self):
        arena = ckptd.SharedArena(5000, daemon=self.sock)
        self.assertIsNotNone(arena.daemon_token)
        self.assertEqual(arena.size, 2 << 20)  # the daemon rounds up to 2 MiB
        w = arena.empty((128, 64), np.float32)
        w[:] = -1
        for _ in range(2):  # one lease, any number of loads
            r = ckptd.load_state_dict({"model.layers.0.mlp.up_proj.weight": w}, self.tp2,
                                      socket=self.sock)
            self.assertTrue(r.zero_copy)
            np.testing.assert_array_equal(w, self.full("model.layers.0.mlp.up_proj.weight"))
            w[:] = -1
        del w
        arena.close()
        # Given back: the next client asking for that size gets it again.
        again = ckptd.SharedArena(2 << 20, daemon=self.sock)
        st = ckptd.status(socket=self.sock)
        self.assertGreaterEqual(int(st.get("arena_reused", 0)), 1)
        again.close()
        # Tensors outside any arena stage through a borrowed segment as well.
        sd = {"model.norm.weight": np.zeros(64, np.float32)}
        ckptd.load_state_dict(sd, self.tp2, socket=self.sock)
        np.testing.assert_array_equal(sd["model.norm.weight"], self.full("model.norm.weight"))

    def test_memfds_are_sealed_and_unsealed_ones_refused(self):
        import fcntl
        from ckptd import _shm
        fd_sock = _shm.fd_socket_path(self.sock)
        # The client's own segments: sealed against shrinking and growing.
        arena = ckptd.SharedArena(1 << 20)
        seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
        self.assertEqual(seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW),
                         fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with self.assertRaises(PermissionError):
            os.ftruncate(arena.fd, 0)
        token = _shm.send_fd(fd_sock, arena.fd)
        self.assertRegex(token, r"^[0-9a-f]{32}$")
        arena.close()
        # The daemon's arenas: sealed before the client gets them.
        lent = ckptd.SharedArena(4096, daemon=self.sock)
        seals = fcntl.fcntl(lent.fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        self.assertEqual(seals & want, want)
        with self.assertRaises(PermissionError):
            os.ftruncate(lent.fd, 0)
        lent.close()
        # An unsealed memfd (it could be truncated under the daemon's copies).
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        try:
            with self.assertRaises(ckptd.CkptdError) as cm:
                _shm.send_fd(fd_sock, fd)
            self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
            self.assertIn("not sealed with F_SEAL_SHRINK", cm.exception.message)
            self.assertIn("MFD_ALLOW_SEALING", cm.exception.message)
        finally:
            os.close(fd)

    def test_staging_falls_back_when_the_daemon_lends_no_more(self):
        cfg = os.path.join(self.root, "arena-limit.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots: [{self.root}]\narena_limit: 2MiB\n")
        with testlib.Daemon(self.root, "--config", cfg) as d:
            hold = ckptd.SharedArena(2 << 20, daemon=d.socket)  # all the daemon lends
            with self.assertRaises(ckptd.CkptdError) as cm:
                ckptd.SharedArena(1, daemon=d.socket)
            self.assertEqual(cm.exception.code, "RESOURCE_EXHAUSTED")
            self.assertIn("limit", cm.exception.message)
            # A plain array then stages through a memfd of this process.
            sd = {"model.norm.weight": np.zeros(64, np.float32)}
            ckptd.load_state_dict(sd, self.tp2, socket=d.socket)
            np.testing.assert_array_equal(sd["model.norm.weight"], self.full("model.norm.weight"))
            hold.close()

    def test_process_memory_checks_before_writing(self):
        """process_memory: the daemon writes only into the process the kernel
        names for the connection, after reading back the cookie the request
        names; a target address not mapped (or read-only) in the caller fails
        the load with INVALID_ARGUMENT naming process_vm_writev, the daemon
        lives on, and the same request with real addresses then loads."""
        import ctypes
        import mmap
        import grpc
        name = "model.norm.weight"
        cookie = os.urandom(16)
        held = ctypes.create_string_buffer(cookie, len(cookie))
        ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
        ro_addr = np.frombuffer(ro, np.uint8).ctypes.data
        dst = np.full(64, -7.0, np.float32)
        with ckptd.Client(self.sock) as c:
            def load(job, sent_cookie, address):
                req = c._pb2.LoadRequest(job_id=job, rank=0, world_size=1,
                                        path=os.path.abspath(self.tp2))
                req.targets.add(name=name, dtype="F32", global_shape=[64], offset=[0],
                                shape=[64], dest_offset=address)
                req.process_memory.cookie = sent_cookie
                req.process_memory.cookie_address = ctypes.addressof(held)
                try:
                    for _ in c._stub.Load(req, timeout=30):
                        pass
                except grpc.RpcError as e:
                    return e.code().name, e.details()
                return "OK", ""

            code, msg = load("pm-cookie", os.urandom(16), dst.ctypes.data)
            self.assertEqual(code, "FAILED_PRECONDITION", msg)
            self.assertIn("cookie", msg)
            self.assertTrue((dst == -7.0).all())
            code, msg = load("pm-unmapped", cookie, 0x1000)  # below mmap_min_addr
            self.assertEqual(code, "INVALID_ARGUMENT", msg)
            self.assertIn("process_vm_writev", msg)
            self.assertIn(f"pid {os.getpid()}", msg)
            code, msg = load("pm-read-only", cookie, ro_addr)
            self.assertEqual(code, "INVALID_ARGUMENT", msg)
            self.assertIn("process_vm_writev", msg)
            self.assertIsNone(self.daemon.proc.poll(), "ckptd died")
            code, msg = load("pm-good", cookie, dst.ctypes.data)
            self.assertEqual(code, "OK", msg)
            np.testing.assert_array_equal(dst, self.full(name))
        ro.close()

    def test_process_memory_reshards_casts_and_transposes(self):
        """The daemon's writes into this process: a column split of a row-split
        checkpoint (many runs), a cast, tied weights (overlapping tensors: "auto"
        stages them over shm instead) and poisoned destinations."""
        full = self.full("model.layers.0.mlp.up_proj.weight")
        rows, cols = full.shape
        half = cols // 2
        for r in range(2):
            part = np.full((rows, half), np.nan, np.float32)
            as64 = np.full((rows, half), np.nan, np.float64)
            sd = {"model.layers.0.mlp.up_proj.weight":
                  ckptd.ShardedTensor(part, (rows, cols), (0, r * half))}
            rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock,
                                        transport="process_memory")
            self.assertEqual(rep.transport, "process_memory")
            np.testing.assert_array_equal(part, full[:, r * half:(r + 1) * half])
            sd = {"model.layers.0.mlp.up_proj.weight":
                  ckptd.ShardedTensor(as64, (rows, cols), (0, r * half))}
            ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport="process_memory")
            np.testing.assert_array_equal(as64, full[:, r * half:(r + 1) * half].astype(np.float64))
        tied = np.full(64, np.nan, np.float32)
        sd = {"model.norm.weight": tied, "model.layers.0.input_layernorm.weight": tied}
        rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock)
        self.assertEqual(rep.transport, "shm")  # overlapping tensors: not process_memory
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport="process_memory")
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        self.assertIn("overlap", cm.exception.message)

    def test_native_copy_loop_matches_numpy(self):
        """ckptd/_native.c's copy loop (views' runs): pieces below and above the
        streaming threshold (4 KiB), destinations at every offset within a
        64-byte line, strided and not; bytes outside the runs untouched."""
        from ckptd import _native
        self.assertIsNotNone(_native.available(), "the native library is built with "
                             "//client/python:ckptd and must load here")
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
        for length in (1, 63, 64, 4095, 4096, 4097, 16384 + 5, 65536):
            for count, extra in ((1, 0), (3, 37), (5, 4096)):
                for shift in (0, 1, 31, 63):
                    dst = np.zeros(count * (length + extra) + 256, np.uint8)
                    want = dst.copy()
                    d0, s0 = 64 + shift, int(rng.integers(0, 1000))
                    runs = np.array([[dst.ctypes.data + d0, src.ctypes.data + s0, length, count,
                                      length + extra, length + 2 * extra + 11]], np.uint64)
                    self.assertTrue(_native.copy_runs(runs))
                    for i in range(count):
                        a = d0 + i * (length + extra)
                        b = s0 + i * (length + 2 * extra + 11)
                        want[a:a + length] = src[b:b + length]
                    np.testing.assert_array_equal(dst, want, err_msg=f"{length} {count} {shift}")
        with self.assertRaises(ValueError):
            _native.copy_runs(np.zeros((1, 5), np.uint64))

    def test_native_file_mapping_copy(self):
        """ckptd/_native.c's copy out of a file mapping (file views whose page
        cache maps whole 2 MiB pages): the same bytes as pread where it maps (it
        may decline: 1, where the page cache holds the file in small pages);
        a file that ends under the mapping (SIGBUS) fails that call with
        -ENODATA, not the process, and the SIGBUS handler before it is back."""
        import errno
        import signal
        from ckptd import _native
        self.assertIsNotNone(_native.available())
        path = os.path.join(self.root, "mapped.bin")
        rng = np.random.default_rng(11)
        data = rng.integers(0, 256, 24 << 20, dtype=np.uint8)
        with open(path, "wb") as f:
            f.write(data.tobytes())  # large writes: large page-cache folios where the fs has them
        fd = os.open(path, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        rows, half, row = 700, 16384, 32768
        for off, rel in ((12345, 0), (1 << 20, 4096 + 64)):
            got, want = (np.zeros(rows * half + 8192, np.uint8) for _ in range(2))
            runs = np.array([[got.ctypes.data + rel, off, half, rows, half, row]], np.uint64)
            rc = _native.map_runs(fd, runs)
            self.assertIn(rc, (0, 1))
            if rc == 1:
                self.assertFalse(got.any(), "declined, yet it copied")
                self.assertEqual(_native.pread_runs(fd, runs), 0)
            for i in range(rows):
                want[rel + i * half:rel + (i + 1) * half] = data[off + i * row:off + i * row + half]
            np.testing.assert_array_equal(got, want)
        # Short spans are left to pread.
        small = np.zeros(1 << 20, np.uint8)
        self.assertEqual(_native.map_runs(fd, np.array([[small.ctypes.data, 0, 1 << 20, 1, 0, 0]],
                                                       np.uint64)), 1)
        # A file shorter than the runs: the probe of its first 2 MiB faults.
        short = os.path.join(self.root, "short.bin")
        with open(short, "wb") as f:
            f.write(data[:1 << 20].tobytes())
        sfd = os.open(short, os.O_RDONLY)
        self.addCleanup(os.close, sfd)
        caught = []
        before = signal.signal(signal.SIGBUS, lambda *a: caught.append(a))
        try:
            dst = np.zeros(8 << 20, np.uint8)
            rc = _native.map_runs(sfd, np.array([[dst.ctypes.data, 0, 8 << 20, 1, 0, 0]], np.uint64))
            self.assertEqual(rc, -errno.ENODATA)
            self.assertEqual(caught, [], "the copy's SIGBUS went to the handler before it")
            signal.raise_signal(signal.SIGBUS)  # the handler before it is back in place
            self.assertEqual(len(caught), 1)
        finally:
            signal.signal(signal.SIGBUS, before)
        os.environ["CKPTD_MAP_FILES"] = "0"
        try:
            self.assertIsNone(_native.map_runs(fd, runs))
        finally:
            del os.environ["CKPTD_MAP_FILES"]

    def test_native_file_mapping_copy_mixed_folios(self):
        """A file whose page cache holds part of it in small folios (written 4 KiB
        at a time) and the rest in large ones (one large write): the native copy
        maps the 2 MiB blocks in large folios and reads the others with pread,
        block by block, where the file system gives large folios at all (a file
        written at once maps); pieces that cross from one kind of block to the
        other, or span several, come out byte for byte."""
        from ckptd import _native
        self.assertIsNotNone(_native.available())
        rng = np.random.default_rng(12)
        data = rng.integers(0, 256, 24 << 20, dtype=np.uint8)
        large = os.path.join(self.root, "large.bin")
        with open(large, "wb") as f:
            f.write(data.tobytes())
        mixed = os.path.join(self.root, "mixed.bin")
        small_part = (6 << 20) + 12288  # ends inside a block: it mixes small and large folios
        with open(mixed, "wb") as f:
            for at in range(0, small_part, 4096):
                f.write(data[at:at + 4096].tobytes())
            f.write(data[small_part:].tobytes())
        fds = {}
        for name in (large, mixed):
            fds[name] = os.open(name, os.O_RDONLY)
            self.addCleanup(os.close, fds[name])
        # Half rows (a tensor split on dim 1), whole rows across blocks, one 7 MiB piece.
        layouts = [(12345, 16384, 700, 16384, 32768),
                   ((4 << 20) + 777, 100000, 120, 100000, 100000),
                   ((3 << 20) + 5, 7 << 20, 1, 0, 0)]
        whole_maps = None
        for name in (large, mixed):
            for off, length, count, dstride, sstride in layouts:
                got = np.zeros(length * count + 64, np.uint8)
                want = np.zeros_like(got)
                runs = np.array([[got.ctypes.data + 64, off, length, count, dstride, sstride]],
                                np.uint64)
                rc = _native.map_runs(fds[name], runs)
                self.assertIn(rc, (0, 1), name)
                if name == large and whole_maps is None:
                    whole_maps = rc == 0
                if rc == 1:
                    self.assertFalse(got.any(), "declined, yet it copied")
                    self.assertEqual(_native.pread_runs(fds[name], runs), 0)
                for i in range(count):
                    want[64 + i * dstride:64 + i * dstride + length] = \
                        data[off + i * sstride:off + i * sstride + length]
                np.testing.assert_array_equal(got, want, f"{name} {off}")
                if name == mixed and whole_maps and off + length * count > (8 << 20):
                    # Its first block is in small folios; the large ones map all the same.
                    self.assertEqual(rc, 0, f"{name} {off}: the large-folio blocks did not map")

    def test_cache_views_map_huge_pages_whole(self):
        """This process maps a cache block of 2 MiB and more on a 2 MiB boundary;
        where the daemon's blocks get huge pages (Status.cache_huge_pages:
        "collapse", collapsed once no load runs, or "advise"), its copy out of
        the view maps them whole (ShmemPmdMapped in this process's smaps)."""
        from ckptd import _views
        path = os.path.join(self.root, "huge-pages")
        w = np.arange(3 << 20, dtype=np.float32).reshape(1536, 2048)  # 12 MiB
        ckptd.save_state_dict({"w": w}, path, rank=0, world_size=1, job_id="huge-pages-save",
                              socket=self.sock)
        self.addCleanup(ckptd.evict, path, socket=self.sock)
        ckptd.evict(path, socket=self.sock)
        ckptd.prefetch(path, socket=self.sock)
        st = ckptd.status(socket=self.sock)
        mode = st["cache_huge_pages"]
        self.assertIn(mode, ("off", "advise", "collapse"))
        got = np.full_like(w, np.nan)

        def load_and_look():
            got[:] = np.nan
            rep = ckptd.load_state_dict({"w": got}, path, socket=self.sock, transport="cache_view")
            np.testing.assert_array_equal(got, w)
            self.assertEqual(rep.bytes_from_views, w.nbytes)
            addrs = [a.ctypes.data for a in _views._maps.values() if len(a) >= 2 << 20]
            self.assertTrue(addrs, "no view of 2 MiB or more")
            for a in addrs:
                self.assertEqual(a % (2 << 20), 0, "a view mapped off a 2 MiB boundary")
            return max(_shmem_pmd_kb(a) for a in addrs)

        if mode == "off":
            self.assertEqual(load_and_look(), 0)
            return
        # Collapsed while no load runs: a view already mapped faults onto the huge
        # pages once they are made.
        testlib.wait_for("the view's huge pages", lambda: load_and_look() > 0, 30, 0.2)
        if mode == "collapse":  # counted as each 2 MiB is done, just after it is
            testlib.wait_for("the collapse in Status", lambda: ckptd.status(
                socket=self.sock)["cache_huge_page_bytes"] > 0, 10, 0.05)

    def test_cache_view_copy_without_the_native_library(self):
        """Where the native library is missing the client copies with numpy:
        the same bytes."""
        from ckptd import _native
        name = "model.layers.0.mlp.up_proj.weight"
        full = self.full(name)
        rows, cols = full.shape
        # Whole files in the cache (entries of 64 KiB and more are views).
        ckptd.evict(self.tp2, socket=self.sock)
        ckptd.prefetch(self.tp2, socket=self.sock)
        self.addCleanup(ckptd.evict, self.tp2, socket=self.sock)  # later tests read cold
        got = []
        saved = _native._lib
        for lib in (saved, False):
            _native._lib = lib
            try:
                part = np.full((rows, cols // 2), np.nan, np.float32)
                rep = ckptd.load_state_dict(
                    {name: ckptd.ShardedTensor(part, (rows, cols), (0, cols // 2))}, self.tp2,
                    socket=self.sock, transport="cache_view")
            finally:
                _native._lib = saved
            self.assertEqual(rep.bytes_from_views, part.nbytes)
            got.append(part)
        np.testing.assert_array_equal(got[0], full[:, cols // 2:])
        np.testing.assert_array_equal(got[1], got[0])

    def test_a_cold_load_read_around_the_page_cache_is_copied_from_views_too(self):
        """A cold load whose reads go around the page cache (O_DIRECT, as on a
        node whose page cache does not hold the checkpoint) keeps them in the
        data cache, and the client copies them from there (in batches), not
        the daemon: before, the daemon wrote every such byte into the client
        from its bounce buffer. (A checkpoint with checksums: the daemon
        verifies its bytes, so they are not left to the client's file views.)"""
        full = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024) * 0.25
        path = os.path.join(self.root, "direct-ckpt")
        d = testlib.Daemon(self.root, "--direct-io", "always")
        try:
            testlib.run_ranks(2, lambda r: ckptd.save_state_dict(
                {"w": ckptd.ShardedTensor(full[256 * r:256 * (r + 1)].copy(), full.shape,
                                          (256 * r, 0))},
                path, rank=r, world_size=2, job_id="direct-save", socket=d.socket))
            ckptd.evict(path, socket=d.socket)
            for f in os.listdir(path):  # out of the page cache, as on a node that never read it
                fd = os.open(os.path.join(path, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            # Two ranks, a column half each: every read is needed whole, so
            # its checksums are checked (by the daemon).
            halves = [np.full((512, 512), np.nan, np.float32) for _ in range(2)]
            reps = testlib.run_ranks(2, lambda r: ckptd.load_state_dict(
                {"w": ckptd.ShardedTensor(halves[r], full.shape, (0, 512 * r))}, path, rank=r,
                world_size=2, job_id="direct-load", socket=d.socket, transport="cache_view"))
            np.testing.assert_array_equal(np.concatenate(halves, axis=1), full)
            for r in range(2):
                self.assertEqual(reps[r].bytes_read, full.nbytes)
                self.assertGreater(reps[r].checksums_verified, 0)
                self.assertEqual(reps[r].bytes_from_views, halves[r].nbytes)
                self.assertEqual(reps[r].bytes_from_files, 0)
                self.assertGreaterEqual(reps[r].timings["client_view_batches"], 1)
            self.assertRegex(d.read_log(), r"load job=direct-load .* direct=%dB" % full.nbytes)
        finally:
            self.assertEqual(d.stop(), 0)

    def test_a_rank_that_took_pieces_gets_a_laid_out_copy_next_time(self):
        """Column halves of a row-split checkpoint reach each rank as a piece
        per row; after a warm load the daemon gathers each rank's pieces into
        one laid-out copy, and the next load of the same tensors (new
        memory) copies them from it, byte-exact. A rewritten checkpoint is
        never served from the old copy; Evict drops it; cache_laid_out_copies
        false turns it off."""
        rows, cols = 1024, 1024
        path = os.path.join(self.root, "laid-out-ckpt")

        def save(d, scale):
            full = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) * scale
            testlib.run_ranks(2, lambda r: ckptd.save_state_dict(
                {"w": ckptd.ShardedTensor(full[512 * r:512 * (r + 1)].copy(), full.shape,
                                          (512 * r, 0)),
                 "b": ckptd.ShardedTensor(full[512 * r:512 * (r + 1)].copy() + 1, full.shape,
                                          (512 * r, 0))},
                path, rank=r, world_size=2, job_id=f"lo-save-{scale}", socket=d.socket,
                overwrite=True))
            return full

        def load(d, full, job):
            halves = [{k: np.full((rows, cols // 2), np.nan, np.float32) for k in ("w", "b")}
                      for _ in range(2)]
            reps = testlib.run_ranks(2, lambda r: ckptd.load_state_dict(
                {k: ckptd.ShardedTensor(v, full.shape, (0, 512 * r)) for k, v in halves[r].items()},
                path, rank=r, world_size=2, job_id=job, socket=d.socket, transport="cache_view"))
            for k, add in (("w", 0), ("b", 1)):
                np.testing.assert_array_equal(
                    np.concatenate([halves[0][k], halves[1][k]], axis=1), full + add)
            return reps

        def laid_out_after(d, full, job):
            """Loads until every rank's copy gathered after an earlier load is
            there. The daemon gathers them once no load has run for 50 ms
            (one rank's, then the next's): 0.2 s between loads leaves room."""
            for i in range(50):
                reps = load(d, full, f"{job}-{i}")
                if all(r.bytes_from_laid_out for r in reps):
                    return reps
                time.sleep(0.2)
            self.fail("no load was served from a laid-out copy to every rank")

        with testlib.Daemon(self.root) as d:
            full = save(d, 0.5)
            load(d, full, "lo-first")  # cold: from the files, then filled
            reps = laid_out_after(d, full, "lo-warm")
            for r in range(2):
                self.assertEqual(reps[r].bytes_from_laid_out, 2 * rows * cols // 2 * 4)
                self.assertEqual(reps[r].bytes_from_views, reps[r].bytes_from_laid_out)
                self.assertEqual(reps[r].bytes_read, 0)
            st = ckptd.status(socket=d.socket)
            self.assertEqual(int(st.get("cache_laid_out_entries", 0)), 2)  # one per rank
            self.assertGreaterEqual(int(st.get("cache_laid_out_hits", 0)), 2)
            self.assertNotIn("laid-out", str(st.get("files", "")))
            # Rewritten in place (new files, other values): never the old copy.
            full = save(d, 0.25)
            reps = load(d, full, "lo-rewritten")
            self.assertEqual([r.bytes_from_laid_out for r in reps], [0, 0])
            laid_out_after(d, full, "lo-rewritten-warm")
            ckptd.evict(path, socket=d.socket)
            self.assertEqual(int(ckptd.status(socket=d.socket).get("cache_laid_out_bytes", 0)), 0)
        with testlib.Daemon(self.root, "--cache-laid-out-copies", "false") as d:
            full = save(d, 0.5)
            for i in range(4):
                reps = load(d, full, f"lo-off-{i}")
                self.assertEqual([r.bytes_from_laid_out for r in reps], [0, 0])
            self.assertEqual(int(ckptd.status(socket=d.socket).get("cache_laid_out_entries", 0)), 0)

    def test_cache_view_copies_cached_bytes_in_the_client(self):
        """transport="cache_view": bytes the daemon's cache holds are copied by
        this process from read-only views of the cache (column halves of a
        row-split checkpoint: strided runs); a cast goes through the daemon's
        writes; nothing cached: reported as process_memory."""
        name = "model.layers.0.mlp.up_proj.weight"
        full = self.full(name)
        rows, cols = full.shape
        half = cols // 2
        ckptd.evict(self.tp2, socket=self.sock)
        part = np.full((rows, half), np.nan, np.float32)
        sd = {name: ckptd.ShardedTensor(part, (rows, cols), (0, half))}
        ckptd.prefetch(self.tp2, socket=self.sock)
        for _ in range(2):  # the second time through the mappings kept
            part[:] = np.nan
            rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport="cache_view")
            self.assertEqual(rep.transport, "cache_view")
            self.assertEqual(rep.bytes_from_views, part.nbytes)
            self.assertEqual(rep.bytes_delivered, part.nbytes)
            self.assertFalse(rep.zero_copy)
            np.testing.assert_array_equal(part, full[:, half:])
        # Only the latest load's mappings are kept (a freed block's pages stay
        # while mapped): after a load of another tensor, exactly its views.
        from ckptd import _views
        self.assertTrue(_views._maps)
        seen, keep = [], _views.keep
        _views.keep = lambda keys: (seen.append(set(keys)), keep(keys))
        try:
            other_name = "model.layers.1.mlp.up_proj.weight"
            other = np.full(self.full(other_name).shape, np.nan, np.float32)
            rep = ckptd.load_state_dict({other_name: other}, self.tp2, socket=self.sock,
                                        transport="cache_view")
        finally:
            _views.keep = keep
        self.assertEqual(rep.bytes_from_views, other.nbytes)
        np.testing.assert_array_equal(other, self.full(other_name))
        self.assertEqual(len(seen), 1)
        self.assertEqual(set(_views._maps), seen[0])
        # "auto" picks it on the daemon of this uid.
        part[:] = np.nan
        rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock)
        self.assertEqual(rep.transport, "cache_view")
        np.testing.assert_array_equal(part, full[:, half:])
        # A cast is converted on the way: the daemon writes it (no views).
        as64 = np.full((rows, half), np.nan, np.float64)
        both = {name: ckptd.ShardedTensor(as64, (rows, cols), (0, 0)),
                "model.norm.weight": np.full(64, np.nan, np.float32)}
        rep = ckptd.load_state_dict(both, self.tp2, socket=self.sock, transport="cache_view")
        self.assertEqual(rep.transport, "cache_view")
        self.assertEqual(rep.bytes_from_views, 64 * 4)  # the norm only
        np.testing.assert_array_equal(as64, full[:, :half].astype(np.float64))
        np.testing.assert_array_equal(both["model.norm.weight"], self.full("model.norm.weight"))
        # Nothing cached (evicted): bytes with nothing to verify or convert are
        # read by this process from the checkpoint's file itself (file views);
        # the daemon reads none of them and caches them after the load.
        ckptd.evict(self.tp2, socket=self.sock)
        part[:] = np.nan
        rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport="cache_view")
        self.assertEqual(rep.transport, "cache_view")
        self.assertEqual((rep.bytes_from_views, rep.bytes_from_files, rep.bytes_read),
                         (0, part.nbytes, 0))
        self.assertEqual(rep.bytes_delivered, part.nbytes)
        np.testing.assert_array_equal(part, full[:, half:])
        part[:] = np.nan
        rep = ckptd.load_state_dict(sd, self.tp2, socket=self.sock, transport="cache_view")
        self.assertEqual((rep.bytes_from_files, rep.bytes_read), (0, 0))
        self.assertGreater(rep.bytes_from_cache, 0)  # filled after the first
        np.testing.assert_array_equal(part, full[:, half:])
        ckptd.evict(self.tp2, socket=self.sock)

    def test_a_file_changed_while_the_client_reads_it_fails_the_load(self):
        """File views: a checkpoint file written in place while the client reads
        it fails the load (ABORTED, naming the file: the daemon checks the
        file once the client is done); one truncated under it fails in the
        client (a short read), never a crash (the client reads, not maps)."""
        from ckptd import _views
        name = "model.layers.0.mlp.up_proj.weight"
        rows, cols = self.full(name).shape
        for how in ("write", "truncate"):
            with self.subTest(how):
                ckpt = os.path.join(self.root, f"tp2-{how}")
                shutil.copytree(self.tp2, ckpt)
                data = sorted(f for f in os.listdir(ckpt) if not f.endswith(".metadata"))
                read = _views._read_file

                def meddle(fd, runs):
                    for f in data:
                        p = os.path.join(ckpt, f)
                        if how == "truncate":
                            os.truncate(p, 100)
                        else:
                            with open(p, "r+b") as fh:
                                b = fh.read(1)
                                fh.seek(0)
                                fh.write(b)  # same bytes: only the file's times change
                    return read(fd, runs)

                _views._read_file = meddle
                try:
                    part = np.full((rows, cols // 2), np.nan, np.float32)
                    with self.assertRaises(ckptd.CkptdError) as cm:
                        ckptd.load_state_dict(
                            {name: ckptd.ShardedTensor(part, (rows, cols), (0, cols // 2))},
                            ckpt, socket=self.sock, transport="cache_view")
                finally:
                    _views._read_file = read
                self.assertEqual(cm.exception.code, "ABORTED", cm.exception.message)
                self.assertIn("changed during the load", cm.exception.message)
                if how == "write":
                    self.assertIn(ckpt, cm.exception.message)
                ckptd.evict(ckpt, socket=self.sock)

    def test_file_views_leave_checks_and_casts_to_the_daemon(self):
        """Reads with a stored checksum to verify, or copies that convert, are
        the daemon's even when the client reads files: whole shards of tp2
        carry checksums; a cast is converted on the way. With verify=False
        the same whole shard is the client's to read."""
        name = "model.layers.0.mlp.up_proj.weight"
        full = self.full(name)
        rows, cols = full.shape
        ckptd.evict(self.tp2, socket=self.sock)
        self.addCleanup(ckptd.evict, self.tp2, socket=self.sock)
        whole = np.full((rows, cols), np.nan, np.float32)
        rep = ckptd.load_state_dict({name: whole}, self.tp2, socket=self.sock,
                                    transport="cache_view")
        self.assertGreater(rep.checksums_verified, 0)
        self.assertEqual(rep.bytes_from_files, 0)
        self.assertEqual(rep.bytes_read, whole.nbytes)
        np.testing.assert_array_equal(whole, full)
        ckptd.evict(self.tp2, socket=self.sock)
        whole[:] = np.nan
        rep = ckptd.load_state_dict({name: whole}, self.tp2, socket=self.sock,
                                    transport="cache_view", verify=False)
        self.assertEqual((rep.bytes_from_files, rep.bytes_read), (whole.nbytes, 0))
        np.testing.assert_array_equal(whole, full)
        ckptd.evict(self.tp2, socket=self.sock)
        as64 = np.full((rows, cols), np.nan, np.float64)
        rep = ckptd.load_state_dict({name: as64}, self.tp2, socket=self.sock,
                                    transport="cache_view", verify=False)
        self.assertEqual(rep.bytes_from_files, 0)
        self.assertGreater(rep.bytes_read, 0)
        np.testing.assert_array_equal(as64, full.astype(np.float64))

    def test_file_views_leave_bytes_two_ranks_need_to_the_daemon(self):
        """Two ranks whose column slices of one tensor interleave row by row
        read their own runs from the files; where their slices overlap (bytes
        both need) the daemon reads them once instead; a warm load reads no
        file."""
        name = "model.layers.1.mlp.down_proj.weight"
        full = self.full(name)
        rows, cols = full.shape
        self.addCleanup(ckptd.evict, self.tp2, socket=self.sock)

        def load(job, slices):
            parts = [np.full((rows, b - a), np.nan, np.float32) for a, b in slices]
            reps = testlib.run_ranks(2, lambda r: ckptd.load_state_dict(
                {name: ckptd.ShardedTensor(parts[r], full.shape, (0, slices[r][0]))}, self.tp2,
                rank=r, world_size=2, job_id=job, socket=self.sock, transport="cache_view",
                verify=False))
            for r, (a, b) in enumerate(slices):
                np.testing.assert_array_equal(parts[r], full[:, a:b])
            return reps

        overlapping = [(0, 3 * cols // 4), (cols // 4, cols)]
        ckptd.evict(self.tp2, socket=self.sock)
        reps = load("fv-overlap-cold", overlapping)
        for r in range(2):
            self.assertEqual(reps[r].bytes_from_files, 0)
            self.assertEqual(reps[r].bytes_read, full.nbytes)  # the job's: read once
        halves = [(0, cols // 2), (cols // 2, cols)]
        ckptd.evict(self.tp2, socket=self.sock)
        reps = load("fv-halves-cold", halves)
        for r in range(2):
            self.assertEqual(reps[r].bytes_from_files, rows * cols // 2 * 4)
            self.assertEqual(reps[r].bytes_read, 0)
        # Filled into the cache after that load (unverified bytes the daemon
        # read itself are not kept; bytes the clients read are, by the filler).
        reps = load("fv-halves-warm", halves)
        for r in range(2):
            self.assertEqual((reps[r].bytes_from_files, reps[r].bytes_read), (0, 0))
            self.assertGreater(reps[r].bytes_from_cache, 0)

    def test_stream_transport(self):
        sd = {"model.layers.0.mlp.down_proj.weight": np.zeros((64, 128), np.float32),
              "lm_head.weight": np.zeros((256, 64), np.float32)}
        events = []
        r = ckptd.load_state_dict(sd, self.hf, socket=self.sock, transport="stream",
                                  progress=events.append)
        self.assertEqual(r.missing_keys, [])
        self.assertTrue(events)
        for n, a in sd.items():
            np.testing.assert_array_equal(a, self.full(n))

    def test_non_contiguous_destination(self):
        big = np.zeros((64, 256), np.float32)
        view = big[:, ::2]  # (64, 128), strided
        ckptd.load_state_dict({"model.layers.0.mlp.down_proj.weight": view}, self.hf,
                              socket=self.sock)
        np.testing.assert_array_equal(view, self.full("model.layers.0.mlp.down_proj.weight"))
        self.assertTrue(np.all(big[:, 1::2] == 0))

    def test_the_callers_arrays_are_freed_when_it_drops_them(self):
        """Nothing a call leaves behind holds the caller's arrays, not even in a
        reference cycle: a process that loads into fresh tensors again and
        again (an evaluation loop, a weight sync) frees the old ones as it
        drops them, not when the garbage collector next runs (which kept
        512 MiB per load in case 7's persistent ranks)."""
        import gc
        import weakref
        names = ("model.layers.0.mlp.down_proj.weight", "lm_head.weight")
        out = os.path.join(self.root, "saved-freed")
        gc.collect()
        gc.disable()
        try:
            for transport in ("auto", "cache_view", "process_memory", "shm", "stream", "save"):
                for attempt in range(2):  # the second load is warm: cache views
                    arrays = {n: np.zeros(self.ref[n][1].shape, np.float32) for n in names}
                    refs = [weakref.ref(a) for a in arrays.values()]
                    sd = {"outer": {"inner": dict(arrays)}}
                    if transport == "save":
                        rep = ckptd.save_state_dict(sd, out, unique_id=attempt,
                                                    socket=self.sock)
                    else:
                        rep = ckptd.load_state_dict(
                            sd, self.hf, socket=self.sock, transport=transport,
                            aoa=[f"{n} -> outer.inner.{n}" for n in names])
                        self.assertEqual(rep.missing_keys, [], transport)
                        for n in names:
                            np.testing.assert_array_equal(arrays[n], self.full(n),
                                                          err_msg=transport)
                    del sd, arrays, rep
                    alive = [r() is not None for r in refs]
                    self.assertEqual(alive, [False] * len(names),
                                     f"{transport} (call {attempt}): arrays the caller dropped "
                                     "are still referenced")
        finally:
            gc.enable()

    # --- save ---

    def test_save_then_load_numpy(self):
        out = os.path.join(self.root, "saved-np")
        g = (8, 6)
        full = np.arange(48, dtype=np.float32).reshape(g) / 7
        bias = np.arange(6, dtype=np.int64)

        def save(r):
            off, shp = split(g, 0, 2, r)
            sd = {"layer": {"w": ckptd.ShardedTensor(full[off[0]:off[0] + shp[0]].copy(), g, off),
                            "b": bias.copy()}, "note": "not a tensor"}
            return ckptd.save_state_dict(sd, out, rank=r, world_size=2, job_id="np-save-0",
                                         socket=self.sock)

        reps = run_ranks(2, save)
        self.assertEqual([rep.unique_id for rep in reps], [0, 0])
        self.assertEqual(reps[0].metadata_file, "0.metadata")
        self.assertEqual(reps[0].skipped_keys, ["note"])
        self.assertEqual(reps[0].bytes_written, full.nbytes + bias.nbytes)  # b written once
        self.assertTrue(os.path.exists(os.path.join(out, "0.metadata")))
        with open(os.path.join(out, "0.metadata")) as f:
            meta = json.load(f)
        self.assertEqual(meta["flat_mapping"]["layer.w"], ["layer", "w"])
        # A second save without unique_id becomes version 1.
        reps = run_ranks(2, lambda r: ckptd.save_state_dict(
            {"layer.w": ckptd.ShardedTensor((full * 2)[r * 4:(r + 1) * 4].copy(), g, (r * 4, 0))},
            out, rank=r, world_size=2, job_id="np-save-1", socket=self.sock))
        self.assertEqual(reps[0].unique_id, 1)
        info = ckptd.inspect(out, socket=self.sock)
        self.assertEqual(info.versions, [0, 1])
        self.assertEqual(info.unique_id, 1)

        w, b = np.zeros(g, np.float32), np.zeros(6, np.int64)
        r = ckptd.load_state_dict({"layer": {"w": w, "b": b}}, out, unique_id=0, socket=self.sock)
        self.assertEqual(r.missing_keys, [])
        np.testing.assert_array_equal(w, full)
        np.testing.assert_array_equal(b, bias)
        r = ckptd.load_state_dict({"layer": {"w": w, "b": b}}, out, socket=self.sock,
                                  strict=False)
        self.assertEqual(r.missing_keys, ["layer.b"])
        np.testing.assert_array_equal(w, full * 2)

    def test_fresh_destinations_get_huge_pages(self):
        """Fresh memory in a destination is advised huge before it is faulted
        in (where the kernel leaves THP to madvise), never beyond the
        tensor's own bytes; a load into it is exact; CKPTD_HUGE_PAGES=0 and
        memory already there keep 4 KiB pages."""
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        if "[madvise]" not in mode:
            self.skipTest(f"THP is not left to madvise here: {mode.strip()}")
        if ckclient._huge_blocks_free() < 64 << 20:
            self.skipTest("under 64 MiB free in 2 MiB blocks (the client advises half)")
        out = os.path.join(self.root, "saved-huge")
        g = (1024, 2048)  # 8 MiB of float32
        full = np.arange(g[0] * g[1], dtype=np.float32).reshape(g) / 3
        ckptd.save_state_dict({"w": full}, out, job_id="np-huge-save", socket=self.sock)

        def fresh():
            """A float32 array of shape g on a fresh anonymous mapping that
            starts 4 KiB past a 2 MiB boundary (so the advice must be cut)."""
            m = mmap.mmap(-1, full.nbytes + (4 << 20), flags=mmap.MAP_PRIVATE)
            base = np.frombuffer(m, np.uint8)
            addr = base.ctypes.data
            skip = (-addr) % (2 << 20) + 4096
            return m, base[skip:skip + full.nbytes].view(np.float32).reshape(g)

        def huge_kib(a):
            """AnonHugePages of the mappings that hold a's bytes, in KiB."""
            lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
            total, inside = 0, False
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split()[0]
                    if "-" in head and not head.endswith(":"):
                        s, e = (int(x, 16) for x in head.split("-"))
                        inside = s < hi and e > lo
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1])
            return total

        for transport in ("process_memory", "cache_view"):
            m, w = fresh()
            r = ckptd.load_state_dict({"w": w}, out, socket=self.sock, transport=transport)
            self.assertEqual(r.missing_keys, [])
            np.testing.assert_array_equal(w, full, err_msg=transport)
            # 8 MiB from 4 KiB past a boundary: 3 whole 2 MiB pages inside.
            self.assertEqual(huge_kib(w), 3 * 2048, transport)
            del w, m
        os.environ["CKPTD_HUGE_PAGES"] = "0"
        try:
            m, w = fresh()
            ckptd.load_state_dict({"w": w}, out, socket=self.sock, transport="process_memory")
            np.testing.assert_array_equal(w, full)
            self.assertEqual(huge_kib(w), 0)
            del w, m
        finally:
            del os.environ["CKPTD_HUGE_PAGES"]
        # Memory already touched is not advised (its pages are there).
        m, w = fresh()
        w.fill(0)
        ckptd.load_state_dict({"w": w}, out, socket=self.sock, transport="process_memory")
        np.testing.assert_array_equal(w, full)
        self.assertEqual(huge_kib(w), 0)
        del w, m

    # --- inspect / merge / admin ---

    def test_inspect(self):
        info = ckptd.inspect(self.tp2, socket=self.sock)
        self.assertEqual(info.format, "ckptd")
        self.assertEqual(info.unique_id, 5)
        self.assertEqual(info.versions, [5])
        self.assertEqual(set(info.tensors), set(self.ref))
        t = info.tensors["model.embed_tokens.weight"]
        self.assertEqual((t.dtype_name, t.global_shape, t.bytes), ("BF16", (256, 64), 256 * 64 * 2))
        f32 = [i for i in info.tensors.values() if i.dtype_name == "F32"]
        self.assertTrue(f32)
        torch = sys.modules.get("torch")  # imported by a suite run in the same process
        if torch is None:
            self.assertIsNone(t.dtype)  # numpy has no bfloat16
            self.assertEqual(f32[0].dtype, np.float32)
            self.assertEqual(f32[0].shards[0].dtype, np.float32)
        else:
            self.assertIs(t.dtype, torch.bfloat16)
            self.assertIs(f32[0].shards[0].dtype, torch.float32)
        self.assertEqual(info.total_bytes, sum(a.nbytes for _, a in self.ref.values()))
        self.assertEqual(sum(info.files.values()), info.total_bytes)

    def test_merge(self):
        out = os.path.join(self.root, "merged")
        rep = ckptd.merge(self.tp2, out, shards=2)
        self.assertEqual(rep["tensors"], len(self.ref))
        self.assertTrue(os.path.exists(os.path.join(out, "model.safetensors.index.json")))
        merged = testlib.read_hf_dir(out)
        self.assertEqual(set(merged), set(self.ref))
        for n, (dt, a) in self.ref.items():
            self.assertEqual(merged[n][0], dt)
            np.testing.assert_array_equal(merged[n][1], a, err_msg=n)
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.merge(os.path.join(self.root, "no-such-ckpt"), out + "2")
        self.assertEqual(cm.exception.code, "NOT_FOUND")
        self.assertIn("no-such-ckpt", cm.exception.message)

    def test_status_prefetch_evict(self):
        p = ckptd.prefetch(self.hf, socket=self.sock)
        self.assertIn("bytes_cached", p)
        st = ckptd.status(socket=self.sock)
        self.assertIn("ckptd", st["version"])
        # Numbers are ints (issue 38: protobuf's JSON form made 64-bit ones strings).
        self.assertIs(type(st["cache_bytes"]), int)
        self.assertGreater(st["cache_bytes"], 0)
        self.assertIs(type(p["bytes_read"]), int)
        self.assertIsInstance(st["jobs"], list)
        ev = ckptd.evict(self.hf, socket=self.sock)
        self.assertIs(type(ev["bytes_freed"]), int)
        self.assertGreater(ev["bytes_freed"], 0)

    # --- errors ---

    def test_daemon_not_running(self):
        d = os.path.dirname(self.sock)
        missing = os.path.join(d, "nobody.sock")
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"x": np.zeros(2)}, self.hf, socket=missing)
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertEqual(cm.exception.code, "UNAVAILABLE")
        self.assertIn("is the daemon running", str(cm.exception))
        self.assertIn(missing, str(cm.exception))
        # A socket file nobody listens on (a daemon that died).
        stale = os.path.join(d, "stale.sock")
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        s.bind(stale)
        s.close()
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.inspect(self.hf, socket=stale)
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertEqual(cm.exception.code, "UNAVAILABLE")
        self.assertIn("is the daemon running", str(cm.exception))
        # The default socket comes from $CKPTD_SOCKET.
        os.environ["CKPTD_SOCKET"] = missing
        try:
            with self.assertRaises(ckptd.CkptdError):
                ckptd.status()
        finally:
            del os.environ["CKPTD_SOCKET"]

    def test_daemon_errors_carry_code_and_message(self):
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.inspect("/", socket=self.sock)
        self.assertEqual(cm.exception.code, "PERMISSION_DENIED")
        self.assertIn("outside the checkpoint roots", cm.exception.message)
        self.assertEqual(cm.exception.grpc_code.name, "PERMISSION_DENIED")
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"x": np.zeros(2)}, os.path.join(self.root, "nothing-here"),
                                  socket=self.sock)
        self.assertEqual(cm.exception.code, "NOT_FOUND")
        self.assertIn("nothing-here", str(cm.exception))
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.inspect(self.tp2, unique_id=4, socket=self.sock)
        self.assertEqual(cm.exception.code, "NOT_FOUND")

    def test_barrier_timeout(self):
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"model.norm.weight": np.zeros(64, np.float32)}, self.hf,
                                  rank=0, world_size=2, job_id="lonely", barrier_timeout=0.3,
                                  socket=self.sock)
        self.assertEqual(cm.exception.code, "DEADLINE_EXCEEDED")
        self.assertIn("never registered", cm.exception.message)
        self.assertLess(time.monotonic() - t0, 10)

    def test_bad_arguments_fail_before_the_daemon(self):
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.ShardedTensor  # noqa: B018
            ckptd.load_state_dict({"w": ckptd.ShardedTensor(np.zeros((2, 3)), (4, 6), (0, 0),
                                                            local_shape=(2, 2))},
                                  self.hf, socket=self.sock)
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        ro = np.zeros(3)
        ro.flags.writeable = False
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"w": ro}, self.hf, socket=self.sock)
        self.assertIn("read-only", cm.exception.message)
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"w": np.zeros(2, np.complex64)}, self.hf, socket=self.sock)
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        with self.assertRaises(ckptd.CkptdError):
            ckptd.load_state_dict({"w": np.zeros(2)}, self.hf, rank=3, world_size=2,
                                  socket=self.sock)
        # A dict that contains itself, and one nested too deep: named, not a
        # RecursionError. The same dict twice side by side is fine (two keys).
        loop = {"w": np.zeros(2, np.float32)}
        loop["inner"] = {"again": loop}
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict(loop, self.hf, socket=self.sock)
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        self.assertIn("'inner.again' is a dict that contains it", cm.exception.message)
        deep = leaf = {}
        for _ in range(100):
            leaf["d"] = {}
            leaf = leaf["d"]
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict(deep, self.hf, socket=self.sock)
        self.assertIn("nests dicts more than", cm.exception.message)
        shared = {"weight": np.zeros(64, np.float32)}
        from ckptd._tensors import flatten
        entries, _ = flatten({"a": shared, "b": shared})
        self.assertEqual([e.key for e in entries], ["a.weight", "b.weight"])


class EnvironmentTest(unittest.TestCase):
    """Defaults taken from the launcher's environment."""

    def setUp(self):
        self.saved = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "SLURM_JOB_ID", "SLURM_STEP_ID", "CKPTD_JOB_ID"):
            os.environ.pop(k, None)

    def tearDown(self):
        os.environ.clear()
        os.environ.update(self.saved)

    def test_ranks(self):
        self.assertEqual(ckclient.resolve_ranks(), (0, 1, []))
        os.environ.update(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4")
        self.assertEqual(ckclient.resolve_ranks(), (5, 8, [4, 5, 6, 7]))
        self.assertEqual(ckclient.resolve_ranks(rank=2, world_size=4, node_ranks=[]), (2, 4, []))
        os.environ.update(LOCAL_WORLD_SIZE="8")
        self.assertEqual(ckclient.resolve_ranks(), (5, 8, []))
        os.environ["RANK"] = "x"
        with self.assertRaises(ckptd.CkptdError):
            ckclient.resolve_ranks()

    def test_job_ids(self):
        with self.assertRaises(ckptd.CkptdError):
            ckclient.resolve_job_id(None, "load", 4)
        self.assertIn(f"pid{os.getpid()}", ckclient.resolve_job_id(None, "load", 1))
        os.environ.update(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
        a = ckclient.resolve_job_id(None, "load", 4)
        b = ckclient.resolve_job_id(None, "load", 4)
        self.assertTrue(a.startswith("10.0.0.1:29500/load/"))
        self.assertNotEqual(a, b)
        os.environ.update(TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="2")
        self.assertTrue(ckclient.resolve_job_id(None, "save", 4).startswith("torchelastic-abc-r2/save/"))
        os.environ["CKPTD_JOB_ID"] = "mine"
        self.assertTrue(ckclient.resolve_job_id(None, "load", 4).startswith("mine/load/"))
        self.assertEqual(ckclient.resolve_job_id("explicit", "load", 4), "explicit")

    def test_dtype_names(self):
        self.assertEqual(ckptd.dtype_name("bfloat16"), "BF16")
        self.assertEqual(ckptd.dtype_name(np.float16), "F16")
        self.assertEqual(ckptd.dtype_name("F8_E4M3"), "F8_E4M3")
        with self.assertRaises(ckptd.CkptdError):
            ckptd.dtype_name("complex")


class StubSearchTest(unittest.TestCase):
    """Where `import ckptd` finds the generated stubs (docs/python-client.md)."""

    def run_probe(self, pythonpath, env_extra=None):
        env = {k: v for k, v in os.environ.items() if k != "CKPTD_PROTO_DIR"}
        env.update(PYTHONPATH=pythonpath, **(env_extra or {}))
        code = ("import ckptd, sys\n"
                "from ckptd import _proto\n"
                "try:\n"
                "    pb2, _ = _proto.load_stubs(); print('OK', pb2.__file__)\n"
                "except ckptd.CkptdError as e:\n"
                "    print('ERR', e.code, e.message)\n")
        p = subprocess.run(["/usr/bin/python3", "-c", code], env=env, cwd="/",
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.stdout.strip()

    def test_search_order(self):
        import ckptd as pkg
        src_pkg = os.path.dirname(os.path.abspath(pkg.__file__))
        from ckptd import _proto
        gen_dir = os.path.dirname(_proto.load_stubs()[0].__file__)
        stubs = [os.path.join(gen_dir, f) for f in ("ckpt_pb2.py", "ckpt_pb2_grpc.py")]
        t = testlib.tmp_root()
        # A source tree: <tree>/client/python/ckptd and <tree>/bazel-bin/client/python.
        tree = os.path.join(t, "tree")
        shutil.copytree(src_pkg, os.path.join(tree, "client", "python", "ckptd"))
        out = self.run_probe(os.path.join(tree, "client", "python"))
        self.assertTrue(out.startswith("ERR FAILED_PRECONDITION"), out)
        self.assertIn("bazel build //client/python:ckpt_py_grpc", out)
        gen = os.path.join(tree, "bazel-bin", "client", "python")
        os.makedirs(gen)
        for f in stubs:
            shutil.copy(f, gen)
        out = self.run_probe(os.path.join(tree, "client", "python"))
        self.assertEqual(out, "OK " + os.path.join(gen, "ckpt_pb2.py"))
        # $CKPTD_PROTO_DIR comes first.
        other = os.path.join(t, "stubs")
        os.makedirs(other)
        for f in stubs:
            shutil.copy(f, other)
        out = self.run_probe(os.path.join(tree, "client", "python"), {"CKPTD_PROTO_DIR": other})
        self.assertEqual(out, "OK " + os.path.join(other, "ckpt_pb2.py"))
        # Installed side by side with the package.
        side = os.path.join(t, "site")
        shutil.copytree(src_pkg, os.path.join(side, "ckptd"))
        for f in stubs:
            shutil.copy(f, side)
        self.assertEqual(self.run_probe(side), "OK " + os.path.join(side, "ckptd", "..",
                                                                     "ckpt_pb2.py").replace(
            "/ckptd/..", ""))


if __name__ == "__main__":
    testlib.main("numpy_client_test")
