#!/usr/bin/python3
"""save_bench — case 8 of bench/run: saving without stalling training (issue 21).

    /usr/bin/python3 bench/save_bench.py --dir WORKDIR --ckptd PATH [--rows FILE]
        [--quick] [--reps N] [--ranks N] [--mib-per-rank M] [--keep]

In one run, with Debian's /usr/bin/python3 (torch 1.13, numpy, grpcio):

1. A real ckptd (--ckptd) on a Unix socket in WORKDIR (save_buffer and cache_budget twice
   the job's bytes).
2. N rank processes (spawned, gloo; default 2) each hold M MiB (default 512; --quick 128)
   of float32 tensors of 64 MiB, touched, filled from a seeded generator.
3. Per repetition (median of --reps, default 3; --quick 1), each timed from the moment the
   ranks leave a barrier:
     memcpy     each rank copies its bytes into touched buffers (the limit of a stall: the
                least a consistent copy can cost);
     sync       ckptd.save_state_dict: the call returns once the version is durable;
     async      ckptd.save_state_dict(async_save=True): the call's time is the stall; the
                ranks then change every tensor, and SaveFuture.result() gives the persist
                time (persist_s, the daemon's background write);
     dcp        PyTorch DCP's save_state_dict (FileSystemWriter) of the same tensors;
     write      the machine's sequential write + fsync speed: one process writes the
                job's bytes to one file in 64 MiB writes, then fsync (the limit of a
                persist, which one daemon thread does).
   After the last repetition, the last async version is loaded back through ckptd by every
   rank and compared with the values it had at the call (a mismatch fails the bench).

Rows (bench/run's format) go to --rows: the async stall per rank against memcpy (target
>= 0.5), the persist against write + fsync (target >= 0.7), and sync saves and DCP's
save against write + fsync for reference.
"""
import argparse
import os
import shutil
import socket as _socket
import statistics
import subprocess
import sys
import time
import traceback

sys.dont_write_bytecode = True
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "tests", "foreign"))
sys.path.insert(0, os.path.join(_REPO, "client", "python"))
import torch13_dcp  # noqa: E402,F401  (before torch.distributed._shard)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TENSOR_MIB = 64


def die(msg):
    print(f"save_bench: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def free_port():
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, cfg, conn):
    try:
        import ckptd
        import torch.distributed._shard.checkpoint as dcp
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(cfg["port"])
        dist.init_process_group("gloo", rank=rank, world_size=cfg["ranks"])
        n = cfg["mib"] // TENSOR_MIB
        elems = TENSOR_MIB * (1 << 20) // 4
        rng = np.random.default_rng(1000 + rank)
        sd = {f"r{rank}.t{i}": rng.standard_normal(elems, dtype=np.float32) for i in range(n)}
        spare = {k: np.ones_like(v) for k, v in sd.items()}
        nbytes = sum(v.nbytes for v in sd.values())
        conn.send(("ok", {}))
        version = 0
        while True:
            cmd = conn.recv()
            op = cmd["op"]
            if op == "quit":
                break
            dist.barrier()
            t0 = time.monotonic()
            out = {"bytes": nbytes}
            if op == "memcpy":
                for k, v in sd.items():
                    np.copyto(spare[k], v)
            elif op in ("sync", "async"):
                kw = dict(rank=rank, world_size=cfg["ranks"], unique_id=version,
                          job_id=f"save-bench/{version}", socket=cfg["socket"])
                if op == "sync":
                    ckptd.save_state_dict(sd, cfg["ckpt"], **kw)
                else:
                    fut = ckptd.save_state_dict(sd, cfg["ckpt"], async_save=True, **kw)
                    out["stall_s"] = time.monotonic() - t0
                    out["call"] = fut.staged.timings
                    kept = {k: v.copy() for k, v in sd.items()} if cmd.get("last") else None
                    for v in sd.values():  # training goes on
                        v += 1.0
                    rep = fut.result()
                    out["persist_s"] = rep.persist_s
                    out["staged_to_durable_s"] = rep.timings.get("staged_to_durable_s", 0.0)
                    if kept is not None:
                        dist.barrier()
                        back = {k: np.zeros_like(v) for k, v in kept.items()}
                        ckptd.load_state_dict(back, cfg["ckpt"], unique_id=version,
                                              rank=rank, world_size=cfg["ranks"],
                                              job_id=f"save-bench/check/{version}",
                                              socket=cfg["socket"], strict=True)
                        for k in kept:
                            if not np.array_equal(back[k], kept[k]):
                                raise AssertionError(f"version {version} tensor {k}: differs "
                                                     "from the values at the call")
                version += 1
            elif op == "dcp":
                tsd = {k: torch.from_numpy(v) for k, v in sd.items()}
                path = os.path.join(cfg["work"], f"dcp-{cmd['rep']}")
                dcp.save_state_dict(tsd, dcp.FileSystemWriter(path))
            dist.barrier()
            out["t"] = time.monotonic() - t0
            conn.send(("ok", out))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def write_fsync(path, nbytes):
    chunk = np.ones(64 << 20, np.uint8)
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[:min(left, chunk.nbytes)])
        os.fsync(fd)
    finally:
        os.close(fd)
    t = time.monotonic() - t0
    os.unlink(path)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ckptd", required=True)
    ap.add_argument("--rows")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib-per-rank", type=int)
    a = ap.parse_args()
    reps = a.reps or (1 if a.quick else 3)
    mib = a.mib_per_rank or (128 if a.quick else 512)
    mib = max(TENSOR_MIB, mib // TENSOR_MIB * TENSOR_MIB)
    work = os.path.join(os.path.abspath(a.dir), "save-bench")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    job_bytes = a.ranks * mib << 20
    sock = os.path.join(work, "ckptd.sock")
    log = open(os.path.join(work, "ckptd.log"), "wb")
    daemon = subprocess.Popen(
        [a.ckptd, "--socket", sock, "--root", work, "--save_buffer", str(2 * job_bytes),
         "--cache-budget", str(2 * job_bytes)], stdout=log, stderr=subprocess.STDOUT)
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(sock) and os.path.exists(sock + ".fd")):
            if daemon.poll() is not None or time.monotonic() > deadline:
                die(f"ckptd did not start; see {work}/ckptd.log")
            time.sleep(0.05)
        cfg = dict(ranks=a.ranks, mib=mib, port=free_port(), socket=sock, work=work,
                   ckpt=os.path.join(work, "ckpt"))
        for r in range(a.ranks):
            x, y = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(r, cfg, y), daemon=True)
            p.start()
            conns.append(x)
            procs.append(p)

        def collect(what):
            out = []
            for r, c in enumerate(conns):
                if not c.poll(900):
                    die(f"{what}: rank {r} gave no answer in 900 s")
                status, v = c.recv()
                if status != "ok":
                    die(f"{what}: rank {r} failed:\n{v}")
                out.append(v)
            return out

        def run(op, **kw):
            for c in conns:
                c.send(dict(op=op, **kw))
            return collect(op)

        collect("start-up")
        run("sync")  # warm-up: the daemon's arenas and the files' first creation
        res = {k: [] for k in ("memcpy", "stall", "persist", "sync", "dcp", "write")}
        calls = []
        for i in range(reps):
            res["memcpy"].append(max(o["t"] for o in run("memcpy")))
            res["sync"].append(max(o["t"] for o in run("sync")))
            outs = run("async", last=(i == reps - 1))
            res["stall"].append(max(o["stall_s"] for o in outs))
            calls.append(outs[0]["call"])
            res["persist"].append(outs[0]["persist_s"])
            res["dcp"].append(max(o["t"] for o in run("dcp", rep=i)))
            res["write"].append(write_fsync(os.path.join(work, "write-probe"), job_bytes))
        for c in conns:
            c.send(dict(op="quit"))
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        daemon.terminate()
        daemon.wait(60)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    rank_bytes = mib << 20
    gb = 1e9
    memcpy_gbps = rank_bytes / med["memcpy"] / gb
    write_gbps = job_bytes / med["write"] / gb
    print(f"save_bench: {a.ranks} ranks x {mib} MiB, {reps} rep(s), medians:")
    for k in ("memcpy", "stall", "sync", "persist", "dcp", "write"):
        print(f"  {k:<8} {med[k]:8.3f} s   (all: {', '.join(f'{x:.3f}' for x in res[k])})")
    print("  rank 0's async calls (s): " + "; ".join(
        ", ".join(f"{k} {v:.3f}" for k, v in c.items()) for c in calls))
    rows = []

    def row(name, figure, unit, limit, limit_what, target="-", ok=None):
        ratio = figure / limit if limit else 0.0
        met = "-" if ok is None else ("yes" if ok(ratio) else "no")
        rows.append((name, figure, unit, limit, limit_what, ratio, target, met))

    row("8 async-save-stall (per rank)", rank_bytes / med["stall"] / gb, "GB/s", memcpy_gbps,
        "memcpy per rank", ">=0.5", lambda r: r >= 0.5)
    row("8 async-save-persist", job_bytes / med["persist"] / gb, "GB/s", write_gbps,
        "write+fsync 1 file", ">=0.7", lambda r: r >= 0.7)
    row("8 sync-save", job_bytes / med["sync"] / gb, "GB/s", write_gbps, "write+fsync 1 file")
    row("8 dcp-save", job_bytes / med["dcp"] / gb, "GB/s", write_gbps, "write+fsync 1 file")
    row("8 async-stall vs dcp-save", med["stall"], "s", med["dcp"], "DCP save (blocking)")
    if a.rows:
        with open(a.rows, "a") as f:
            for r in rows:
                f.write("%s\t%.6g\t%s\t%.6g\t%s\t%.6g\t%s\t%s\n" % r)
    print("save_bench: the last async version loaded back equal to the values at the call",
          flush=True)


if __name__ == "__main__":
    main()
