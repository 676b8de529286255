"""The Python client with PyTorch: a real ckptd daemon and a multi-process
job (torch.multiprocessing, 4 ranks) that saves a model + optimizer state with
one sharding; 2 ranks load it with another; values must be exact."""
import json
import os
import socket
import tempfile
import time
import unittest

import numpy as np

try:
    import torch
    import torch.multiprocessing as mp
except ImportError:  # the numpy tests cover the client without torch
    torch = None

import ckptd
import testlib

SAVE_WORLD, LOAD_WORLD = 4, 2


class Model(torch.nn.Module if torch else object):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.fc1 = torch.nn.Linear(32, 48)
        self.fc2 = torch.nn.Linear(48, 16)
        self.norm = torch.nn.LayerNorm(32, elementwise_affine=True)


def reference():
    """The full model and optimizer state, the same in every process:
    {flat name: tensor}. The embedding and norm weights are bf16."""
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (8,))
    y = model.fc2(model.fc1(model.norm(model.embed(x)))).square().mean()
    y.backward()
    opt.step()
    ref = {}
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        ref["model." + n] = p.detach().clone()
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            ref[f"optim.state.{i}.{k}"] = v.detach().clone()
    for k in ("model.embed.weight", "model.norm.weight"):
        ref[k] = ref[k].to(torch.bfloat16)
    return ref, names, opt.state_dict()["param_groups"]


def split(shape, dim, world, r):
    off, shp = [0] * len(shape), list(shape)
    chunk = -(-shape[dim] // world)
    off[dim] = min(r * chunk, shape[dim])
    shp[dim] = max(0, min(chunk, shape[dim] - off[dim]))
    return off, shp


def box(t, off, shp):
    return t[tuple(slice(o, o + s) for o, s in zip(off, shp))]


def save_layout(ref, rank, param_groups):
    """4 ranks: 2-D weights split on dim 0, 1-D weights replicated, Adam
    moments ZeRO-style flat ranges, step counters replicated."""
    sd = {"model": {}, "optim": {"state": {}, "param_groups": param_groups}}
    for k, v in ref.items():
        parts = k.split(".")
        if k.startswith("model."):
            if v.dim() == 2:
                off, shp = split(v.shape, 0, SAVE_WORLD, rank)
                val = ckptd.ShardedTensor(box(v, off, shp).clone(), v.shape, off)
            else:
                val = v.clone()
            sd["model"][".".join(parts[1:])] = val
        else:
            i, name = parts[2], parts[3]
            if name == "step":
                val = v.clone()
            else:
                n = v.numel()
                b, e = rank * n // SAVE_WORLD, (rank + 1) * n // SAVE_WORLD
                val = ckptd.ShardedTensor(v.reshape(-1)[b:e].clone(), v.shape, flat_range=(b, e))
            sd["optim"]["state"].setdefault(int(i), {})[name] = val
    return sd


def load_layout(ref, rank):
    """2 ranks: 2-D weights and exp_avg split on dim 1, 1-D exp_avg split on
    dim 0, the rest whole (replicated); plus a key the checkpoint lacks."""
    sd = {}
    for k, v in ref.items():
        if k.endswith("exp_avg_sq") or k.endswith("step") or (k.startswith("model.") and v.dim() == 1):
            sd[k] = torch.zeros_like(v)
        else:
            off, shp = split(v.shape, v.dim() - 1, LOAD_WORLD, rank)
            sd[k] = ckptd.ShardedTensor(torch.zeros(shp, dtype=v.dtype), v.shape, off)
    sd["model.extra.weight"] = torch.full((4, 4), 7.0)
    return sd


def check(ref, sd):
    for k, v in sd.items():
        got = v.local if isinstance(v, ckptd.ShardedTensor) else v
        if k == "model.extra.weight":
            assert torch.equal(got, torch.full((4, 4), 7.0)), "missing key was overwritten"
            continue
        want = ref[k]
        if isinstance(v, ckptd.ShardedTensor):
            want = box(want, v.offset, v.local_shape)
        assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
        # Bit-exact (bf16 compared through its bits).
        a = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
        b = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
        assert torch.equal(a, b), f"{k}: values differ"


def save_worker(rank, sock, path, out_dir):
    # The launcher's environment: rank, world size and job id come from it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(SAVE_WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(SAVE_WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29555", CKPTD_SOCKET=sock)
    ref, _, groups = reference()
    rep = ckptd.save_state_dict(save_layout(ref, rank, groups), path)
    with open(os.path.join(out_dir, f"save{rank}.json"), "w") as f:
        json.dump(rep.as_dict(), f)


def load_worker(rank, sock, path, out_dir):
    torch.set_num_threads(1)
    ref, _, _ = reference()
    sd = load_layout(ref, rank)
    rep = ckptd.load_state_dict(sd, path, rank=rank, world_size=LOAD_WORLD, job_id="torch-load",
                                socket=sock, strict=False)
    check(ref, sd)
    # bf16 in the checkpoint, float32 wanted: ckptd casts (exactly, widening).
    emb = torch.zeros(64, 32)
    rep2 = ckptd.load_state_dict({"model.embed.weight": emb}, path, rank=rank,
                                 world_size=LOAD_WORLD, job_id="torch-load-f32", socket=sock)
    assert rep2.missing_keys == [], rep2.missing_keys
    assert torch.equal(emb, ref["model.embed.weight"].float())
    with open(os.path.join(out_dir, f"load{rank}.json"), "w") as f:
        json.dump(rep.as_dict(), f)


def key_worker(rank, sock, port, out_dir):
    """Two processes of a job spanning two daemons agree on a job key over
    torch.distributed (gloo); the environment's CKPTD_JOB_KEY wins over it."""
    import torch.distributed as dist
    from ckptd import client
    os.environ.pop("CKPTD_JOB_KEY", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        node_ranks = [2 * rank, 2 * rank + 1]  # this process stands for one node of 4 ranks
        key = client.resolve_job_key(None, 4, node_ranks)
        again = client.resolve_job_key(None, 4, node_ranks)  # once per process: no collective
        one_node = client.resolve_job_key(None, 4, [])        # not multi-node: none
        os.environ["CKPTD_JOB_KEY"] = "from-the-environment-0123"
        env = client.resolve_job_key(None, 4, node_ranks)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"key{rank}.json"), "w") as f:
        json.dump({"key": key.decode(), "again": again.decode(), "one_node": one_node.decode(),
                   "env": env.decode()}, f)


@unittest.skipIf(torch is None, "torch is not installed [needs: torch]")
class TorchClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.daemon = testlib.Daemon(cls.root)
        cls.sock = cls.daemon.socket
        cls.ref, cls.param_names, _ = reference()

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc}"

    def spawn(self, fn, nprocs, *args):
        out = tempfile.mkdtemp(prefix="out-", dir=os.environ.get("TEST_TMPDIR"))
        mp.spawn(fn, args=(self.sock, *args, out), nprocs=nprocs, join=True)
        reps = []
        for r in range(nprocs):
            with open(os.path.join(out, f"{fn.__name__.split('_')[0]}{r}.json")) as f:
                reps.append(json.load(f))
        return reps

    def test_save_4_ranks_load_2_ranks_resharded(self):
        path = os.path.join(self.root, "step100")
        t0 = time.monotonic()
        saves = self.spawn(save_worker, SAVE_WORLD, path)
        save_s = time.monotonic() - t0
        total = sum(v.numel() * v.element_size() for v in self.ref.values())
        for r, rep in enumerate(saves):
            self.assertEqual(rep["unique_id"], 0)
            self.assertEqual(rep["metadata_file"], "0.metadata")
            self.assertTrue(rep["job_id"].startswith("127.0.0.1:29555/save/"), rep["job_id"])
            self.assertEqual(rep["bytes_written"], total)  # replicated tensors written once
            self.assertEqual(rep["skipped_keys"], ["optim.param_groups"])
            self.assertIn(f"{r}_0.safetensors", rep["files"])
        info = ckptd.inspect(path, socket=self.sock)
        self.assertEqual(info.format, "ckptd")
        self.assertEqual(set(info.tensors), set(self.ref))
        self.assertEqual(info.tensors["model.embed.weight"].dtype_name, "BF16")
        self.assertIs(info.tensors["model.embed.weight"].dtype, torch.bfloat16)  # torch imported
        self.assertEqual(info.total_bytes, total)
        flat = [s for s in info.tensors["optim.state.1.exp_avg"].shards if s.flat_range]
        self.assertEqual(len(flat), SAVE_WORLD)

        t0 = time.monotonic()
        loads = self.spawn(load_worker, LOAD_WORLD, path)
        load_s = time.monotonic() - t0
        for rep in loads:
            self.assertEqual(rep["missing_keys"], ["model.extra.weight"])
            self.assertEqual(rep["unexpected_keys"], [])
            self.assertEqual(rep["format"], "ckptd")
            self.assertGreater(rep["checksums_verified"], 0)
            self.assertGreater(rep["bytes_delivered"], 0)
        self.assertEqual(loads[0]["bytes_read"], total)  # every byte read once for both ranks
        print(f"save (4 procs, incl. spawn+import): {save_s:.2f}s; "
              f"load (2 procs): {load_s:.2f}s; checkpoint {total} bytes", flush=True)

        # An independent check of what was written: merge to HuggingFace files
        # (ckptctl) and compare with a plain safetensors reader.
        merged = os.path.join(self.root, "merged")
        ckptd.merge(path, merged)
        files = testlib.read_hf_dir(merged)
        self.assertEqual(set(files), set(self.ref))
        for k, v in self.ref.items():
            dt, arr = files[k]
            want = (v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16
                    else v.numpy())
            self.assertEqual(dt, ckptd.dtype_name(v.dtype), k)
            np.testing.assert_array_equal(arr, want, err_msg=k)

    def test_bf16_zero_copy_arena_and_nested_state_dict(self):
        path = os.path.join(self.root, "bf16")
        g = torch.Generator().manual_seed(7)
        w = torch.randn(128, 96, generator=g).to(torch.bfloat16)
        b = torch.randn(96, generator=g)
        ckptd.save_state_dict({"net": {"w": w, "b": b}}, path, rank=0, world_size=1,
                              socket=self.sock)
        arena = ckptd.SharedArena(1 << 20)
        w2 = arena.empty_torch((128, 96), torch.bfloat16)
        b2 = arena.empty_torch((96,), torch.float32)
        self.assertEqual(w2.dtype, torch.bfloat16)
        sd = {"net": {"w": w2, "b": b2}}
        rep = ckptd.load_state_dict(sd, path, socket=self.sock)
        self.assertTrue(rep.zero_copy)
        self.assertEqual(rep.missing_keys, [])
        self.assertTrue(torch.equal(w2.view(torch.int16), w.view(torch.int16)))
        self.assertTrue(torch.equal(b2, b))
        # nn.Parameter (requires_grad) destinations, bf16 -> f32 cast, a model.
        m = torch.nn.Linear(96, 128, bias=False)
        rep = ckptd.load_state_dict({"net.w": m.weight}, path, socket=self.sock)
        self.assertTrue(torch.equal(m.weight.detach(), w.float()))
        self.assertTrue(m.weight.requires_grad)

    def test_ranks_agree_on_a_job_key_over_torch_distributed(self):
        """docs/multi-node.md: without CKPTD_JOB_KEY, the ranks of a multi-node
        job agree on one over torch.distributed (rank 0 draws 32 random bytes
        as 64 hex digits); explicit and short keys are checked."""
        with socket.socket() as probe:  # a free port for the process group
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        reps = self.spawn(key_worker, 2, port)
        self.assertEqual(reps[0]["key"], reps[1]["key"])
        self.assertRegex(reps[0]["key"], r"^[0-9a-f]{64}$")
        for r in reps:
            self.assertEqual(r["again"], r["key"])
            self.assertEqual(r["one_node"], "")
            self.assertEqual(r["env"], "from-the-environment-0123")
        from ckptd import client
        self.assertEqual(client.resolve_job_key(b"x" * 16, 4, [0]), b"x" * 16)
        with self.assertRaises(ckptd.CkptdError) as e:
            client.resolve_job_key("short", 4, [0])
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("16 to 64 bytes", e.exception.message)

    def test_ckptd_torch_is_a_deprecated_alias_of_ckptd_dcp(self):
        """issue 37: the DCP module is ckptd.dcp (`from ckptd import torch` shadowed
        the real torch); the old name still works for one API level, warning."""
        import importlib
        import sys
        import warnings
        import ckptd.dcp
        sys.modules.pop("ckptd.torch", None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            old = importlib.import_module("ckptd.torch")
        self.assertTrue(any(issubclass(w.category, DeprecationWarning) and
                            "ckptd.dcp" in str(w.message) for w in seen), seen)
        self.assertIs(old.DaemonStorageReader, ckptd.dcp.DaemonStorageReader)
        self.assertIs(old.DaemonStorageWriter, ckptd.dcp.DaemonStorageWriter)
        self.assertIs(old._assign_job, ckptd.dcp._assign_job)

    def test_daemon_not_running(self):
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({"w": torch.zeros(3)}, self.root,
                                  socket=os.path.join(self.daemon.dir, "gone.sock"))
        self.assertLess(time.monotonic() - t0, 2.0)
        self.assertEqual(cm.exception.code, "UNAVAILABLE")
        self.assertIn("is the daemon running", str(cm.exception))

    def test_non_contiguous_destination(self):
        # Non-contiguous torch destinations are filled through a copy.
        path = os.path.join(self.root, "nc")
        full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        ckptd.save_state_dict({"t": full}, path, rank=0, world_size=1, socket=self.sock)
        dst = torch.zeros(6, 4).t()  # (4, 6), not contiguous
        ckptd.load_state_dict({"t": dst}, path, socket=self.sock)
        self.assertTrue(torch.equal(dst, full))

    def test_the_callers_tensors_are_freed_when_it_drops_them(self):
        """As numpy_client_test's twin, through torch's paths: a load (bf16, a
        non-contiguous destination), DCP's load_state_dict with the daemon's
        reader and an asynchronous save leave no reference, cycle or not, to
        the tensors the caller dropped."""
        import gc
        import weakref
        import ckptd.dcp
        import torch.distributed._shard.checkpoint as dcp
        path = os.path.join(self.root, "freed")
        g = torch.Generator().manual_seed(11)
        w, b = torch.randn(128, 96, generator=g).to(torch.bfloat16), torch.randn(96, generator=g)
        ckptd.save_state_dict({"net": {"w": w, "b": b}}, path, rank=0, world_size=1,
                              socket=self.sock)

        def load(ts):
            ckptd.load_state_dict({"net": {"w": ts["w"], "b": ts["nc"]}}, path, socket=self.sock)

        def dcp_load(ts):
            dcp.load_state_dict({"net.w": ts["w"], "net.b": ts["nc"]},
                                ckptd.dcp.DaemonStorageReader(path, socket=self.sock),
                                no_dist=True)

        def async_save(ts):
            ts["w"].copy_(w)
            ts["nc"].copy_(b)
            ckptd.save_state_dict({"net": {"w": ts["w"], "b": ts["nc"]}},
                                  os.path.join(self.root, "freed-saved"), rank=0, world_size=1,
                                  socket=self.sock, async_save=True, overwrite=True,
                                  unique_id=0).result()

        gc.collect()
        gc.disable()
        try:
            for what, fn in (("load", load), ("dcp load", dcp_load), ("async save", async_save)):
                for attempt in range(2):
                    ts = {"w": torch.empty(128, 96, dtype=torch.bfloat16),
                          "nc": torch.zeros(96, 2)[:, 1]}  # strided: filled through a copy
                    refs = {k: weakref.ref(t) for k, t in ts.items()}
                    fn(ts)
                    self.assertTrue(torch.equal(ts["w"].view(torch.int16), w.view(torch.int16)))
                    self.assertTrue(torch.equal(ts["nc"], b), what)
                    del ts
                    alive = sorted(k for k, r in refs.items() if r() is not None)
                    self.assertEqual(alive, [], f"{what} (call {attempt}): tensors the caller "
                                     "dropped are still referenced")
        finally:
            gc.enable()


if __name__ == "__main__":
    testlib.main("torch_client_test")
