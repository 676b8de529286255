#!/usr/bin/python3
"""A training job that saves through ckptd, is restarted with another world size, and resumes.

    /usr/bin/python3 examples/resume_training.py --ckptd bazel-bin/server/ckptd
    /usr/bin/python3 examples/resume_training.py --socket /run/ckptd/ckptd.sock --dir DIR

What it does (torch.multiprocessing + gloo, as torchrun would run it; CPU only):
1. 4 ranks train a tiny MLP with data parallelism and a ZeRO-1 style optimizer: every rank
   holds the whole model, but the Adam moments of only its quarter of the flattened
   parameters. After 10 steps they save through ckptd: the model once (every rank holds the
   same), each rank's optimizer slice as a flat range (ckptd.ShardedTensor). They train 5
   more steps: the run that never stopped.
2. The job "restarts" with 2 ranks. Each loads the model and its new half of the optimizer
   state from the 4-rank checkpoint (ckptd reshards the flat ranges) and trains steps 10-14.
3. It prints both runs' losses and checks the restarted one continues where the first
   stopped: every step's loss equal to the uninterrupted run's (within float summation
   order: 1e-5 relative) and below the loss of step 0.

--ckptd starts a daemon of its own on a temporary root (and stops it); --socket uses a running
one, whose roots must contain --dir. Exits non-zero if the check fails (as it does with
--drop-optimizer-state, a restart that loses the optimizer state: the negative control).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ckptd  # noqa: E402

SAVE_AT, STEPS, FIRST_WORLD, SECOND_WORLD = 10, 15, 4, 2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    y = (x[:, :1] * 0.7 - x[:, 1:2] * 1.3 + 0.1 * torch.randn(96, 1, generator=g))
    return x, y


class Zero1:
    """Data-parallel training, Adam moments sharded by flat range over the ranks."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.net = model()
        self.params = list(self.net.parameters())
        self.n = sum(p.numel() for p in self.params)
        self.begin, self.end = rank * self.n // world, (rank + 1) * self.n // world
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.slice = self.flat[self.begin:self.end].clone().requires_grad_(True)
        self.opt = torch.optim.Adam([self.slice], lr=0.01)
        x, y = data()
        rows = x.shape[0] // world
        self.x, self.y, self.total = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows], x.shape[0]

    def load_flat(self):
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def step(self):
        """One step on the whole dataset (each rank its rows); returns the global loss."""
        self.load_flat()
        for p in self.params:
            p.grad = None
        loss_sum = ((self.net(self.x) - self.y) ** 2).sum()
        (loss_sum / self.total).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(grad)
        total = torch.tensor(loss_sum.item())
        dist.all_reduce(total)
        self.slice.grad = grad[self.begin:self.end].clone()
        self.opt.step()
        flat = torch.zeros(self.n)  # every rank's updated slice, gathered by a sum
        flat[self.begin:self.end] = self.slice.detach()
        dist.all_reduce(flat)
        self.flat = flat
        return total.item() / self.total

    def state(self):
        st = self.opt.state[self.slice]
        flat = (self.begin, self.end)
        return {"model": {"flat": self.flat.clone()},
                "optim": {"exp_avg": ckptd.ShardedTensor(st["exp_avg"], (self.n,), flat_range=flat),
                          "exp_avg_sq": ckptd.ShardedTensor(st["exp_avg_sq"], (self.n,),
                                                            flat_range=flat),
                          "step": st["step"].reshape(1).clone()}}

    def restore(self, sd):
        self.flat = sd["model"]["flat"]
        with torch.no_grad():
            self.slice.copy_(self.flat[self.begin:self.end])
        if sd["optim"] is None:
            return  # a fresh optimizer (--drop-optimizer-state)
        self.opt.state[self.slice] = {
            "step": sd["optim"]["step"].reshape(()).clone(),
            "exp_avg": sd["optim"]["exp_avg"].local, "exp_avg_sq": sd["optim"]["exp_avg_sq"].local}

    def empty_state(self):
        m = self.end - self.begin
        flat = (self.begin, self.end)
        return {"model": {"flat": torch.full((self.n,), float("nan"))},
                "optim": {"exp_avg": ckptd.ShardedTensor(torch.full((m,), float("nan")), (self.n,),
                                                         flat_range=flat),
                          "exp_avg_sq": ckptd.ShardedTensor(torch.full((m,), float("nan")),
                                                            (self.n,), flat_range=flat),
                          "step": torch.full((1,), float("nan"))}}


def worker(rank, world, phase, cfg, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg-{phase}", rank=rank,
                            world_size=world)
    job = Zero1(rank, world)
    losses = {}
    if phase == "first":
        for s in range(STEPS):
            if s == SAVE_AT:
                ckptd.save_state_dict(job.state(), cfg["ckpt"], rank=rank, world_size=world,
                                      job_id=f"{cfg['run']}-save", unique_id=SAVE_AT,
                                      socket=cfg["socket"])
            losses[s] = job.step()
    else:
        sd = job.empty_state()
        rep = ckptd.load_state_dict(sd, cfg["ckpt"], rank=rank, world_size=world,
                                    job_id=f"{cfg['run']}-resume", unique_id=SAVE_AT,
                                    socket=cfg["socket"], strict=True)
        if cfg["drop_optimizer_state"]:  # the negative control: a restart that loses it
            sd["optim"] = None
        job.restore(sd)
        losses["bytes_read"] = rep.bytes_read
        for s in range(SAVE_AT, STEPS):
            losses[s] = job.step()
    if rank == 0:
        with open(os.path.join(out_dir, f"{phase}.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckptd", help="start this ckptd binary on a temporary root")
    ap.add_argument("--socket", help="use the ckptd already listening here")
    ap.add_argument("--dir", help="where the checkpoint goes (inside the daemon's roots)")
    ap.add_argument("--drop-optimizer-state", action="store_true",
                    help="resume with a fresh optimizer (a negative control: the check fails)")
    a = ap.parse_args()
    if bool(a.ckptd) == bool(a.socket):
        ap.error("give exactly one of --ckptd and --socket")
    work = tempfile.mkdtemp(prefix="ckptd-resume-")
    daemon = None
    try:
        if a.ckptd:
            root = os.path.join(work, "root")
            os.makedirs(root)
            sock = os.path.join(work, "ckptd.sock")
            daemon = subprocess.Popen([a.ckptd, "--socket", sock, "--root", root],
                                      stdout=open(os.path.join(work, "ckptd.log"), "wb"),
                                      stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while not os.path.exists(sock + ".fd"):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"ckptd did not start: see {work}/ckptd.log")
                time.sleep(0.02)
            ckpt = os.path.join(root, "run")
        else:
            sock, ckpt = a.socket, os.path.abspath(a.dir or os.path.join(work, "run"))
        cfg = {"socket": sock, "ckpt": ckpt, "run": f"resume-{os.getpid()}",
               "drop_optimizer_state": a.drop_optimizer_state}
        mp.start_processes(worker, args=(FIRST_WORLD, "first", cfg, work), nprocs=FIRST_WORLD,
                           join=True, start_method="spawn")
        mp.start_processes(worker, args=(SECOND_WORLD, "second", cfg, work), nprocs=SECOND_WORLD,
                           join=True, start_method="spawn")
        with open(os.path.join(work, "first.json")) as f:
            first = {int(k): v for k, v in json.load(f).items()}
        with open(os.path.join(work, "second.json")) as f:
            second = json.load(f)
        print(f"{FIRST_WORLD} ranks, saved through ckptd after step {SAVE_AT - 1} into {ckpt}; "
              f"restarted with {SECOND_WORLD} ranks ({second.pop('bytes_read')} bytes read "
              "by the resumed job)")
        print(f"{'step':>4}  {'uninterrupted (4 ranks)':>24}  {'restarted (2 ranks)':>20}")
        ok = True
        for s in range(STEPS):
            after = second.get(str(s))
            mark = ""
            if after is not None:
                if abs(after - first[s]) > 1e-5 * abs(first[s]) or not after < first[0]:
                    ok, mark = False, "  <- differs"
            print(f"{s:>4}  {first[s]:>24.8f}  {'' if after is None else f'{after:.8f}':>20}{mark}")
        print("resume check:", "ok: the restarted job continues where the first stopped" if ok
              else "FAILED")
        return 0 if ok else 1
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
