#!/usr/bin/env python3
"""bench/scale.py -- multi-node ckptd at scale on one machine (issue 34).

N real daemons on loopback addresses (127.0.0.2, 127.0.0.3, ...: each its own
peer address, client socket and metrics endpoint; plaintext peers, as
loopback allows), one checkpoint on storage they all see, and per N:

  1. one load job of N x R ranks (one `ckptctl load` process running every
     rank as a thread, spread over the daemons in contiguous blocks), every
     delivered byte compared with the source; its wall time, the
     coordinator's plan time and plan parts' bytes, the bytes between the
     daemons against the checkpoint's (256 MiB) and against the bytes the
     nodes' ranks need from reads other nodes make (needed_from_peers),
     the peer calls the daemons served per job (Join, Locate, FetchReads, Complete;
     not Ping: a metrics scrape pings the peers), and per daemon after the
     job: RSS (against its cache and its idle RSS), sockets opened since it
     started (right after the job and --idle-wait s later, once idle peer
     channels closed), threads;
  2. (--kill) a second job during which one daemon (not the coordinator;
     --kill-coordinator: the coordinator) is SIGKILLed once the plan is out: how long until every rank failed, and
     whether every rank's error names the dead daemon;
  3. SIGTERM to every daemon at once: how long until all exited.

The checkpoint: 32 F32 tensors of [2048, 1024] (256 MiB) saved by 4 ranks
split on dim 0; the job loads half the tensors split on dim 0 and half on
dim 1 over all N x R ranks; reads of 2 MiB (--io-request-size). Figures are
printed per N as one row; --json FILE writes them.

  bench/scale.py --ckptd bazel-bin/server/ckptd --ckptctl bazel-bin/client/ckptctl \\
                 [--nodes 2,8,16,32] [--ranks-per-node 1] [--kill] [--workdir DIR]

The coordinator's planning alone at 1,024-4,096 nodes: bench/scale_plan
(bench/run --only scale). Runs with any python3 (standard library only).
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

TENSORS, ROWS, COLS = 32, 2048, 1024
SAVERS = 4


def names():
    return [f"layer{t // 2}.{'w2' if t % 2 else 'w1'}" for t in range(TENSORS)]


def tensor_bytes(t):
    """Tensor t's bytes: a cheap deterministic pattern (row-major F32 words)."""
    rnd = random.Random(t)
    row = bytes(rnd.getrandbits(8) for _ in range(COLS * 4))
    # Every row differs: its index in the first word.
    return b"".join(struct.pack("<I", (t << 16) | r) + row[4:] for r in range(ROWS))


def write_source(path):
    """A HuggingFace-style safetensors directory with the 32 tensors."""
    os.makedirs(path, exist_ok=True)
    header, offset = {}, 0
    nbytes = ROWS * COLS * 4
    for n in names():
        header[n] = {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for t in range(TENSORS):
            f.write(tensor_bytes(t))


def layout(world, dims):
    """Every rank a slice of every tensor: tensor t split on dims(t) over `world`."""
    ranks = []
    for r in range(world):
        ts = []
        for t, n in enumerate(names()):
            d = dims(t)
            full = [ROWS, COLS]
            assert full[d] % world == 0, (full, world)
            step = full[d] // world
            off, shape = [0, 0], list(full)
            off[d], shape[d] = r * step, step
            ts.append({"name": n, "dtype": "F32", "global_shape": full, "offset": off,
                       "shape": shape})
        ranks.append({"rank": r, "tensors": ts})
    return {"world_size": world, "ranks": ranks}


def needed_from_peers(lay, nodes):
    """The bytes the nodes' ranks need from reads another node makes: per
    planned read (a saved shard of 512 rows: 2 MiB, one read), what every
    node's ranks need of it minus the share of the node that reads it (a node
    that needs it: storage is shared, local first), taken as the largest
    share (a lower bound; the shares are equal in these layouts)."""
    per_node = len(lay["ranks"]) // nodes
    rows = ROWS // SAVERS
    total = 0
    for ti, name in enumerate(names()):
        for sv in range(SAVERS):
            r0, r1 = sv * rows, (sv + 1) * rows
            shares = []
            for n in range(nodes):
                b = 0
                for rank in lay["ranks"][n * per_node:(n + 1) * per_node]:
                    t = next(x for x in rank["tensors"] if x["name"] == name)
                    (o0, _), (s0, s1) = t["offset"], t["shape"]
                    b += max(0, min(r1, o0 + s0) - max(r0, o0)) * s1 * 4
                shares.append(b)
            total += sum(shares) - max(shares)
    return total


def check_outputs(out, lay):
    """Every rank's output file (ckptctl writes rank{r}.safetensors) against
    the source pattern, element for element (row by row)."""
    sources = {}
    for rank in lay["ranks"]:
        path = os.path.join(out, f"rank{rank['rank']}.safetensors")
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for t in rank["tensors"]:
            name = t["name"]
            ti = names().index(name)
            if ti not in sources:
                sources[ti] = tensor_bytes(ti)
            src = sources[ti]
            a, b = header[name]["data_offsets"]
            got = data[a:b]
            (r0, c0), (nr, nc) = t["offset"], t["shape"]
            want = b"".join(src[((r0 + i) * COLS + c0) * 4:((r0 + i) * COLS + c0 + nc) * 4]
                            for i in range(nr))
            if got != want:
                raise SystemExit(f"scale.py: rank {rank['rank']} tensor {name}: wrong bytes")


def free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def proc_status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = v.strip()
    except OSError:
        pass
    return out


def rss_mib(pid):
    v = proc_status(pid).get("VmRSS", "0 kB").split()[0]
    return int(v) / 1024


def cpu_s(pid):
    """User + system CPU seconds of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def threads(pid):
    return int(proc_status(pid).get("Threads", "0"))


def sockets(pid):
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    n += 1
            except OSError:
                pass
    except OSError:
        pass
    return n


class Node:
    def __init__(self, i, args, root, peers, base):
        self.i = i
        self.host = f"127.0.0.{2 + i}"
        self.peer = peers[i]
        self.dir = os.path.join(base, f"node{i}")
        os.makedirs(self.dir, exist_ok=True)
        self.socket = os.path.join(self.dir, "s")
        self.log = os.path.join(self.dir, "log")
        self.port_file = os.path.join(self.dir, "ports.json")
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)  # an earlier run's: not this daemon's ports
        cmd = [args.ckptd, "--socket", self.socket, "--root", root, "--port-file", self.port_file,
               "--peer-listen", self.peer, "--peers", ",".join(peers),
               "--metrics-address", f"{self.host}:0", "--io-request-size", "2MiB",
               "--cache-budget", args.cache_budget, "--peer-timeout", args.peer_timeout,
               "--io-threads", "1"]
        if args.reader_min_bytes is not None:
            cmd += ["--peer-reader-min-bytes", args.reader_min_bytes]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def wait_ready(self, deadline):
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"scale.py: ckptd {self.peer} did not start:\n{self.read_log()[-2000:]}")
            time.sleep(0.02)
        with open(self.port_file) as f:
            self.metrics = json.load(f)["metrics"]

    def read_log(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def scrape(self):
        """ckptd_peer_rpcs_total by rpc, and ckptd's own cache gauge."""
        text = urllib.request.urlopen(f"http://{self.host}:{self.metrics}/metrics", timeout=10).read().decode()
        rpcs = {m.group(1): float(m.group(2))
                for m in re.finditer(r'^ckptd_peer_rpcs_total\{rpc="(\w+)"\} (\S+)$', text, re.M)}
        cache = re.search(r"^ckptd_cache_bytes (\S+)$", text, re.M)
        return rpcs, float(cache.group(1)) if cache else 0.0


def job_line(node, job, key):
    m = re.search(rf"load job={re.escape(job)} .*?{key}=(\d+)B", node.read_log())
    return int(m.group(1)) if m else 0


def run_n(args, n, root, lay_path, lay, base):
    peers = []
    for i in range(n):
        host = f"127.0.0.{2 + i}"
        peers.append(f"{host}:{free_port(host)}")
    nodes = [Node(i, args, root, peers, base) for i in range(n)]
    row = {"nodes": n, "ranks": n * args.ranks_per_node}
    try:
        deadline = time.monotonic() + 60
        for nd in nodes:
            nd.wait_ready(deadline)
        time.sleep(0.5)
        idle = [rss_mib(nd.proc.pid) for nd in nodes]
        sockets_idle = [sockets(nd.proc.pid) for nd in nodes]
        out = os.path.join(base, "out")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [args.ckptctl, "load", "ckpt", "--layout", lay_path, "--out", out, "--daemon",
               ",".join(nd.socket for nd in nodes), "--job-id", "scale", "--json"]
        cpu0 = sum(cpu_s(nd.proc.pid) for nd in nodes)
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.job_timeout)
        row["wall_s"] = round(time.monotonic() - t0, 3)
        row["daemons_cpu_s"] = round(sum(cpu_s(nd.proc.pid) for nd in nodes) - cpu0, 2)
        if p.returncode != 0:
            raise SystemExit(f"scale.py: N={n}: the job failed:\n{p.stderr[-3000:]}\n"
                             f"{nodes[0].read_log()[-3000:]}")
        check_outputs(out, lay)
        shutil.rmtree(out, ignore_errors=True)
        if args.again:
            # The same load again at once: channels between the daemons are
            # open and the data caches warm (a restarted job's second try).
            cpu1 = sum(cpu_s(nd.proc.pid) for nd in nodes)
            t1 = time.monotonic()
            p2 = subprocess.run(cmd[:-3] + ["--job-id", "again"], capture_output=True, text=True,
                                timeout=args.job_timeout)
            row["again_wall_s"] = round(time.monotonic() - t1, 3)
            row["again_daemons_cpu_s"] = round(sum(cpu_s(nd.proc.pid) for nd in nodes) - cpu1, 2)
            if p2.returncode != 0:
                raise SystemExit(f"scale.py: N={n}: the second job failed:\n{p2.stderr[-3000:]}")
            shutil.rmtree(out, ignore_errors=True)
        coord = re.search(r"coordinator job=scale .*? plan=([\d.]+)s parts=(\d+)B", nodes[0].read_log())
        row["plan_s"] = float(coord.group(1)) if coord else None
        row["parts_bytes"] = int(coord.group(2)) if coord else None
        moved = sum(job_line(nd, "scale", "from_peers") for nd in nodes)
        needed = needed_from_peers(lay, n)
        row["peer_bytes_over_checkpoint"] = round(moved / (TENSORS * ROWS * COLS * 4), 3)
        row["peer_bytes_over_needed"] = round(moved / needed, 3) if needed else None
        time.sleep(0.3)
        # Sockets, threads and RSS before any scrape (a scrape pings peers).
        rss = [rss_mib(nd.proc.pid) for nd in nodes]
        socks = [sockets(nd.proc.pid) - s0 for nd, s0 in zip(nodes, sockets_idle)]
        nthreads = max(threads(nd.proc.pid) for nd in nodes)
        row["new_sockets_median_max"] = [sorted(socks)[len(socks) // 2], max(socks)]
        row["threads_max"] = nthreads
        if args.idle_wait > 0:
            # Peer channels close 10-20 s after their last call.
            time.sleep(args.idle_wait)
            socks_idle = [sockets(nd.proc.pid) - s0 for nd, s0 in zip(nodes, sockets_idle)]
            row["new_sockets_after_idle_max"] = max(socks_idle)
            row["rss_after_idle_mib_max"] = round(max(rss_mib(nd.proc.pid) for nd in nodes))
        # Last: a scrape pings the daemon's peers (opens channels).
        after = [nd.scrape() for nd in nodes]
        calls = {}
        for now, _ in after:
            for k, v in now.items():
                if k != "Ping":  # scrapes ping; the job's own pings are few
                    calls[k] = calls.get(k, 0) + int(v)
        jobs = 2 if args.again else 1
        row["peer_calls_per_job"] = {k: v / jobs for k, v in calls.items()}
        over = [r - i - c / 2**20 for r, i, (_, c) in zip(rss, idle, after)]
        row["rss_mib_median_max"] = [round(sorted(rss)[len(rss) // 2]), round(max(rss))]
        row["rss_over_idle_and_cache_mib_max"] = round(max(over), 1)
        if args.kill and n >= 3:
            # A daemon in the middle, or (--kill-coordinator) the coordinator.
            victim = nodes[0] if args.kill_coordinator else nodes[n // 2]
            t0 = time.monotonic()
            # No retries: the dead daemon's own ranks would wait for it to come
            # back (a restart, CKPTD_RETRY_TIMEOUT); the figure is how fast the
            # other daemons fail theirs.
            env = dict(os.environ, CKPTD_RETRY_TIMEOUT="0")
            pk = subprocess.Popen(cmd[:-3] + ["--job-id", "killed"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
            while "coordinator job=killed" not in nodes[0].read_log():
                if time.monotonic() - t0 > 60 or pk.poll() is not None:
                    break
                time.sleep(0.005)
            victim.proc.kill()
            tk = time.monotonic()
            _, err = pk.communicate(timeout=args.job_timeout)
            row["kill_fail_s"] = round(time.monotonic() - tk, 2)
            errors = [l for l in err.splitlines() if "error: rank" in l]
            row["kill_ranks_failed"] = len(errors)
            row["kill_ranks_naming_dead_node"] = sum(victim.peer in l for l in errors)
            if args.verbose:
                print(err[-4000:], file=sys.stderr)
            if pk.returncode == 0:
                row["kill_note"] = "the job finished before the kill"
    finally:
        t0 = time.monotonic()
        for nd in nodes:
            if nd.proc.poll() is None:
                nd.proc.send_signal(signal.SIGTERM)
        for nd in nodes:
            try:
                nd.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                nd.proc.kill()
                nd.proc.wait()
        row["sigterm_all_exit_s"] = round(time.monotonic() - t0, 2)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckptd", required=True)
    ap.add_argument("--ckptctl", required=True)
    ap.add_argument("--nodes", default="2,8,16,32")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--kill", action="store_true", help="also kill one daemon during a job")
    ap.add_argument("--kill-coordinator", action="store_true",
                    help="with --kill: the daemon killed is the job's coordinator")
    ap.add_argument("--again", action="store_true",
                    help="also the same load again at once (channels open, caches warm)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-budget", default="4GiB")
    ap.add_argument("--reader-min-bytes", default=None,
                    help="the daemons' --peer-reader-min-bytes (default: theirs, 64MiB); "
                         "0: every node reads a share of the reads all nodes need")
    ap.add_argument("--peer-timeout", default="10s")
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true", help="print the killed job's errors")
    ap.add_argument("--idle-wait", type=float, default=22,
                    help="seconds to wait after the job before counting sockets again (0: not)")
    args = ap.parse_args()
    args.ckptd, args.ckptctl = os.path.abspath(args.ckptd), os.path.abspath(args.ckptctl)
    base = args.workdir or tempfile.mkdtemp(prefix="ckptd-scale-")
    root = os.path.join(base, "root")
    os.makedirs(root, exist_ok=True)
    ckpt = os.path.join(root, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "0.metadata")):
        src = os.path.join(base, "src")
        write_source(src)
        save = os.path.join(base, "save4.json")
        with open(save, "w") as f:
            json.dump(layout(SAVERS, lambda t: 0), f)
        subprocess.run([args.ckptctl, "shard", src, "--layout", save, "--out", ckpt], check=True,
                       stdout=subprocess.DEVNULL)
        shutil.rmtree(src)
    rows = []
    try:
        for n in [int(x) for x in args.nodes.split(",")]:
            world = n * args.ranks_per_node
            lay = layout(world, lambda t: t % 2)
            lay_path = os.path.join(base, f"load{world}.json")
            with open(lay_path, "w") as f:
                json.dump(lay, f)
            row = run_n(args, n, root, lay_path, lay, base)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
