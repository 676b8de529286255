"""Case 10 of bench/run: checkpoints in object storage (issue 36).

A throwaway Ceph S3 gateway on this machine (tests/s3/rgw.sh; data in the
OSD's memory), a checkpoint saved into it through ckptd by 4 ranks (split on
dim 0), then loaded split on dim 1 by 2 ranks (threads of this process,
the Python client) through a ckptd serving the s3:// root:

  cold   the checkpoint evicted from the daemon (data and metadata) first:
         every planned read is a ranged GET from the gateway;
  warm   loaded again: the daemon's data cache serves it, 0 GETs.

The limit, measured in the same run: curl fetching the same data objects
in the same ranged GETs (io_request_size) with the same concurrency
(io_threads), --parallel. The gateway's requests per job come from the
daemon's counters (ckptctl status / ckptd_s3_requests_total) and are
compared with the planned reads the daemon logged.

Each repetition loads cold, waits until the daemon's work after that load
(its laid-out copy, docs/daemon.md) is done, runs curl on a quiet machine,
then loads warm (served from the data cache, and from the laid-out copy for
the rank whose copy fits in the cache budget), so the three share the
gateway's moods; figures are medians of --reps repetitions (default 7,
--quick 3), and the spread of the repetitions' own cold/curl ratios is
printed beside them.

    /usr/bin/python3 bench/s3_bench.py --ckptd bazel-bin/server/ckptd [--rows FILE] [--quick]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "s3"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import ckptd  # noqa: E402
import rgwlib  # noqa: E402
from rgwlib import split  # noqa: E402
from testlib import Daemon, run_ranks  # noqa: E402

IO_THREADS = 2
REQUEST = 64 << 20  # io_request_size (the default)


def curl_fetch(keys_sizes, parallel):
    """Seconds for curl to GET every object in REQUEST-sized ranges, `parallel` at once."""
    auth = ["--aws-sigv4", f"aws:amz:{os.environ['AWS_REGION']}:s3", "--user",
            f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}",
            "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-s", "-f", "-o", "/dev/null"]
    args = ["curl", "--no-progress-meter", "--parallel", "--parallel-max", str(parallel)]
    first = True
    for key, size in keys_sizes:
        for at in range(0, size, REQUEST):
            if not first:
                args.append("--next")
            first = False
            end = min(size, at + REQUEST) - 1
            args += auth + ["-r", f"{at}-{end}",
                            f"{rgwlib.ENDPOINT}/{os.environ['CKPTD_TEST_S3_BUCKET']}/{key}"]
    t = time.perf_counter()
    subprocess.run(args, check=True)
    return time.perf_counter() - t


def cpu_s(pid):
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_pids():
    d = os.environ["CKPTD_TEST_RGW_DIR"]
    out = {}
    for name in ("rgw", "osd"):
        with open(os.path.join(d, f"{name}.pid")) as f:
            out[name] = int(f.read().strip())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckptd", required=True)
    ap.add_argument("--rows")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None,
                    help="loads of each kind (default 7; --quick 3): the gateway shares the "
                         "cores, so single loads swing by 20%%")
    ap.add_argument("--transport", default="auto", help="the clients' transport (default auto)")
    a = ap.parse_args()
    if a.reps is None:
        a.reps = 3 if a.quick else 7
    os.environ["CKPTD_BIN"] = os.path.abspath(a.ckptd)
    import testlib
    testlib.CKPTD = os.path.abspath(a.ckptd)

    bucket = rgwlib.start()
    prefix = f"bench-{os.getpid()}"
    root = f"s3://{bucket}/{prefix}"
    mib = 128 if a.quick else 512
    cols = 1024
    shape = (mib * (1 << 20) // (cols * 4), cols)
    full = np.random.default_rng(7).standard_normal(shape, dtype=np.float32)
    d = Daemon(root, "--io-threads", str(IO_THREADS), "--cache-budget", f"{2 * mib}MiB")
    try:
        path = f"{root}/ckpt"

        def save(r):
            off, shp = split(shape, 0, 4, r)
            part = full[off[0]:off[0] + shp[0]]
            return ckptd.save_state_dict({"w": ckptd.ShardedTensor(part, shape, off)}, path,
                                         rank=r, world_size=4, job_id="s3-bench-save",
                                         socket=d.socket)
        t = time.perf_counter()
        run_ranks(4, save)
        save_s = time.perf_counter() - t
        info = ckptd.inspect(path, socket=d.socket)
        data = [(f"{prefix}/ckpt/{f}", n) for f, n in sorted(info.files.items())
                if f.endswith(".safetensors")]
        total = sum(n for _, n in data)

        pids = {"ckptd": d.proc.pid, "client": os.getpid(), **gateway_pids()}
        cpu_cold = {}

        def load(job, cpu=None):
            # The model's tensors exist (touched) before a load, as in training:
            # fresh memory's first touch is not the store's or ckptd's cost.
            outs = {r: np.ones(split(shape, 1, 2, r)[1], np.float32) for r in range(2)}

            def one(r):
                off, _ = split(shape, 1, 2, r)
                ckptd.load_state_dict({"w": ckptd.ShardedTensor(outs[r], shape, off)}, path,
                                      rank=r, world_size=2, job_id=job, socket=d.socket,
                                      transport=a.transport)
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            t = time.perf_counter()
            run_ranks(2, one)
            s = time.perf_counter() - t
            if cpu is not None:  # the load's own CPU seconds, not the check's below
                cpu.update({k: round(cpu_s(p) - cpu0[k], 2) for k, p in pids.items()})
            got = np.concatenate([outs[0], outs[1]], axis=1)
            if not np.array_equal(got, full):
                raise SystemExit("s3_bench: a load delivered wrong bytes")
            return s

        def counters():
            return ckptd.status(socket=d.socket)["object_storage"]

        def settle():
            """Until the daemon's work after a load is done (the laid-out copy
            it gathers once no load has run for 50 ms): curl must not share
            the cores with it. Done when the daemon's CPU time stops growing
            (at most one clock tick in 200 ms); at most 10 s."""
            time.sleep(0.1)
            last, end = cpu_s(d.proc.pid), time.perf_counter() + 10
            while time.perf_counter() < end:
                time.sleep(0.2)
                now = cpu_s(d.proc.pid)
                if now - last <= 1.5 / os.sysconf("SC_CLK_TCK"):
                    return
                last = now

        cold, warm, curl = [], [], []
        per_cold, per_warm, planned = None, None, None
        for i in range(a.reps):
            ckptd.evict(path, socket=d.socket)
            before = counters()
            cold.append(load(f"s3-bench-cold-{i}", cpu_cold))
            after = counters()
            per_cold = {k: after[k] - before[k] for k in ("gets", "lists", "heads")}
            m = re.findall(r"job=s3-bench-cold-%d .* reads=(\d+)" % i, d.read_log())
            planned = int(m[-1]) if m else None
            settle()
            curl.append(curl_fetch(data, IO_THREADS))
            before = counters()
            warm.append(load(f"s3-bench-warm-{i}"))
            after = counters()
            per_warm = {k: after[k] - before[k] for k in ("gets", "lists", "heads")}
        gb = 1e9
        cold_s, warm_s, curl_s = (statistics.median(x) for x in (cold, warm, curl))
        rows = []

        def row(name, figure, unit, limit, limit_what, target="-", ok=None):
            ratio = figure / limit if limit else 0.0
            met = "-" if ok is None else ("yes" if ok(ratio) else "no")
            rows.append((name, figure, unit, limit, limit_what, ratio, target, met))

        row("10 s3-cold-load", total / cold_s / gb, "GB/s", total / curl_s / gb,
            f"curl ranged GETs x{IO_THREADS}", ">=0.8", lambda r: r >= 0.8)
        row("10 s3-warm-load", total / warm_s / gb, "GB/s", total / curl_s / gb,
            f"curl ranged GETs x{IO_THREADS}")
        row("10 s3-save (4 ranks)", total / save_s / gb, "GB/s", total / curl_s / gb,
            f"curl ranged GETs x{IO_THREADS}")
        if planned is not None:
            # Each planned read is one GET; besides, the metadata object and
            # each data object's head (its header) once.
            row("10 s3 GETs per cold job", per_cold["gets"], "GETs", planned + 1 + len(data),
                "reads + metadata + headers", "=1", lambda r: r == 1)
        row("10 s3 LISTs per cold job", per_cold["lists"], "LISTs", 1, "one per checkpoint")
        row("10 s3 GETs per warm job", per_warm["gets"], "GETs", 1, "(0 expected)", "0",
            lambda r: r == 0)
        for r in rows:
            print("%-32s %10.4g %-6s limit %10.4g %-28s ratio %.3f %s %s" % r)
        print(f"(cold per job: {per_cold}; warm per job: {per_warm}; {total / 2**20:.0f} MiB "
              f"in {len(data)} objects; medians of {a.reps}; each repetition's cold/curl: "
              f"{min(u / c for c, u in zip(cold, curl)):.2f}-"
              f"{max(u / c for c, u in zip(cold, curl)):.2f}; CPU s of the last cold load: "
              f"{cpu_cold})")
        if a.rows:
            with open(a.rows, "a") as f:
                for r in rows:
                    f.write("%s\t%.6g\t%s\t%.6g\t%s\t%.6g\t%s\t%s\n" % r)
    finally:
        d.stop()


if __name__ == "__main__":
    main()
