"""The Python client with torch CUDA tensors as destinations (cuda_ipc).

GPU part (needs torch with CUDA, a GPU, and a ckptd built with
--config=cuda; tests/gpu/run.sh runs it so): a checkpoint saved by 4 ranks
(bf16 embedding split on dim 0, f32 weight, ZeRO-flat moments) is loaded by
2 processes into CUDA tensors resharded on dim 1; the daemon writes the
device memory itself (report.zero_copy) and every value is bit-exact.
Skipped cleanly, with a message, without torch CUDA or a device.

CPU part (always): transport="cuda_ipc" refuses non-CUDA tensors, and the
"auto" fallback rules.
"""
import os
import unittest

import numpy as np

try:
    import torch
    import torch.multiprocessing as mp
except ImportError:
    torch = None

import ckptd
import testlib
from ckptd import _cuda

WHY_NO_GPU = None
if torch is None:
    WHY_NO_GPU = "torch is not installed [needs: torch]"
elif not torch.cuda.is_available():
    WHY_NO_GPU = "torch has no usable CUDA device (CPU-only build or no GPU) [needs: gpu]"

SAVE_WORLD, LOAD_WORLD = 4, 2


def reference():
    g = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(256, 96, generator=g).to(torch.bfloat16),
        "proj": torch.randn(96, 160, generator=g),
        "moment": torch.randn(96, 160, generator=g),
    }


def split(shape, dim, world, r):
    off, shp = [0] * len(shape), list(shape)
    chunk = -(-shape[dim] // world)
    off[dim] = min(r * chunk, shape[dim])
    shp[dim] = max(0, min(chunk, shape[dim] - off[dim]))
    return off, shp


def box(t, off, shp):
    return t[tuple(slice(o, o + s) for o, s in zip(off, shp))]


def save_worker(rank, sock, path):
    ref = reference()
    sd = {}
    for k in ("embed", "proj"):
        off, shp = split(ref[k].shape, 0, SAVE_WORLD, rank)
        sd[k] = ckptd.ShardedTensor(box(ref[k], off, shp).clone(), ref[k].shape, off)
    n = ref["moment"].numel()
    b, e = rank * n // SAVE_WORLD, (rank + 1) * n // SAVE_WORLD
    sd["moment"] = ckptd.ShardedTensor(ref["moment"].reshape(-1)[b:e].clone(),
                                       ref["moment"].shape, flat_range=(b, e))
    ckptd.save_state_dict(sd, path, rank=rank, world_size=SAVE_WORLD, job_id="cuda-save",
                          socket=sock)


def load_worker(rank, sock, path, out):
    torch.cuda.set_device(0)
    ref = reference()
    sd = {}
    for k in ("embed", "proj"):
        off, shp = split(ref[k].shape, 1, LOAD_WORLD, rank)
        t = torch.full(shp, 3.0, dtype=ref[k].dtype, device="cuda")
        sd[k] = ckptd.ShardedTensor(t, ref[k].shape, off)
    sd["moment"] = torch.zeros(ref["moment"].shape, device="cuda")
    rep = ckptd.load_state_dict(sd, path, rank=rank, world_size=LOAD_WORLD, job_id="cuda-load",
                                socket=sock)
    torch.cuda.synchronize()
    ok = rep.zero_copy
    for k, v in sd.items():
        got = (v.local if isinstance(v, ckptd.ShardedTensor) else v).cpu()
        want = box(ref[k], v.offset, v.local_shape) if isinstance(v, ckptd.ShardedTensor) else ref[k]
        a = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
        b = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
        ok = ok and torch.equal(a, b)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write("ok" if ok else f"mismatch zero_copy={rep.zero_copy}")


class TorchCudaDestinations(unittest.TestCase):
    @unittest.skipIf(WHY_NO_GPU is not None, f"SKIP: {WHY_NO_GPU}")
    def test_two_processes_load_into_cuda_tensors(self):
        root = testlib.tmp_root()
        path = os.path.join(root, "ckpt")
        with testlib.Daemon(root) as d:
            st = ckptd.status(socket=d.socket)
            if "no CUDA device" in st.get("gpu", "") or "without CUDA" in st.get("gpu", ""):
                self.skipTest(f"SKIP: the daemon cannot use a GPU: {st.get('gpu')} [needs: gpu]")
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=save_worker, args=(r, d.socket, path))
                     for r in range(SAVE_WORLD)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                self.assertEqual(p.exitcode, 0)
            procs = [ctx.Process(target=load_worker, args=(r, d.socket, path, root))
                     for r in range(LOAD_WORLD)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                self.assertEqual(p.exitcode, 0)
            for r in range(LOAD_WORLD):
                with open(os.path.join(root, f"rank{r}")) as f:
                    self.assertEqual(f.read(), "ok", f"rank {r}")
            self.assertIn("open IPC handles 0", ckptd.status(socket=d.socket)["gpu"])


def mixed_state_dict(device, fill):
    """A GPU model's state dict as training scripts have it: CUDA weights, a
    tied pair (one tensor under two keys), a zero-element tensor, and the
    optimizer's CPU scalar `step`."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 48, generator=g) if fill else torch.full((64, 48), -1.0)
    emb = torch.randn(32, 16, generator=g) if fill else torch.full((32, 16), -1.0)
    emb = emb.to(device)
    return {"w": w.to(device), "emb": emb, "head": emb,
            "empty": torch.empty(0, 8, device=device),
            "step": torch.tensor(41.0 if fill else 0.0)}


class MixedStateDicts(unittest.TestCase):
    @unittest.skipIf(WHY_NO_GPU is not None, f"SKIP: {WHY_NO_GPU}")
    def test_auto_keeps_cuda_ipc_for_cpu_scalars_tied_and_empty_tensors(self):
        root = testlib.tmp_root()
        path = os.path.join(root, "mixed")
        with testlib.Daemon(root) as d:
            src = mixed_state_dict("cuda", True)
            ckptd.save_state_dict(src, path, rank=0, world_size=1, job_id="mixed-save",
                                  socket=d.socket)
            dst = mixed_state_dict("cuda", False)
            rep = ckptd.load_state_dict(dst, path, rank=0, world_size=1, job_id="mixed-load",
                                        socket=d.socket)
            torch.cuda.synchronize()
            self.assertEqual(rep.transport, "cuda_ipc")
            self.assertEqual(rep.tensor_transports["w"], "cuda_ipc")
            self.assertEqual(rep.tensor_transports["emb"], "cuda_ipc")
            self.assertEqual(rep.tensor_transports["head"], "alias of emb")
            self.assertEqual(rep.tensor_transports["step"], "shm")
            self.assertEqual(rep.tensor_transports["empty"], "shm")
            self.assertFalse(rep.missing_keys)
            for k in ("w", "emb", "head", "step"):
                self.assertTrue(torch.equal(dst[k].cpu(), src[k].cpu()), k)
            self.assertIs(dst["head"], dst["emb"])
            self.assertIn("open IPC handles 0", ckptd.status(socket=d.socket)["gpu"])


class DeviceSaves(unittest.TestCase):
    @unittest.skipIf(WHY_NO_GPU is not None, f"SKIP: {WHY_NO_GPU}")
    def test_async_save_of_cuda_tensors_is_staged_by_the_daemon(self):
        """The daemon copies the CUDA tensors device -> host itself: once
        async_save returned, changing them does not change the saved version."""
        root = testlib.tmp_root()
        path = os.path.join(root, "gpu-save")
        with testlib.Daemon(root) as d:
            src = mixed_state_dict("cuda", True)
            want = {k: v.clone().cpu() for k, v in src.items()}
            fut = ckptd.save_state_dict(src, path, rank=0, world_size=1, job_id="gpu-async",
                                        socket=d.socket, async_save=True)
            with torch.no_grad():  # the caller moves on at once
                src["w"].add_(1.0)
                src["emb"].mul_(-2.0)
                src["step"].add_(1.0)
            rep = fut.result(timeout=120)
            self.assertEqual(rep.transport, "cuda_ipc")
            self.assertTrue(rep.persisted)
            self.assertIn("open IPC handles 0", ckptd.status(socket=d.socket)["gpu"])
            dst = mixed_state_dict("cuda", False)
            ckptd.load_state_dict(dst, path, rank=0, world_size=1, job_id="gpu-back",
                                  socket=d.socket)
            torch.cuda.synchronize()
            for k in ("w", "emb", "head", "step"):
                self.assertTrue(torch.equal(dst[k].cpu(), want[k]), k)

    @unittest.skipIf(WHY_NO_GPU is not None, f"SKIP: {WHY_NO_GPU}")
    def test_device_save_stall_vs_pinned_copy(self):
        """Figure (printed, not gated): the blocking time of an async save of
        1 GiB of CUDA tensors vs one pinned device -> host copy of it."""
        import time
        root = testlib.tmp_root()
        n = 1 << 28  # float32: 1 GiB
        with testlib.Daemon(root, "--save_buffer", "4GiB") as d:
            t = torch.randn(n, device="cuda")
            pinned = torch.empty(n, pin_memory=True)
            pinned.copy_(t)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinned.copy_(t)
            torch.cuda.synchronize()
            copy_s = time.perf_counter() - t0
            stalls = []
            for i in range(3):
                fut = ckptd.save_state_dict({"t": t}, os.path.join(root, f"s{i}"), rank=0,
                                            world_size=1, job_id=f"stall-{i}", socket=d.socket,
                                            async_save=True)
                stalls.append(fut.result(timeout=300).stall_s)
            stall = sorted(stalls)[1]
            gb = n * 4 / 1e9
            print(f"FIGURE device async save: stall {stall:.3f} s ({gb / stall:.1f} GB/s) vs pinned "
                  f"D2H copy {copy_s:.3f} s ({gb / copy_s:.1f} GB/s), ratio {copy_s / stall:.2f}")


class CudaIpcOnCpu(unittest.TestCase):
    def test_cuda_ipc_needs_cuda_tensors(self):
        root = testlib.tmp_root()
        os.makedirs(os.path.join(root, "ckpt"))
        with testlib.Daemon(root) as d:
            with self.assertRaises(ckptd.CkptdError) as cm:
                ckptd.load_state_dict({"w": np.zeros((2, 2), np.float32)},
                                      os.path.join(root, "ckpt"), socket=d.socket,
                                      job_id="j", transport="cuda_ipc")
            self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
            self.assertIn("CUDA tensors", cm.exception.message)

    def test_auto_falls_back_only_when_cuda_is_unavailable(self):
        E = ckptd.CkptdError
        self.assertTrue(_cuda.fallback_ok(E("UNIMPLEMENTED", "x: cuda_ipc destination: this "
                                            "ckptd was built without CUDA")))
        self.assertTrue(_cuda.fallback_ok(E("FAILED_PRECONDITION", "cuda_ipc: libcuda.so.1")))
        self.assertFalse(_cuda.fallback_ok(E("NOT_FOUND", "cuda checkpoint missing")))
        self.assertFalse(_cuda.fallback_ok(E("FAILED_PRECONDITION", "job already running")))

    def test_status_reports_gpu(self):
        root = testlib.tmp_root()
        with testlib.Daemon(root) as d:
            self.assertTrue(ckptd.status(socket=d.socket)["gpu"])


if __name__ == "__main__":
    testlib.main("torch_cuda_test")
