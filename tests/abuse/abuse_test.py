"""Abuse suite (issue 14, "Hardening I"): hostile and buggy local clients
against a real ckptd daemon.

One daemon (AbuseTest.daemon) serves every case; an 8-rank load of a bundled
checkpoint runs in a background thread the whole time (AlongsideLoader) and
is checked byte-exact against testlib's independent numpy safetensors
reader. After every case (tearDown) the daemon must still run with the same
PID, the loader must have finished two more loads since the case began, all
byte-exact, and no RPC may have ended UNKNOWN (nor INTERNAL: an escaped
exception). A daemon that died is restarted so the later cases still say
something.

Hostile clients are raw gRPC stubs (ckpt_pb2 / ckpt_pb2_grpc), raw fd-socket
messages (socket.send_fds, os.memfd_create, fcntl seals), and, for another
uid, peer.py run under `setpriv --reuid 65534 --regid 65534 --clear-groups`
(needs root; otherwise those cases are skipped with the reason).

The daemon runs with RLIMIT_AS 8 GiB (the "memory limit" of the issue;
$CKPTD_ABUSE_AS overrides it; not under AddressSanitizer, whose shadow
memory alone reserves terabytes of address space, so there the allocation
abuses run without the cap and ASan's own checks):
the allocation abuses (a 1 TiB sparse memfd, a [2^42] stream target) must
not take it down, and an old daemon that tries to MAP_POPULATE 1 TiB fails
that mmap instead of taking the machine's memory.
"""
import errno
import fcntl
import json
import mmap
import os
import random
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import ckptd
from ckptd import _proto
import testlib

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = testlib.runfile("examples")
OTHER_UID = 65534
WORLD = 8                      # ranks of the alongside load
# RLIMIT_AS of every daemon (0: none, under AddressSanitizer: see the docstring).
AS_LIMIT = 0 if "ASAN_OPTIONS" in os.environ else int(os.environ.get("CKPTD_ABUSE_AS", str(8 << 30)))
MAX_RANKS_PER_UID = 64         # limits.max_ranks_per_uid of the main daemon
MAX_JOBS_PER_UID = 16          # limits.max_jobs_per_uid of the main daemon
FLOOD = int(os.environ.get("CKPTD_ABUSE_FLOOD", "10000"))  # waiting Loads of case 5
KILL_ITERATIONS = int(os.environ.get("CKPTD_ABUSE_KILLS", "10"))  # case 12
BAD_CODES = ("UNKNOWN", "INTERNAL")  # an exception escaped a handler: a daemon bug

pb2, pb2_grpc = _proto.load_stubs()
import grpc  # noqa: E402  (after the stubs, like the client)

_BAD_SEEN = []  # (where, code, details) of every UNKNOWN / INTERNAL answer


def note_code(where, code, details):
    if code in BAD_CODES:
        _BAD_SEEN.append((where, code, details))


# --- the daemon ---------------------------------------------------------------------

class Daemon(testlib.Daemon):
    """ckptd with --config (and RLIMIT_AS), its sockets in a directory any uid
    can traverse (the other-uid cases connect too)."""

    def __init__(self, config, *extra):
        self.dir = tempfile.mkdtemp(prefix="ckptd-abuse-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "ckptd.sock")
        self.log = os.path.join(testlib._log_dir(), f"ckptd-abuse-{os.getpid()}-"
                                                    f"{len(testlib._LOGS)}.log")
        testlib._LOGS.append(self.log)
        self.root = None

        def limit():
            if AS_LIMIT:
                resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [os.path.abspath(testlib.CKPTD), "--config", config, "--socket", self.socket,
                 *extra], stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
        deadline = time.monotonic() + 20
        while not (os.path.exists(self.socket) and os.path.exists(self.socket + ".fd")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ckptd did not start: {self.read_log()[-3000:]}")
            time.sleep(0.01)
        self.pid = self.proc.pid
        self.channel = grpc.insecure_channel("unix:" + self.socket, options=[
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20)])
        self.stub = pb2_grpc.CkptdStub(self.channel)

    def alive(self):
        if self.proc.poll() is not None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def death(self):
        """How the daemon ended ("signal 7 (SIGBUS)", "exit 1"), or None."""
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0:
            return f"signal {-rc} ({signal.Signals(-rc).name})"
        return f"exit {rc}"

    def rss(self):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def memory(self):
        """VmPeak / VmHWM / VmRSS / Threads of the daemon, as text."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return " ".join(" ".join(line.split()) for line in f
                                if line.split(":")[0] in ("VmPeak", "VmHWM", "VmRSS", "Threads"))
        except OSError as e:
            return str(e)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        self.channel.close()
        return super().stop()


def write_config(path, roots, extra=""):
    lines = ["roots:"] + [f"  - {json.dumps(r)}" for r in roots]
    lines += ['socket_mode: "0666"', "cache_budget: 256MiB", "arena_pool: 256MiB",
              "arena_limit: 4GiB", "barrier_timeout: 60s"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + extra)


# --- raw clients --------------------------------------------------------------------

class Rpc:
    """The outcome of one raw RPC: code name, details, response / events."""

    def __init__(self, code, details, value=None, events=()):
        self.code, self.details, self.value, self.events = code, details, value, list(events)

    @property
    def result(self):
        for ev in self.events:
            if ev.WhichOneof("event") == "result":
                return ev.result
        return None

    def __repr__(self):
        return f"{self.code}: {self.details!r}"


def call(where, fn, *args, **kw):
    try:
        value = fn(*args, **kw)
        return Rpc("OK", "", value)
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
        note_code(where, code, details)
        return Rpc(code, details)


def raw_load(stub, req, timeout=30.0):
    events = []
    try:
        for ev in stub.Load(req, timeout=timeout):
            events.append(ev)
        return Rpc("OK", "", None, events)
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
        note_code("Load " + req.job_id, code, details)
        return Rpc(code, details, None, events)


class AsyncLoad(threading.Thread):
    """A raw Load in a thread; `registered` is set at its first event (the
    daemon sends "registered rank ..." once the rank waits at the barrier)."""

    def __init__(self, stub, req, timeout=60.0):
        super().__init__(daemon=True)
        self.stub, self.req, self.timeout = stub, req, timeout
        self.registered = threading.Event()
        self.rpc = None
        self._call = None

    def run(self):
        events = []
        try:
            self._call = self.stub.Load(self.req, timeout=self.timeout)
            for ev in self._call:
                events.append(ev)
                self.registered.set()
            self.rpc = Rpc("OK", "", None, events)
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
            note_code("Load " + self.req.job_id, code, details)
            self.rpc = Rpc(code, details, None, events)
        self.registered.set()

    def cancel(self):
        if self._call is not None:
            self._call.cancel()

    def wait(self, timeout=60.0):
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"Load {self.req.job_id} rank {self.req.rank} did not end "
                                 f"within {timeout} s")
        return self.rpc


def target(name, dtype, global_shape, offset=None, shape=None, dest_offset=0):
    global_shape = [int(d) for d in global_shape]
    return pb2.Target(name=name, dtype=dtype, global_shape=global_shape,
                      offset=list(offset) if offset is not None else [0] * len(global_shape),
                      shape=list(shape) if shape is not None else global_shape,
                      dest_offset=int(dest_offset))


def memfd(size, allow_sealing=True, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if allow_sealing else 0)
    fd = os.memfd_create("ckptd-abuse", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def fd_request(fd_socket, payload, fds=(), timeout=5.0):
    """One fd-socket request: (reply text, received fds, the connection)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    s.connect(fd_socket)
    try:
        if fds:
            socket.send_fds(s, [payload], list(fds))
        else:
            s.send(payload)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before reading: the reply is queued
    got = []
    for attempt in (0, 1):
        try:
            msg, got, _, _ = socket.recv_fds(s, 512, 1)
            break
        except ConnectionResetError:
            if attempt:
                msg = b""
    return msg.decode("ascii", "replace"), got, s


def send_fd(fd_socket, fd, timeout=5.0):
    """(reply, token) for handing `fd` over with a fresh token."""
    token = os.urandom(16).hex()
    reply, got, s = fd_request(fd_socket, token.encode(), [fd], timeout=timeout)
    s.close()
    for f in got:
        os.close(f)
    return reply, token


def alloc(fd_socket, size, timeout=5.0):
    """(reply, fd, token, size, lease socket) of an "ALLOC"."""
    reply, got, s = fd_request(fd_socket, f"ALLOC {int(size)}".encode(), timeout=timeout)
    parts = reply.split()
    if len(parts) == 3 and parts[0] == "OK" and len(got) == 1:
        return reply, got[0], parts[1], int(parts[2]), s
    for f in got:
        os.close(f)
    s.close()
    return reply, None, None, 0, None


def tensor_bytes(ref, name):
    return ref[name][1].tobytes()


# --- the 8-rank load running alongside ----------------------------------------------

def split_box(shape, dim, world, r):
    off, shp = [0] * len(shape), list(shape)
    chunk = shape[dim] // world
    off[dim], shp[dim] = r * chunk, chunk
    return tuple(off), tuple(shp)


class AlongsideLoader(threading.Thread):
    """Repeated 8-rank loads of the bundled tiny model (sharded 4 ways by
    `ckptctl shard`, so every load reshards), each rank its slices of every
    tensor (2-D tensors split on dim 0 or 1 alternately), even ranks through
    shared memory, odd ranks through the gRPC stream; every byte checked
    against the numpy reader. Uses the daemon the test class holds now."""

    def __init__(self, owner):
        super().__init__(daemon=True, name="alongside-loader")
        self.owner = owner
        self.cv = threading.Condition()
        self.completed = 0        # loads finished and checked byte-exact
        self.attempts = 0
        self.errors = []          # (attempt, seconds since start, text)
        self.stopping = threading.Event()
        self.t0 = time.monotonic()
        self.layout = {}
        for i, (name, (dt, a)) in enumerate(sorted(owner.ref.items())):
            dim = None if a.ndim == 0 else (i % a.ndim)
            self.layout[name] = (dt, a, dim)

    def rank_dict(self, r):
        sd, want = {}, {}
        for name, (dt, a, dim) in self.layout.items():
            if dim is None:
                off, shp = (), ()
            else:
                off, shp = split_box(a.shape, dim, WORLD, r)
            sl = tuple(slice(o, o + s) for o, s in zip(off, shp))
            want[name] = a[sl]
            local = np.zeros(shp, a.dtype)
            sd[name] = ckptd.ShardedTensor(local, a.shape, off,
                                           dtype="BF16" if dt == "BF16" else None)
        return sd, want

    def one_load(self, sock, n):
        job = f"alongside-{os.getpid()}-{n}"
        errors, threads = [], []

        def rank(r):
            try:
                sd, want = self.rank_dict(r)
                rep = ckptd.load_state_dict(
                    sd, self.owner.along, rank=r, world_size=WORLD, job_id=job, socket=sock,
                    timeout=60, transport="stream" if r % 2 else "auto")
                if rep.missing_keys:
                    errors.append(f"rank {r}: missing {rep.missing_keys}")
                for name, w in want.items():
                    got = sd[name].local
                    if got.shape != w.shape or got.tobytes() != w.tobytes():
                        errors.append(f"rank {r}: '{name}' is not byte-exact")
            except ckptd.CkptdError as e:
                note_code(f"alongside load {job} rank {r}", e.code, e.message)
                errors.append(f"rank {r}: {e.code}: {e.message}")
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"rank {r}: {type(e).__name__}: {e}")

        for r in range(WORLD):
            t = threading.Thread(target=rank, args=(r,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(90)
            if t.is_alive():
                errors.append("a rank did not finish within 90 s")
                break
        return errors

    def run(self):
        n = 0
        while not self.stopping.is_set():
            sock = self.owner.daemon.socket
            errors = self.one_load(sock, n)
            with self.cv:
                self.attempts += 1
                if errors:
                    self.errors.append((n, round(time.monotonic() - self.t0, 2),
                                        "; ".join(errors[:4])))
                else:
                    self.completed += 1
                self.cv.notify_all()
            n += 1
            self.stopping.wait(0.02)

    def mark(self):
        with self.cv:
            return self.completed, len(self.errors)

    def wait_for(self, completed, timeout=60.0):
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.completed < completed and time.monotonic() < deadline:
                self.cv.wait(0.5)
            return self.completed >= completed

    def stop(self):
        self.stopping.set()
        self.join(120)


# --- the suite ----------------------------------------------------------------------

class AbuseTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.base = tempfile.mkdtemp(prefix="ckptd-abuse-roots-", dir="/tmp")
        testlib._CLEANUP.append(cls.base)
        os.chmod(cls.base, 0o755)
        cls.root = os.path.join(cls.base, "private")   # default access rule
        cls.shared = os.path.join(cls.base, "shared")  # uid 65534 may read
        cls.outside = os.path.join(cls.base, "outside")  # no root at all
        cls.savable = os.path.join(cls.base, "savable")  # uid 65534 may save (access rule)
        for d in (cls.root, cls.shared, cls.outside, cls.savable):
            os.makedirs(d)
            os.chmod(d, 0o755)
        cls.hf = os.path.join(cls.root, "hf")
        shutil.copytree(os.path.join(EXAMPLES, "tiny-model"), cls.hf)
        cls.ref = testlib.read_safetensors(os.path.join(cls.hf, "model.safetensors"))
        cls.tp2 = os.path.join(cls.root, "tp2")
        cls.along = os.path.join(cls.root, "alongside-tp4")
        for out, layout in ((cls.tp2, "layout-tp2.json"), (cls.along, "layout-tp4-dim0.json")):
            subprocess.run([testlib.CKPTCTL, "shard", cls.hf, "--layout",
                            os.path.join(EXAMPLES, layout), "--out", out, "--unique_id", "5"],
                           check=True, stdout=subprocess.DEVNULL)
        cls.shared_tp2 = os.path.join(cls.shared, "tp2")
        shutil.copytree(cls.tp2, cls.shared_tp2)
        for dirpath, dirs, files in os.walk(cls.base):
            for d in dirs:
                os.chmod(os.path.join(dirpath, d), 0o755)
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644)
        cls.config = os.path.join(cls.base, "ckptd.yaml")
        write_config(cls.config, [cls.root, cls.shared, cls.savable], extra=(
            "limits:\n"
            f"  max_ranks_per_uid: {MAX_RANKS_PER_UID}\n"
            f"  max_jobs_per_uid: {MAX_JOBS_PER_UID}\n"
            "access:\n"
            f"  - root: {json.dumps(cls.shared)}\n"
            f"    read_uids: [{OTHER_UID}]\n"
            f"  - root: {json.dumps(cls.savable)}\n"
            f"    save_uids: [{OTHER_UID}]\n"))
        cls.daemon = Daemon(cls.config)
        cls.restarts = []
        cls.other_uid_problem = cls.probe_other_uid()
        cls.loader = AlongsideLoader(cls)
        cls.loader.start()
        if not cls.loader.wait_for(1, 60):
            raise RuntimeError(f"the alongside load never succeeded: {cls.loader.errors[:3]}\n"
                               f"{cls.daemon.read_log()[-3000:]}")
        cls.counter = 0

    @classmethod
    def tearDownClass(cls):
        cls.loader.stop()
        mem = cls.daemon.memory()
        rc = cls.daemon.stop()
        print(f"\nalongside loader: {cls.loader.completed} byte-exact 8-rank loads, "
              f"{len(cls.loader.errors)} failed; daemon restarts: {cls.restarts}; daemon "
              f"memory at the end: {mem}", file=sys.stderr)
        assert rc == 0, f"ckptd exited {rc} at SIGTERM"

    # --- per-case checks ---

    def setUp(self):
        if not self.daemon.alive():  # died in an earlier case: a fresh one
            type(self).daemon = Daemon(self.config)
        self.pid = self.daemon.pid
        self.loader_mark = self.loader.mark()
        self.bad_mark = len(_BAD_SEEN)
        self.cleanups = []

    def tearDown(self):
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort
                pass
        problems = []
        if not self.daemon.alive() or self.daemon.pid != self.pid:
            problems.append(f"the daemon (pid {self.pid}) died: {self.daemon.death()}; log tail:\n"
                            f"{self.daemon.read_log()[-2500:]}")
            type(self).restarts.append((self.id().rsplit(".", 1)[-1], self.daemon.death()))
            self.daemon.stop()
            type(self).daemon = Daemon(self.config)
        else:
            done, _ = self.loader_mark
            if not self.loader.wait_for(done + 2, 60):
                problems.append("the alongside 8-rank load made no progress during the case "
                                f"({self.loader.completed - done} loads in 60 s)")
        with self.loader.cv:
            errs = self.loader.errors[self.loader_mark[1]:]
        if errs:
            problems.append(f"the alongside 8-rank load failed {len(errs)} times during the "
                            f"case, first: {errs[0]}")
        bad = _BAD_SEEN[self.bad_mark:]
        if bad:
            problems.append(f"{len(bad)} RPCs ended {bad[0][1]} (an exception escaped a "
                            f"handler), first: {bad[0]}")
        if problems:
            self.fail("\n".join(problems))

    # --- helpers ---

    def job(self, what):
        type(self).counter += 1
        return f"abuse-{what}-{os.getpid()}-{self.counter}"

    @property
    def stub(self):
        return self.daemon.stub

    @property
    def fd_socket(self):
        return self.daemon.socket + ".fd"

    def assertRpc(self, rpc, code, *needles, what=""):
        """rpc ended with `code` and its message names every needle (any of a
        tuple's alternatives)."""
        self.assertNotIn(rpc.code, BAD_CODES, f"{what}: {rpc}")
        self.assertEqual(rpc.code, code, f"{what}: expected {code}, got {rpc}")
        for n in needles:
            alts = n if isinstance(n, tuple) else (n,)
            self.assertTrue(any(a in rpc.details for a in alts),
                            f"{what}: the message should mention {' or '.join(map(repr, alts))}: "
                            f"{rpc.details!r}")

    def assertRaisesCode(self, code, fn, *needles, what=""):
        try:
            fn()
        except ckptd.CkptdError as e:
            note_code(what, e.code, e.message)
            self.assertRpc(Rpc(e.code, e.message), code, *needles, what=what)
            return e
        self.fail(f"{what}: succeeded; expected {code}")

    def load_req(self, path, targets, job=None, rank=0, world=1, **kw):
        req = pb2.LoadRequest(job_id=job or self.job("load"), rank=rank, world_size=world,
                              path=path, targets=targets, **kw)
        return req

    def stream_load(self, path, targets, **kw):
        req = self.load_req(path, targets, **kw)
        req.stream.SetInParent()
        return raw_load(self.stub, req, timeout=kw.get("barrier_timeout_ms", 30000) / 1000 + 30)

    def full_state_dict(self):
        sd = {}
        for name, (dt, a) in self.ref.items():
            sd[name] = ckptd.ShardedTensor(np.zeros(a.shape, a.dtype), a.shape,
                                           dtype="BF16" if dt == "BF16" else None)
        return sd

    def assertStateDict(self, sd, ref=None):
        ref = ref or self.ref
        for name, (dt, a) in ref.items():
            got = sd[name].local
            self.assertEqual(got.tobytes(), a.tobytes(), f"'{name}' is not byte-exact")

    def copy_ckpt(self, src, name):
        dst = os.path.join(os.path.dirname(src), name)
        shutil.copytree(src, dst)
        return dst

    def fd_load_into(self, fd, size, names, path=None, job=None, rank=0, world=1, **kw):
        """A raw Load of whole tensors `names` laid out back to back in the
        memfd `fd` (sent with a fresh token). Returns (rpc, {name: offset})."""
        reply, token = send_fd(self.fd_socket, fd)
        self.assertTrue(reply.startswith("OK"), f"the fd socket refused a sealed memfd: {reply}")
        offsets, pos, targets = {}, 0, []
        for n in names:
            dt, a = self.ref[n]
            offsets[n] = pos
            targets.append(target(n, dt, a.shape, dest_offset=pos))
            pos += (a.nbytes + 63) // 64 * 64
        req = self.load_req(path or self.tp2, targets, job=job, rank=rank, world=world, **kw)
        req.shm.fd_token, req.shm.size = token, size
        return req, offsets

    def need_other_uid(self):
        if self.other_uid_problem is None:
            return
        kind, why = self.other_uid_problem
        if kind == "skip":
            self.skipTest(why)
        self.fail(why)

    @classmethod
    def probe_other_uid(cls):
        """None when peer.py can run as uid 65534, else ("skip"|"fail", why)."""
        if os.geteuid() != 0:
            return ("skip", f"the other-uid cases need root to switch to uid {OTHER_UID} with "
                            f"setpriv (running as uid {os.geteuid()}) [needs: root]")
        cls.peer_dir = os.path.join(cls.base, "peer")
        os.makedirs(cls.peer_dir)
        os.chmod(cls.peer_dir, 0o755)
        for src in (os.path.join(HERE, "peer.py"), pb2.__file__, pb2_grpc.__file__):
            dst = os.path.join(cls.peer_dir, os.path.basename(src))
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o644)
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        cls.setpriv = [setpriv, "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID),
                       "--clear-groups"]
        p = subprocess.run(cls.setpriv + ["/usr/bin/python3", "-c",
                                          "import os, grpc, ckpt_pb2, ckpt_pb2_grpc; "
                                          "print(os.getuid(), os.getgid(), os.getgroups())"],
                           cwd=cls.peer_dir, env=cls.peer_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
        if p.returncode != 0 or not p.stdout.startswith(f"{OTHER_UID} {OTHER_UID} []"):
            return ("fail", f"cannot run a client as uid {OTHER_UID} with {' '.join(cls.setpriv)} "
                            f"(exit {p.returncode}): {p.stdout.strip()[-800:]}")
        return None

    @classmethod
    def peer_env(cls):
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": cls.peer_dir, "HOME": cls.peer_dir,
                "PYTHONDONTWRITEBYTECODE": "1"}

    def peer_spec(self, spec):
        type(self).counter += 1
        path = os.path.join(self.peer_dir, f"spec-{self.counter}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        os.chmod(path, 0o644)
        return path

    def peer_calls(self, calls, timeout=120, socket=None):
        """Runs `calls` (peer.py) as uid 65534 against the suite's daemon (or
        the one at `socket`); one result dict per call."""
        spec = self.peer_spec({"socket": socket or self.daemon.socket, "calls": calls})
        p = subprocess.run(self.setpriv + ["/usr/bin/python3", "peer.py", "calls", spec],
                           cwd=self.peer_dir, env=self.peer_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=timeout)
        self.assertEqual(p.returncode, 0, f"peer.py failed: {p.stderr[-2000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        for c, r in zip(calls, out):
            note_code(f"uid {OTHER_UID} {c.get('rpc', 'memfd')}", r["code"], r["details"])
        return [Rpc(r["code"], r["details"], r) for r in out]

    def status(self):
        r = call("Status", self.stub.Status, pb2.StatusRequest(), timeout=10)
        self.assertEqual(r.code, "OK", f"Status: {r}")
        return r.value

    def status_jobs(self):
        return {j.job_id: j for j in self.status().jobs}

    # === 1. memfds that can shrink under the daemon =================================

    def test_01_unsealed_memfd_refused(self):
        """Memfds the client could shrink are refused on the fd socket, naming
        F_SEAL_SHRINK; if one got through, the Load is INVALID_ARGUMENT and
        truncating it before the copies does not kill the daemon (SIGBUS)."""
        names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
        size = 64 << 10
        variants = [
            ("a memfd without MFD_ALLOW_SEALING", dict(allow_sealing=False, seals=0)),
            ("a memfd with MFD_ALLOW_SEALING and no seals", dict(seals=0)),
            ("a memfd sealed with F_SEAL_GROW only", dict(seals=fcntl.F_SEAL_GROW)),
        ]
        for what, kw in variants:
            if not self.daemon.alive():
                break  # killed by an earlier variant: tearDown reports it
            with self.subTest(what):
                fd = memfd(size, **kw)
                try:
                    reply, token = send_fd(self.fd_socket, fd)
                    if not reply.startswith("OK"):
                        self.assertTrue(reply.startswith("ERR"), f"{what}: reply {reply!r}")
                        self.assertIn("F_SEAL_SHRINK", reply, f"{what}: reply {reply!r}")
                        # The Python client raises with the daemon's reason.
                        with self.assertRaises(ckptd.CkptdError) as cm:
                            ckptd._shm.send_fd(self.fd_socket, fd)
                        self.assertIn("F_SEAL_SHRINK", str(cm.exception))
                        continue
                    # Accepted on the fd socket: the Load must refuse it, and a
                    # truncation while rank 0 waits must not kill the daemon.
                    job = self.job("unsealed")
                    targets, pos = [], 0
                    for n in names:
                        dt, a = self.ref[n]
                        targets.append(target(n, dt, a.shape, dest_offset=pos))
                        pos += a.nbytes
                    req = self.load_req(self.tp2, targets, job=job, rank=0, world=2,
                                        barrier_timeout_ms=5000)
                    req.shm.fd_token, req.shm.size = token, size
                    r0 = AsyncLoad(self.stub, req, timeout=30)
                    r0.start()
                    r0.registered.wait(10)
                    os.ftruncate(fd, 0)  # allowed: it is not sealed
                    sd = {n: np.zeros(self.ref[n][1].shape, self.ref[n][1].dtype) for n in names}
                    try:
                        ckptd.load_state_dict(sd, self.tp2, rank=1, world_size=2, job_id=job,
                                              socket=self.daemon.socket, timeout=30,
                                              barrier_timeout=3)
                    except ckptd.CkptdError as e:
                        note_code("rank 1", e.code, e.message)
                    rpc = r0.wait(40)
                    self.assertTrue(self.daemon.alive(),
                                    f"{what}: the daemon died ({self.daemon.death()}) after the "
                                    "client truncated its segment under a load")
                    self.assertRpc(rpc, "INVALID_ARGUMENT", "F_SEAL_SHRINK",
                                   what=f"{what}: accepted on the fd socket ({reply!r}), then Load")
                finally:
                    os.close(fd)
        if not self.daemon.alive():
            return
        # Not a memfd at all: refused too (never mapped).
        r, w = os.pipe()
        s1, s2 = socket.socketpair()
        try:
            for what, fd in (("a pipe", r), ("a socket", s1.fileno())):
                with self.subTest(what):
                    reply, _ = send_fd(self.fd_socket, fd)
                    self.assertTrue(reply.startswith("ERR"), f"{what}: reply {reply!r}")
        finally:
            for f in (r, w):
                os.close(f)
            s1.close()
            s2.close()

    def test_02_sealed_memfd_cannot_shrink_while_load_waits(self):
        """A sealed memfd: ftruncate fails with EPERM while rank 0 waits at the
        barrier, and the load then completes byte-exact."""
        names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
                 "model.embed_tokens.weight"]
        size = 128 << 10
        fd = memfd(size)
        self.cleanups.append(lambda: os.close(fd))
        mm = mmap.mmap(fd, size)
        self.cleanups.append(mm.close)
        job = self.job("sealed")
        req, offsets = self.fd_load_into(fd, size, names, job=job, rank=0, world=2,
                                         barrier_timeout_ms=30000)
        r0 = AsyncLoad(self.stub, req, timeout=60)
        r0.start()
        self.assertTrue(r0.registered.wait(10), "rank 0 never registered")
        self.assertIsNone(r0.rpc, f"rank 0 ended before rank 1 came: {r0.rpc}")
        for new_size, what in ((0, "shrink"), (size // 2, "shrink"), (size * 2, "grow")):
            with self.assertRaises(OSError, msg=f"ftruncate({new_size}) ({what})") as cm:
                os.ftruncate(fd, new_size)
            self.assertEqual(cm.exception.errno, errno.EPERM)
        sd = self.full_state_dict()
        ckptd.load_state_dict(sd, self.tp2, rank=1, world_size=2, job_id=job,
                              socket=self.daemon.socket, timeout=60)
        rpc = r0.wait(60)
        self.assertRpc(rpc, "OK", what="rank 0 (sealed memfd)")
        for n in names:
            b = tensor_bytes(self.ref, n)
            self.assertEqual(mm[offsets[n]:offsets[n] + len(b)], b, f"'{n}' in the memfd")
        self.assertStateDict(sd)

    # === 2. lent arenas =============================================================

    def test_03_lent_arena_is_sealed(self):
        """An arena from "ALLOC" is sealed F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL:
        the client cannot truncate it under the daemon."""
        reply, fd, token, size, lease = alloc(self.fd_socket, 100000)
        self.assertIsNotNone(fd, f"ALLOC refused: {reply!r}")
        self.cleanups.append(lease.close)
        self.cleanups.append(lambda: os.close(fd))
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        self.assertEqual(seals & want, want, f"arena seals {seals:#x}")
        for new_size in (0, size // 2, size * 2):
            with self.assertRaises(OSError, msg=f"ftruncate({new_size}) of a lent arena") as cm:
                os.ftruncate(fd, new_size)
            self.assertEqual(cm.exception.errno, errno.EPERM)
        with self.assertRaises(OSError) as cm:  # nor can the seals be changed
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        self.assertEqual(cm.exception.errno, errno.EPERM)
        # The arena still works for loads.
        mm = mmap.mmap(fd, size)
        self.cleanups.append(mm.close)
        n = "model.layers.1.mlp.up_proj.weight"
        dt, a = self.ref[n]
        req = self.load_req(self.tp2, [target(n, dt, a.shape, dest_offset=4096)])
        req.shm.arena_token, req.shm.size = token, size
        self.assertRpc(raw_load(self.stub, req), "OK", what="Load into the arena")
        self.assertEqual(mm[4096:4096 + a.nbytes], a.tobytes())

    # === 3. request-sized allocations ==================================================

    def test_04_huge_stream_target(self):
        """A stream Load of a [2^42] U8 target that is not in the checkpoint is
        RESOURCE_EXHAUSTED naming limits.max_request_bytes (never UNKNOWN, no
        allocation)."""
        rss0 = self.daemon.rss()
        t = target("abuse.not.in.checkpoint", "U8", [2 ** 42])
        self.assertRpc(self.stream_load(self.hf, [t]), "RESOURCE_EXHAUSTED",
                       "limits.max_request_bytes", what="stream [2^42] U8")
        # Same for a tensor that is in the checkpoint, and on a native one.
        t = target("abuse.not.in.checkpoint", "U8", [2 ** 42])
        self.assertRpc(self.stream_load(self.tp2, [t]), "RESOURCE_EXHAUSTED",
                       "limits.max_request_bytes", what="stream [2^42] U8 (native)")
        # A box whose byte count overflows 64 bits: refused, never UNKNOWN.
        t = target("abuse.overflow", "F64", [2 ** 40, 2 ** 40])
        rpc = self.stream_load(self.hf, [t])
        self.assertIn(rpc.code, ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"),
                      f"stream [2^40, 2^40] F64: {rpc}")
        self.assertLess(self.daemon.rss() - rss0, 64 << 20, "the daemon's RSS grew")

    # === 4. a 1 TiB sparse memfd ======================================================

    def test_05_terabyte_sparse_memfd(self):
        """A 1 TiB sparse sealed memfd: a small target at offset 0 loads and the
        daemon's RSS stays put (it maps/populates only what the targets use); a
        1 TiB target is RESOURCE_EXHAUSTED naming limits.max_request_bytes."""
        tib = 1 << 40
        fd = memfd(tib)
        self.cleanups.append(lambda: os.close(fd))
        n = "model.layers.0.mlp.down_proj.weight"
        dt, a = self.ref[n]
        rss0 = self.daemon.rss()
        req, _ = self.fd_load_into(fd, tib, [n])
        rpc = raw_load(self.stub, req, timeout=60)
        rss1 = self.daemon.rss()
        self.assertRpc(rpc, "OK", what="1 TiB memfd, one small target at offset 0")
        mm = mmap.mmap(fd, 1 << 20)
        self.cleanups.append(mm.close)
        self.assertEqual(mm[:a.nbytes], a.tobytes())
        self.assertLess(rss1 - rss0, 8 << 20,
                        f"the daemon's RSS grew by {(rss1 - rss0) >> 20} MiB for a "
                        f"{a.nbytes}-byte target")
        # A target of 1 TiB.
        reply, token = send_fd(self.fd_socket, fd)
        self.assertTrue(reply.startswith("OK"), reply)
        req = self.load_req(self.hf, [target("abuse.terabyte", "U8", [tib])])
        req.shm.fd_token, req.shm.size = token, tib
        self.assertRpc(raw_load(self.stub, req, timeout=60), "RESOURCE_EXHAUSTED",
                       "limits.max_request_bytes", what="a 1 TiB target")
        self.assertLess(self.daemon.rss() - rss0, 16 << 20, "the daemon's RSS grew")
        # A 1 MiB memfd declared as 1 TiB, the target past the memfd's end:
        # refused (a copy there would be SIGBUS), never mapped.
        small = memfd(1 << 20)
        self.cleanups.append(lambda: os.close(small))
        reply, token = send_fd(self.fd_socket, small)
        self.assertTrue(reply.startswith("OK"), reply)
        req = self.load_req(self.hf, [target(n, dt, a.shape, dest_offset=2 << 20)])
        req.shm.fd_token, req.shm.size = token, tib
        rpc = raw_load(self.stub, req)
        self.assertTrue(self.daemon.alive(), f"the daemon died: {self.daemon.death()}")
        self.assertRpc(rpc, "INVALID_ARGUMENT", what="a target past the end of a 1 MiB memfd "
                                                     "declared (shm.size) as 1 TiB")

    # === 5. limits ====================================================================

    def test_06_barrier_timeout_and_world_size_limits(self):
        n = "model.norm.weight"
        dt, a = self.ref[n]
        rpc = self.stream_load(self.hf, [target(n, dt, a.shape)],
                               barrier_timeout_ms=2 ** 32 - 1)
        self.assertRpc(rpc, "INVALID_ARGUMENT", "limits.max_barrier_timeout",
                       what="barrier_timeout_ms 2^32-1")
        rpc = self.stream_load(self.hf, [target(n, dt, a.shape)], world=2 ** 20,
                               barrier_timeout_ms=1000)
        self.assertRpc(rpc, "INVALID_ARGUMENT", "limits.max_ranks_per_job",
                       what="world_size 2^20 without node_ranks")

    def test_07_ten_thousand_waiting_loads_from_one_uid(self):
        """uid 65534 sends FLOOD Loads that would all wait (10 jobs of 1000
        ranks): past limits.max_ranks_per_uid they are RESOURCE_EXHAUSTED, the
        daemon stays up, root's loads go on; then limits.max_jobs_per_uid."""
        self.need_other_uid()
        n = "model.norm.weight"
        dt, a = self.ref[n]
        request = {"path": self.shared_tp2, "world_size": 1000, "job_id": self.job("flood"),
                   "barrier_timeout_ms": 120000, "stream": {},
                   "targets": [{"name": n, "dtype": dt, "global_shape": list(a.shape),
                                "offset": [0], "shape": list(a.shape)}]}
        spec = {"socket": self.daemon.socket, "count": FLOOD, "channels": 16, "jobs": 10,
                "world_size": 1000, "limit": MAX_RANKS_PER_UID, "request": request}
        rep = self.run_flood(spec, during=self.root_loads_work)
        self.assertEqual(rep["stopped_early"], "", f"flood: {rep}")
        self.assertEqual(rep["waiting"], MAX_RANKS_PER_UID, f"flood: {rep}")
        self.assertEqual(rep["codes"], {"RESOURCE_EXHAUSTED": FLOOD - MAX_RANKS_PER_UID},
                         f"flood: {rep}")
        self.assertIn("limits.max_ranks_per_uid", rep["samples"]["RESOURCE_EXHAUSTED"])
        self.wait_jobs_gone(request["job_id"])
        # One job more than limits.max_jobs_per_uid (one waiting rank each).
        request["job_id"] = self.job("jobs")
        request["world_size"] = 2
        spec = {"socket": self.daemon.socket, "count": MAX_JOBS_PER_UID + 1, "channels": 2,
                "jobs": MAX_JOBS_PER_UID + 1, "world_size": 2, "limit": MAX_JOBS_PER_UID,
                "request": request}
        rep = self.run_flood(spec, during=self.root_loads_work)
        self.assertEqual(rep["waiting"], MAX_JOBS_PER_UID, f"jobs: {rep}")
        self.assertEqual(rep["codes"], {"RESOURCE_EXHAUSTED": 1}, f"jobs: {rep}")
        self.assertIn("limits.max_jobs_per_uid", rep["samples"]["RESOURCE_EXHAUSTED"])
        self.wait_jobs_gone(request["job_id"])

    def run_flood(self, spec, during):
        path = self.peer_spec(spec)
        p = subprocess.Popen(self.setpriv + ["/usr/bin/python3", "peer.py", "flood", path],
                             cwd=self.peer_dir, env=self.peer_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.cleanups.append(lambda: p.poll() is None and p.kill())
        box = {}
        reader = threading.Thread(target=lambda: box.setdefault("line", p.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(240)
        line = box.get("line", "")
        if not line.startswith("READY "):
            p.kill()
            self.fail(f"the flood client did not report (exit {p.poll()}): {line!r} "
                      f"{p.stderr.read()[-2000:]}")
        rep = json.loads(line[len("READY "):])
        print(f"\nflood of {spec['count']} Loads as uid {OTHER_UID}: {rep}", file=sys.stderr)
        for code, sample in rep["samples"].items():
            note_code(f"uid {OTHER_UID} flood", code, sample)
        try:
            self.assertTrue(self.daemon.alive(), f"the daemon died: {self.daemon.death()}")
            during()
        finally:
            p.stdin.write("go\n")
            p.stdin.flush()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        return rep

    def root_loads_work(self):
        """While uid 65534 holds its limit: root's own load and the alongside
        load still work."""
        sd = self.full_state_dict()
        ckptd.load_state_dict(sd, self.tp2, socket=self.daemon.socket, timeout=60)
        self.assertStateDict(sd)
        done, _ = self.loader.mark()
        self.assertTrue(self.loader.wait_for(done + 2, 60),
                        "the alongside load stalled while another uid held its limit")

    def wait_jobs_gone(self, prefix, timeout=20):
        deadline = time.monotonic() + timeout
        left = []
        while time.monotonic() < deadline:
            left = [j for j in self.status_jobs() if j.startswith(prefix)]
            if not left:
                return
            time.sleep(0.1)
        self.fail(f"{len(left)} jobs of a cancelled client still listed after {timeout} s")

    # === 6. idle fd-socket connections ================================================

    def test_08_idle_fd_connections_do_not_block_others(self):
        """200 connections to the fd socket that send nothing: another client's
        sealed memfd and ALLOC are still answered within 1 s."""
        idle = []
        self.cleanups.append(lambda: [s.close() for s in idle])
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            try:
                s.connect(self.fd_socket)
            except OSError as e:
                s.close()
                self.fail(f"the fd socket took only {len(idle)} idle connections: {e}")
            idle.append(s)
        size = 64 << 10
        fd = memfd(size)
        self.cleanups.append(lambda: os.close(fd))
        t0 = time.monotonic()
        try:
            reply, token = send_fd(self.fd_socket, fd, timeout=5)
        except (socket.timeout, OSError) as e:
            reply, token = f"no reply: {e}", None
        t_send = time.monotonic() - t0
        t0 = time.monotonic()
        try:
            areply, afd, atoken, asize, lease = alloc(self.fd_socket, 4096, timeout=5)
        except (socket.timeout, OSError) as e:
            areply, afd, lease = f"no reply: {e}", None, None
        t_alloc = time.monotonic() - t0
        if lease is not None:
            self.cleanups.append(lease.close)
            self.cleanups.append(lambda: os.close(afd))
        self.assertTrue(reply.startswith("OK"), f"sealed memfd behind 200 idle connections: "
                                                f"{reply!r} after {t_send:.2f} s")
        self.assertTrue(areply.startswith("OK"), f"ALLOC behind 200 idle connections: "
                                                 f"{areply!r} after {t_alloc:.2f} s")
        self.assertLess(t_send, 1.0, "handing over a memfd behind 200 idle connections")
        self.assertLess(t_alloc, 1.0, "ALLOC behind 200 idle connections")
        # The token works.
        n = "model.norm.weight"
        dt, a = self.ref[n]
        req = self.load_req(self.tp2, [target(n, dt, a.shape)])
        req.shm.fd_token, req.shm.size = token, size
        self.assertRpc(raw_load(self.stub, req), "OK", what="Load into the memfd")

    # === 7. symlinks and FIFOs inside a checkpoint ====================================

    def test_09_symlink_and_fifo_inside_checkpoint(self):
        """A data file that is a symlink to a file outside the roots, and FIFOs
        named like data files: the load fails at once naming the file; no
        handler blocks."""
        link = self.copy_ckpt(self.tp2, "ck-symlink")
        victim = "1_5.safetensors"
        moved = os.path.join(self.outside, "stolen-" + victim)
        shutil.move(os.path.join(link, victim), moved)
        os.symlink(moved, os.path.join(link, victim))
        fifo = self.copy_ckpt(self.tp2, "ck-fifo")
        os.remove(os.path.join(fifo, victim))
        os.mkfifo(os.path.join(fifo, victim))
        hf_fifo = self.copy_ckpt(self.hf, "hf-fifo")
        os.remove(os.path.join(hf_fifo, "model.safetensors"))
        os.mkfifo(os.path.join(hf_fifo, "model.safetensors"))
        for d in (fifo, hf_fifo):
            self.cleanups.append(lambda d=d: unblock_fifos(d))
        cases = [(link, victim, ("symbolic link", "symlink")),
                 (fifo, victim, ("FIFO", "regular file")),
                 (hf_fifo, "model.safetensors", ("FIFO", "regular file"))]
        for d, name, words in cases:
            with self.subTest(os.path.basename(d)):
                t0 = time.monotonic()
                try:
                    sd = self.full_state_dict()
                    ckptd.load_state_dict(sd, d, socket=self.daemon.socket, timeout=10)
                    rpc = Rpc("OK", "")
                except ckptd.CkptdError as e:
                    note_code(d, e.code, e.message)
                    rpc = Rpc(e.code, e.message)
                took = time.monotonic() - t0
                self.assertNotIn(rpc.code, ("OK", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE")
                                 + BAD_CODES, f"{os.path.basename(d)}: {rpc} after {took:.1f} s")
                self.assertIn(name, rpc.details, f"the message should name the file: {rpc}")
                self.assertTrue(any(w in rpc.details for w in words),
                                f"the message should say {' or '.join(words)}: {rpc}")
                self.assertLess(took, 5.0, f"{os.path.basename(d)}: took {took:.1f} s")

    # === 8. Save into a symlinked directory ===========================================

    def test_10_save_into_symlinked_directory(self):
        real = os.path.join(self.root, "save-real")
        os.makedirs(real)
        link = os.path.join(self.root, "save-link")
        os.symlink(real, link)
        w = np.arange(256, dtype=np.float32)
        self.assertRaisesCode(
            "INVALID_ARGUMENT",
            lambda: ckptd.save_state_dict({"w": w}, link, rank=0, world_size=1, unique_id=0,
                                          job_id=self.job("save-link"), socket=self.daemon.socket,
                                          timeout=30),
            "symbolic link", "save-link", what="Save into a symlinked directory")
        self.assertEqual(os.listdir(real), [], "files were written through the symlink")

    # === 9. another uid ===============================================================

    def test_11_another_uid(self):
        """uid 65534: root's arena and fd tokens, root's job id, saving into a
        root it may only read, Status, and reading a root it may not read."""
        self.need_other_uid()
        n = "model.norm.weight"
        dt, a = self.ref[n]
        tgt = {"name": n, "dtype": dt, "global_shape": list(a.shape), "offset": [0],
               "shape": list(a.shape)}
        # Root's arena, fd token and a waiting job.
        reply, afd, atoken, asize, lease = alloc(self.fd_socket, 4096)
        self.assertIsNotNone(afd, reply)
        self.cleanups.append(lease.close)
        self.cleanups.append(lambda: os.close(afd))
        fd = memfd(64 << 10)
        self.cleanups.append(lambda: os.close(fd))
        reply, ftoken = send_fd(self.fd_socket, fd)
        self.assertTrue(reply.startswith("OK"), reply)
        job = self.job("root-owned")
        req = self.load_req(self.shared_tp2, [target(n, dt, a.shape)], job=job, rank=0, world=2,
                            barrier_timeout_ms=60000)
        req.stream.SetInParent()
        waiting = AsyncLoad(self.stub, req, timeout=90)
        waiting.start()
        self.cleanups.append(waiting.cancel)
        self.assertTrue(waiting.registered.wait(10), "root's rank 0 never registered")

        peer_job = f"peer-own-{os.getpid()}-{self.counter}"
        calls = [
            {"rpc": "Load", "request": {"job_id": peer_job + "-a", "rank": 0, "world_size": 1,
                                        "path": self.shared_tp2, "targets": [tgt],
                                        "shm": {"arena_token": atoken, "size": 4096}}},
            {"rpc": "Load", "request": {"job_id": peer_job + "-f", "rank": 0, "world_size": 1,
                                        "path": self.shared_tp2, "targets": [tgt],
                                        "shm": {"fd_token": ftoken, "size": 65536}}},
            {"rpc": "Load", "request": {"job_id": job, "rank": 1, "world_size": 2,
                                        "path": self.shared_tp2, "targets": [tgt],
                                        "stream": {}}},
            {"memfd": "m", "size": 4096},
            {"rpc": "Save", "request": {
                "job_id": peer_job + "-s1", "rank": 0, "world_size": 1, "unique_id": 0,
                "path": os.path.join(self.shared, "peer-save"),
                "targets": [dict(tgt, name="w", dtype="F32", global_shape=[64], shape=[64])],
                "shm": {"fd_token": "${m}", "size": 4096}}},
            {"memfd": "m2", "size": 4096},
            {"rpc": "Save", "request": {
                "job_id": peer_job + "-s2", "rank": 0, "world_size": 1, "unique_id": 0,
                "path": os.path.join(self.root, "peer-save"),
                "targets": [dict(tgt, name="w", dtype="F32", global_shape=[64], shape=[64])],
                "shm": {"fd_token": "${m2}", "size": 4096}}},
            {"rpc": "Status"},
            {"rpc": "Load", "request": {"job_id": peer_job + "-r", "rank": 0, "world_size": 1,
                                        "path": self.tp2, "targets": [tgt], "stream": {}}},
            # Sanity: what 65534 may do works (the refusals above are not blanket ones).
            {"rpc": "Load", "request": {"job_id": peer_job + "-ok", "rank": 0, "world_size": 1,
                                        "path": self.shared_tp2, "targets": [tgt],
                                        "stream": {}}},
        ]
        out = self.peer_calls(calls)
        arena, fdtok, join, _, save_shared, _, save_private, status, read_private, ok = out
        self.assertRpc(arena, "PERMISSION_DENIED", "another user",
                       what="uid 65534 using root's arena token")
        self.assertRpc(fdtok, "PERMISSION_DENIED", "another user",
                       what="uid 65534 using root's fd token")
        self.assertRpc(join, "PERMISSION_DENIED", "belongs to another user", job,
                       what="uid 65534 joining root's job id")
        self.assertRpc(save_shared, "PERMISSION_DENIED", self.shared,
                       what="uid 65534 saving into a root it may only read")
        self.assertRpc(save_private, "PERMISSION_DENIED", self.root,
                       what="uid 65534 saving into a root it may not use")
        self.assertFalse(os.path.exists(os.path.join(self.shared, "peer-save")))
        self.assertFalse(os.path.exists(os.path.join(self.root, "peer-save")))
        self.assertRpc(status, "OK", what="Status as uid 65534")
        leaked = [j for j in status.value["job_ids"] if not j.startswith("peer-own-")]
        self.assertEqual(leaked, [], "Status shows uid 65534 jobs of other users")
        self.assertIn(job, self.status_jobs(), "root (an admin) should see its own job")
        self.assertRpc(read_private, "PERMISSION_DENIED", self.root,
                       what="uid 65534 loading from a root it may not read")
        self.assertRpc(ok, "OK", what="uid 65534 loading from the root it may read")
        # Root's job, fd token and arena were left alone.
        self.assertIsNone(waiting.rpc, f"root's waiting rank ended: {waiting.rpc}")
        req = self.load_req(self.shared_tp2, [target(n, dt, a.shape)])
        req.shm.fd_token, req.shm.size = ftoken, 64 << 10
        self.assertRpc(raw_load(self.stub, req), "OK", what="root using its own fd token after")
        req = self.load_req(self.shared_tp2, [target(n, dt, a.shape)])
        req.shm.arena_token, req.shm.size = atoken, asize
        self.assertRpc(raw_load(self.stub, req), "OK", what="root using its own arena after")
        waiting.cancel()
        waiting.wait(20)

    # === 10. Save over an existing version ==========================================

    def save_request(self, path, arrays, unique_id, job=None, rank=0, world=1, overwrite=False,
                     boxes=None, dmn=None, barrier_timeout_ms=0):
        """A SaveRequest for numpy arrays (whole tensors, or `boxes`: name ->
        (global_shape, offset)) copied into a sealed memfd already handed to
        `dmn` (default: the suite's daemon)."""
        dmn = dmn or self.daemon
        size = max(sum((a.nbytes + 63) // 64 * 64 for a in arrays.values()), 64)
        fd = memfd(size)
        mm = mmap.mmap(fd, size)
        targets, pos = [], 0
        for name, a in arrays.items():
            mm[pos:pos + a.nbytes] = a.tobytes()
            g, off = (boxes or {}).get(name, (a.shape, [0] * a.ndim))
            targets.append(target(name, ckptd.dtype_name(a.dtype), g, off, a.shape,
                                  dest_offset=pos))
            pos += (a.nbytes + 63) // 64 * 64
        reply, token = send_fd(dmn.socket + ".fd", fd)
        mm.close()
        os.close(fd)
        self.assertTrue(reply.startswith("OK"), reply)
        req = pb2.SaveRequest(job_id=job or self.job("save"), rank=rank, world_size=world,
                              path=path, unique_id=unique_id, targets=targets,
                              barrier_timeout_ms=barrier_timeout_ms)
        if overwrite:
            req.overwrite = True
        req.shm.fd_token, req.shm.size = token, size
        return req

    def raw_save(self, path, arrays, unique_id, timeout=60.0, future=False, dmn=None, **kw):
        """save_request + Save: an Rpc (or, with future=True, a grpc future)."""
        dmn = dmn or self.daemon
        req = self.save_request(path, arrays, unique_id, dmn=dmn, **kw)
        if future:
            return dmn.stub.Save.future(req, timeout=timeout)
        return call("Save", dmn.stub.Save, req, timeout=timeout)

    def test_12_save_over_existing_version(self):
        d = os.path.join(self.root, "overwrite")
        x = np.arange(1000, dtype=np.float32)
        y = x * -3
        self.assertRpc(self.raw_save(d, {"w": x}, 0), "OK", what="first save of version 0")
        self.assertRpc(self.raw_save(d, {"w": y}, 0), "ALREADY_EXISTS", "0.metadata",
                       what="second save of version 0")
        got = np.zeros_like(x)
        ckptd.load_state_dict({"w": got}, d, unique_id=0, socket=self.daemon.socket)
        self.assertEqual(got.tobytes(), x.tobytes(), "the refused save changed version 0")
        self.assertRpc(self.raw_save(d, {"w": y}, 0, overwrite=True), "OK",
                       what="save of version 0 with overwrite")
        ckptd.load_state_dict({"w": got}, d, unique_id=0, socket=self.daemon.socket)
        self.assertEqual(got.tobytes(), y.tobytes(), "overwrite did not replace version 0")

    # === 11. two concurrent Saves into one directory ==================================

    def test_13_concurrent_saves_into_one_directory(self):
        """Two 2-rank Save jobs into one directory, rank 0 of both first, then
        both rank 1s at once: one job writes, the other fails ABORTED naming
        the lock / the other save (whether it is refused when it registers or
        when it would write); the result loads byte-exact and the loser's
        version is not visible."""
        d = os.path.join(self.root, "concurrent")
        rows, cols = 2, 8 << 20  # 2 x 32 MiB per job (uint32)
        datas = {}
        for uid in (1, 2):
            datas[uid] = (np.arange(rows * cols, dtype=np.uint32) * np.uint32(2654435761)
                          + np.uint32(uid)).reshape(rows, cols)
        jobs = {uid: self.job(f"concurrent-{uid}") for uid in (1, 2)}
        # Every request prepared (memfd filled and handed over) before any is
        # sent, so the two rank 1s go out back to back.
        reqs = {(uid, rank): self.save_request(
                    d, {"w": datas[uid][rank:rank + 1]}, uid, job=jobs[uid], rank=rank, world=2,
                    boxes={"w": ((rows, cols), (rank, 0))}, barrier_timeout_ms=10000)
                for rank in (0, 1) for uid in (1, 2)}
        futures, ended = {}, {}
        t0 = time.monotonic()
        for rank in (0, 1):
            for uid in (1, 2):
                f = self.stub.Save.future(reqs[(uid, rank)], timeout=120)
                f.add_done_callback(lambda _f, key=(uid, rank): ended.setdefault(
                    key, round(time.monotonic() - t0, 3)))
                futures[(uid, rank)] = f
            if rank == 0:  # both rank 0s registered (or already refused)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    jobs_now = self.status_jobs()
                    if all(jobs[u] in jobs_now or futures[(u, 0)].done() for u in (1, 2)):
                        break
                    time.sleep(0.02)
                t0 = time.monotonic()
        outcome = {}
        for (uid, rank), f in futures.items():
            try:
                f.result()
                outcome[(uid, rank)] = Rpc("OK", "")
            except grpc.RpcError as e:
                note_code("Save", e.code().name, e.details())
                outcome[(uid, rank)] = Rpc(e.code().name, e.details() or "")
        ok = {uid for uid in (1, 2) if all(outcome[(uid, r)].code == "OK" for r in (0, 1))}
        self.assertEqual(len(ok), 1, f"expected one save to win and one to fail: {outcome} "
                                     f"(seconds after both rank 1s were sent: {ended})")
        (winner,) = ok
        loser = 3 - winner
        lost = [outcome[(loser, r)] for r in (0, 1)]
        self.assertFalse(any(o.code == "OK" for o in lost), f"the losing save: {lost}")
        aborted = [o for o in lost if o.code == "ABORTED"]
        self.assertTrue(aborted, f"the losing save (version {loser}) should be ABORTED: {lost}")
        for o in lost:
            self.assertIn(o.code, ("ABORTED", "DEADLINE_EXCEEDED"), f"the losing save: {lost}")
        self.assertRpc(aborted[0], "ABORTED",
                       ("lock", "another save", "being saved", "in progress"),
                       what=f"the losing save (version {loser})")
        info = ckptd.inspect(d, socket=self.daemon.socket)
        self.assertEqual(info.versions, [winner], "versions visible after the two saves")
        self.assertFalse(os.path.exists(os.path.join(d, f"{loser}.metadata")))
        got = np.zeros((rows, cols), np.uint32)
        ckptd.load_state_dict({"w": got}, d, unique_id=winner, socket=self.daemon.socket,
                              timeout=120)
        self.assertTrue(np.array_equal(got, datas[winner]), "the saved version is not byte-exact")

    # === 12. SIGKILL during saves =====================================================

    def test_14_daemon_killed_during_saves(self):
        """SIGKILL at random points of a 2-rank save (0-200 ms after both ranks
        sent their Save): after a restart, the previous versions load
        byte-exact and the new one is either complete or invisible."""
        base = os.path.join(self.base, "killroot")
        os.makedirs(base)
        d = os.path.join(base, "ckpt")
        cfg = os.path.join(self.base, "killroot.yaml")
        write_config(cfg, [base])
        seed = int(os.environ.get("CKPTD_ABUSE_SEED", str(int(time.time()))))
        rng = random.Random(seed)
        rows, cols = 2, 4 << 20  # 2 x 16 MiB per version (uint32)

        def data(uid):
            return (np.arange(rows * cols, dtype=np.uint32) * np.uint32(2246822519)
                    + np.uint32(uid * 7919)).reshape(rows, cols)

        victims = [Daemon(cfg)]
        self.cleanups.append(lambda: victims[-1].stop())
        history = []

        def save(uid, job):
            return [self.raw_save(d, {"w": data(uid)[r:r + 1]}, uid, job=job, rank=r, world=2,
                                  boxes={"w": ((rows, cols), (r, 0))}, future=True,
                                  dmn=victims[-1]) for r in (0, 1)]

        for f in save(0, self.job("k0")):
            f.result()
        good = {0}
        for it in range(1, KILL_ITERATIONS + 1):
            delay = rng.uniform(0, 0.2)
            futs = save(it, self.job(f"k{it}"))
            time.sleep(delay)
            victims[-1].kill()
            states = []
            for f in futs:
                try:
                    f.result(timeout=30)
                    states.append("OK")
                except grpc.RpcError as e:
                    states.append(e.code().name)
            victims[-1].stop()
            victims.append(Daemon(cfg))
            sock = victims[-1].socket
            meta = os.path.exists(os.path.join(d, f"{it}.metadata"))
            where = (f"iteration {it} (SIGKILL {delay * 1000:.0f} ms after the saves were sent, "
                     f"saves {states}; seed {seed}; history {history})")
            try:
                info = ckptd.inspect(d, socket=sock)
            except ckptd.CkptdError as e:
                note_code("inspect after kill", e.code, e.message)
                self.fail(f"{where}: the checkpoint cannot be inspected after the kill: {e}; "
                          f"files: {sorted(os.listdir(d))}")
            history.append((it, round(delay * 1000), states, meta, info.versions))
            self.assertTrue(good <= set(info.versions),
                            f"{where}: versions {info.versions} lost some of {sorted(good)}")
            self.assertEqual(set(info.versions) - good - {it}, set(),
                             f"{where}: unexpected versions")
            if it in info.versions or meta:
                good.add(it)
            for uid in sorted(good & {0, it, max(good)}):
                got = np.zeros((rows, cols), np.uint32)
                try:
                    ckptd.load_state_dict({"w": got}, d, unique_id=uid, socket=sock, timeout=60)
                except ckptd.CkptdError as e:
                    note_code("load after kill", e.code, e.message)
                    self.fail(f"{where}: version {uid} does not load: {e}")
                self.assertTrue(np.array_equal(got, data(uid)),
                                f"{where}: version {uid} is not byte-exact")
        print(f"\nkill-during-save: seed {seed}: {history}", file=sys.stderr)

    # === 13. same-size rewrite with the mtime restored ================================

    def test_15_same_size_rewrite_mtime_restored(self):
        """After a cached load, a data file is rewritten in place (same size)
        and its mtime restored: the next load returns the new bytes (or fails
        with a clear error), never the stale cached ones."""
        for src, fname, native in ((self.hf, "model.safetensors", False),
                                   (self.tp2, "0_5.safetensors", True)):
            with self.subTest("native" if native else "huggingface"):
                d = self.copy_ckpt(src, f"rewrite-{'native' if native else 'hf'}")
                path = os.path.join(d, fname)
                name = "model.layers.0.self_attn.q_proj.weight"
                dt, a = self.ref[name]
                # The part of the tensor this file holds (all of it for HF).
                (shard,) = [sh for sh in ckptd.inspect(d, socket=self.daemon.socket)
                            .tensors[name].shards if sh.file == fname and sh.replica_id == 0]
                box = tuple(slice(o, o + n) for o, n in zip(shard.offset, shard.shape))
                sd = self.full_state_dict()
                ckptd.load_state_dict(sd, d, socket=self.daemon.socket)
                ckptd.prefetch(d, socket=self.daemon.socket)
                self.assertStateDict(sd)
                st = os.stat(path)
                b, e = file_tensors(path)[name]
                with open(path, "r+b") as f:
                    f.seek(b)
                    old = f.read(e - b)
                    new = bytes(x ^ 0x5A for x in old)
                    f.seek(b)
                    f.write(new)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
                st2 = os.stat(path)
                self.assertEqual((st2.st_size, st2.st_mtime_ns, st2.st_ino),
                                 (st.st_size, st.st_mtime_ns, st.st_ino))
                want = a.copy()
                want[box] = np.frombuffer(new, a.dtype).reshape(shard.shape)
                sd = self.full_state_dict()
                try:
                    ckptd.load_state_dict(sd, d, socket=self.daemon.socket)
                except ckptd.CkptdError as err:
                    note_code("rewrite", err.code, err.message)
                    self.assertNotIn(err.code, BAD_CODES, str(err))
                    self.assertTrue(native, f"an HF file without checksums failed: {err}")
                    self.assertEqual(err.code, "DATA_LOSS", str(err))
                    self.assertIn(fname, err.message)
                    continue
                got = sd[name].local
                self.assertFalse(np.array_equal(got.view(np.uint32), a.view(np.uint32)),
                                 "the load returned the stale cached bytes")
                self.assertTrue(got.tobytes() == want.tobytes(),
                                "the load returned neither the old nor the new bytes")

    # === 14. skip_verify on one rank ==================================================

    def test_16_skip_verify_on_one_rank(self):
        """A corrupted data byte (same size): rank 0 asks skip_verify, rank 1
        does not: rank 1's load fails DATA_LOSS naming the file/tensor/checksum;
        a later normal load gets no corrupted bytes from the cache."""
        d = self.copy_ckpt(self.tp2, "corrupt")
        fname = "0_5.safetensors"
        path = os.path.join(d, fname)
        header = file_tensors(path)
        name = "model.layers.0.mlp.up_proj.weight"
        b, e = header[name]
        with open(path, "r+b") as f:
            f.seek((b + e) // 2)
            x = f.read(1)
            f.seek((b + e) // 2)
            f.write(bytes([x[0] ^ 0xFF]))
        shards = [s for s in ckptd.inspect(d, socket=self.daemon.socket).tensors[name].shards
                  if s.file == fname]
        self.assertTrue(shards, f"'{name}' has no shard in {fname}")
        g = self.ref[name][1].shape
        job = self.job("skipverify")
        results = {}

        def rank(r):
            sd = {name: np.zeros(g, np.float32)}
            try:
                ckptd.load_state_dict(sd, d, rank=r, world_size=2, job_id=job, verify=(r == 1),
                                      socket=self.daemon.socket, timeout=60)
                results[r] = Rpc("OK", "", sd)
            except ckptd.CkptdError as err:
                note_code(f"skip_verify rank {r}", err.code, err.message)
                results[r] = Rpc(err.code, err.message)

        ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(90)
        self.assertNotIn(results[0].code, BAD_CODES, f"rank 0 (skip_verify): {results[0]}")
        self.assertRpc(results[1], "DATA_LOSS", (fname, name, "checksum"),
                       what="rank 1 (verifying) of a job whose rank 0 skips verification")
        # Later, a normal load: the cache must not hand out the corrupted bytes.
        for attempt in range(2):
            sd = {name: np.zeros(g, np.float32)}
            try:
                ckptd.load_state_dict(sd, d, socket=self.daemon.socket, timeout=60)
                rpc = Rpc("OK", "")
            except ckptd.CkptdError as err:
                note_code("normal load after skip_verify", err.code, err.message)
                rpc = Rpc(err.code, err.message)
            self.assertRpc(rpc, "DATA_LOSS", (fname, name, "checksum"),
                           what=f"normal load #{attempt + 1} after the skip_verify job")

    # === 15. what another uid gets from the file system and the arena pool ============

    def test_17_directory_mode_bits_deny_another_uid(self):
        """docs/security.md "What each uid may do": on top of the access rule a caller
        needs r-x on the checkpoint directory (its mode bits for the caller's uid and
        groups). uid 65534 may read the shared root; a root-owned checkpoint there
        with mode 0700 or 0711 is PERMISSION_DENIED for Load, Inspect and
        ReadCheckpointFile, the same checkpoint at 0755 loads."""
        self.need_other_uid()
        n = "model.norm.weight"
        dt, a = self.ref[n]
        tgt = {"name": n, "dtype": dt, "global_shape": list(a.shape), "offset": [0],
               "shape": list(a.shape)}
        dirs = {}
        for mode in (0o700, 0o711, 0o755):
            d = os.path.join(self.shared, f"mode-{mode:o}-{os.getpid()}-{self.counter}")
            shutil.copytree(self.shared_tp2, d)
            os.chmod(d, mode)
            self.cleanups.append(lambda d=d: shutil.rmtree(d, ignore_errors=True))
            dirs[mode] = d
        job = f"peer-mode-{os.getpid()}-{self.counter}"
        calls = []
        for mode, d in dirs.items():
            calls.append({"rpc": "Load", "request": {
                "job_id": f"{job}-{mode:o}", "rank": 0, "world_size": 1, "path": d,
                "targets": [tgt], "stream": {}}})
            calls.append({"rpc": "Inspect", "request": {"path": d}})
            calls.append({"rpc": "ReadCheckpointFile", "request": {
                "path": d, "file": "5.metadata", "length": 64}})
        out = self.peer_calls(calls)
        for i, (mode, d) in enumerate(dirs.items()):
            load, inspect, read = out[3 * i], out[3 * i + 1], out[3 * i + 2]
            if mode == 0o755:
                self.assertRpc(load, "OK", what=f"uid 65534 loading a {mode:o} directory")
                self.assertRpc(inspect, "OK", what=f"uid 65534 inspecting a {mode:o} directory")
                self.assertRpc(read, "OK", what=f"uid 65534 reading the metadata of a {mode:o} "
                               "directory")
                continue
            for what, rpc in (("Load", load), ("Inspect", inspect), ("ReadCheckpointFile", read)):
                self.assertRpc(rpc, "PERMISSION_DENIED", f"uid {OTHER_UID} (pid ",
                               f"may not read {d} (its mode bits do not allow it)",
                               what=f"uid 65534 {what} of a {mode:o} directory")
        # Root (exempt from the mode bits) still reads the 0700 one.
        req = self.load_req(dirs[0o700], [target(n, dt, a.shape)])
        req.stream.SetInParent()
        self.assertRpc(raw_load(self.stub, req), "OK", what="root loading the 0700 directory")

    def test_18_recycled_arena_goes_only_to_the_same_uid(self):
        """docs/grpc-api.md "The fd socket protocol": a given-back arena is handed to the
        next client of the same user asking for the same size, and holds what its last
        user left. Root fills an arena with 0xA5 and gives it back; uid 65534 asking
        for the same size gets a fresh one (all zero); root asking again gets its own
        back (0xA5: recycling does happen)."""
        self.need_other_uid()
        size = 14 << 20  # 7 granules: no size the alongside load borrows
        reply, fd, token, got, lease = alloc(self.fd_socket, size)
        self.assertIsNotNone(fd, reply)
        self.assertEqual(got, size, reply)
        with mmap.mmap(fd, size) as mm:
            mm[:] = b"\xa5" * size
        os.close(fd)
        free_while_leased = self.status().arena_free_bytes
        lease.close()  # given back

        # Awaited on Status, which changes nothing: a probe that loads with the old
        # token would write into the arena if the lease were not released yet.
        testlib.wait_for("root's arena given back to the pool",
                         lambda: self.status().arena_free_bytes >= free_while_leased + size,
                         20, 0.05)
        (peer,) = self.peer_calls([{"alloc": "a", "size": size}])
        self.assertRpc(peer, "OK", what="ALLOC as uid 65534")
        self.assertEqual((peer.value["bytes"], peer.value["nonzero"]), (size, 0),
                         "uid 65534 got an arena holding root's bytes")
        reply, fd, token2, got, lease = alloc(self.fd_socket, size)
        self.assertIsNotNone(fd, reply)
        self.cleanups.append(lease.close)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            self.assertEqual(mm[:].count(b"\xa5"), size, "root did not get its arena back")
        os.close(fd)
        self.assertNotEqual(token2, token)  # a new token for the recycled arena


    def test_19_directory_mode_bits_deny_another_uid_saving(self):
        """docs/security.md "What each uid may do": saving needs w-x, for the caller's
        uid and groups, on the directory that receives the files and on its parent
        (where a new one is made), on top of the access rule. uid 65534 may save under
        the savable root by its access entry, but a new directory under the root-owned
        root (0755), a new one inside a root-owned 0755 directory, and an existing
        root-owned 0755 checkpoint directory inside its own are PERMISSION_DENIED naming
        the directory, and nothing is created; its own directory takes the save, and
        the files there hold its bytes."""
        self.need_other_uid()
        tag = f"{os.getpid()}-{self.counter}"
        mine = os.path.join(self.savable, f"owned-{tag}")
        os.makedirs(mine)
        os.chown(mine, OTHER_UID, OTHER_UID)
        os.chmod(mine, 0o755)
        roots_dir = os.path.join(self.savable, f"roots-{tag}")  # root's, 0755
        theirs = os.path.join(mine, "theirs")  # root's, 0755, in uid 65534's directory
        for d in (roots_dir, theirs):
            os.makedirs(d)
            os.chmod(d, 0o755)
        for d in (mine, roots_dir):
            self.cleanups.append(lambda d=d: shutil.rmtree(d, ignore_errors=True))
        w = np.arange(64, dtype=np.float32)

        def save(i, path):
            return [{"memfd": f"m{i}", "size": 4096, "fill": w.tobytes().hex()},
                    {"rpc": "Save", "request": {
                        "job_id": f"peer-save-mode-{tag}-{i}", "rank": 0, "world_size": 1,
                        "unique_id": 0, "path": path,
                        "targets": [{"name": "w", "dtype": "F32", "global_shape": [64],
                                     "offset": [0], "shape": [64]}],
                        "shm": {"fd_token": f"${{m{i}}}", "size": 4096}}}]
        refused = {os.path.join(self.savable, f"new-{tag}"): self.savable,
                   os.path.join(roots_dir, "ckpt"): roots_dir,
                   theirs: theirs}
        calls = []
        for i, path in enumerate(refused):
            calls += save(i, path)
        calls += save(len(refused), os.path.join(mine, "ckpt"))
        out = self.peer_calls(calls)[1::2]
        for rpc, (path, named) in zip(out, refused.items()):
            self.assertRpc(rpc, "PERMISSION_DENIED", f"uid {OTHER_UID} (pid ",
                           f"may not write {named} (its mode bits do not allow it)",
                           what=f"uid 65534 saving {path}")
        self.assertFalse(os.path.exists(os.path.join(self.savable, f"new-{tag}")),
                         "a refused save created its directory")
        self.assertEqual(os.listdir(roots_dir), [], "a refused save left files")
        self.assertEqual(os.listdir(theirs), [], "a refused save left files")
        self.assertRpc(out[-1], "OK", what="uid 65534 saving into a directory it owns")
        sd = {"w": np.full(64, np.nan, np.float32)}
        ckptd.load_state_dict(sd, os.path.join(mine, "ckpt"), socket=self.daemon.socket,
                              timeout=60)
        np.testing.assert_array_equal(sd["w"], w)

    def test_20_another_uid_cannot_see_or_await_an_async_save(self):
        """docs/saving.md: only a job's owner (or an admin) may AwaitSave it, and
        Status lists only the caller's own saves. Root saves asynchronously; uid
        65534 asking for it (with the longest timeout a request can carry) gets
        NOT_FOUND at once, and its Status does not list it; root's own AwaitSave
        then finds it durable."""
        self.need_other_uid()
        job = self.job("async-root")
        path = os.path.join(self.root, f"async-{os.getpid()}-{self.counter}")
        req = self.save_request(path, {"w": np.arange(64, dtype=np.float32)}, 0, job=job)
        req.async_save = True
        first = call("Save", self.stub.Save, req, timeout=60)
        self.assertRpc(first, "OK", what="root's asynchronous save")
        self.assertFalse(first.value.persisted)
        t0 = time.monotonic()
        out = self.peer_calls([
            {"rpc": "AwaitSave", "request": {"job_id": job, "rank": 0,
                                             "timeout_ms": 4294967295}, "timeout": 60},
            {"rpc": "Status"}])
        self.assertLess(time.monotonic() - t0, 30, "uid 65534's AwaitSave waited")
        self.assertRpc(out[0], "NOT_FOUND", job, what="uid 65534 awaiting root's save")
        self.assertRpc(out[1], "OK", what="Status as uid 65534")
        self.assertNotIn(job, out[1].value["save_ids"])
        mine = call("AwaitSave", self.stub.AwaitSave,
                    pb2.AwaitSaveRequest(job_id=job, rank=0, timeout_ms=60000), timeout=90)
        self.assertRpc(mine, "OK", what="root awaiting its own save")
        self.assertTrue(mine.value.persisted)
        self.assertTrue(os.path.exists(os.path.join(path, "0.metadata")))

    # === 21. memory is charged by what is mapped (issue 33) ===========================

    def hwm(self):
        """The daemon's VmHWM in bytes."""
        with open(f"/proc/{self.daemon.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    def reset_hwm(self):
        """Sets the daemon's VmHWM back to its RSS (clear_refs 5); its value."""
        with open(f"/proc/{self.daemon.pid}/clear_refs", "w") as f:
            f.write("5")
        return self.hwm()

    def stream_bytes(self, rpc, size):
        out = bytearray(size)
        for ev in rpc.events:
            if ev.WhichOneof("event") == "data":
                out[ev.data.offset:ev.data.offset + len(ev.data.data)] = ev.data.data
        return bytes(out)

    def test_21_memory_is_charged_by_what_is_mapped(self):
        """A request is charged (per request, per uid, save_buffer) by what the
        daemon maps or copies, and the daemon populates only the targets' pages:
        (a) a sparse 6 GiB memfd with one small target at its end is
        INVALID_ARGUMENT naming both sizes, before anything is mapped; (b) a
        sparse 1 GiB memfd with one small target at 768 MiB loads, and the
        daemon's VmHWM grows by far less than the 768 MiB an up-front
        MAP_POPULATE of the span faulted in; (c) an asynchronous save of one
        small target at 768 MiB of a sparse memfd copies only the target (the
        daemon's copy was the whole span), and the version it writes is exact."""
        n = "model.norm.weight"
        dt, a = self.ref[n]
        gib = 1 << 30
        # (a) 6 GiB, the target at its last bytes.
        big = memfd(6 * gib)
        self.cleanups.append(lambda: os.close(big))
        reply, token = send_fd(self.fd_socket, big)
        self.assertTrue(reply.startswith("OK"), reply)
        req = self.load_req(self.hf, [target(n, dt, a.shape, dest_offset=6 * gib - a.nbytes)])
        req.shm.fd_token, req.shm.size = token, 6 * gib
        hwm0 = self.reset_hwm()
        t0 = time.monotonic()
        rpc = raw_load(self.stub, req, timeout=60)
        self.assertRpc(rpc, "INVALID_ARGUMENT", "span", str(6 * gib), "fill only",
                       what="one small target at the end of a sparse 6 GiB memfd")
        self.assertLess(time.monotonic() - t0, 5, "refusing the sparse segment took long")
        self.assertLess(self.hwm() - hwm0, 64 << 20,
                        f"VmHWM grew by {(self.hwm() - hwm0) >> 20} MiB: {self.daemon.memory()}")
        # (b) 1 GiB, the target at 768 MiB: loads, populating one page.
        sparse = memfd(gib)
        self.cleanups.append(lambda: os.close(sparse))
        reply, token = send_fd(self.fd_socket, sparse)
        self.assertTrue(reply.startswith("OK"), reply)
        at = 768 << 20
        req = self.load_req(self.hf, [target(n, dt, a.shape, dest_offset=at)])
        req.shm.fd_token, req.shm.size = token, gib
        hwm0 = self.reset_hwm()
        rpc = raw_load(self.stub, req, timeout=60)
        grew = self.hwm() - hwm0
        self.assertRpc(rpc, "OK", what="one small target at 768 MiB of a sparse 1 GiB memfd")
        mm = mmap.mmap(sparse, gib)
        self.cleanups.append(mm.close)
        self.assertEqual(mm[at:at + a.nbytes], a.tobytes())
        self.assertLess(grew, 64 << 20, f"VmHWM grew by {grew >> 20} MiB for a {a.nbytes}-byte "
                                        f"target: {self.daemon.memory()}")
        # (c) an asynchronous save of 4 KiB at 768 MiB of a sparse memfd.
        w = np.arange(1024, dtype=np.float32) * 0.5
        src = memfd(gib, seals=0)
        self.cleanups.append(lambda: os.close(src))
        os.pwrite(src, w.tobytes(), at)
        fcntl.fcntl(src, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        reply, token = send_fd(self.fd_socket, src)
        self.assertTrue(reply.startswith("OK"), reply)
        job = self.job("sparse-async")
        path = os.path.join(self.root, f"sparse-async-{os.getpid()}-{self.counter}")
        req = pb2.SaveRequest(job_id=job, rank=0, world_size=1, path=path, unique_id=0,
                              targets=[target("w", "F32", [1024], dest_offset=at)])
        req.shm.fd_token, req.shm.size = token, gib
        req.async_save = True
        hwm0 = self.reset_hwm()
        first = call("Save", self.stub.Save, req, timeout=60)
        self.assertRpc(first, "OK", what="an asynchronous save from a sparse 1 GiB memfd")
        done = call("AwaitSave", self.stub.AwaitSave,
                    pb2.AwaitSaveRequest(job_id=job, rank=0, timeout_ms=60000), timeout=90)
        grew = self.hwm() - hwm0
        self.assertRpc(done, "OK", what="awaiting the asynchronous save")
        self.assertTrue(done.value.persisted)
        self.assertLess(grew, 64 << 20, f"VmHWM grew by {grew >> 20} MiB for a 4 KiB async "
                                        f"save: {self.daemon.memory()}")
        back = self.stream_load(path, [target("w", "F32", [1024])])
        self.assertRpc(back, "OK", what="loading the version the asynchronous save wrote")
        self.assertEqual(self.stream_bytes(back, w.nbytes), w.tobytes())

    # === 22. cache views stay read-only (issue 33) ====================================

    def test_22_a_cache_view_cannot_be_made_writable(self):
        """A client of the daemon's uid gets read-only cache views; it chmods each
        view's memfd and reopens it read-write through /proc/self/fd: every
        write() and every writable mapping is refused (EPERM: the daemon seals
        its blocks F_SEAL_FUTURE_WRITE once it has mapped them), its own load is
        exact, and a later load served from the cache is byte-exact."""
        from ckptd import _views
        name = "model.layers.0.mlp.up_proj.weight"
        dt, full = self.ref[name]
        if dt != "F32":
            self.skipTest(f"{name} is {dt}")
        ckptd.prefetch(self.tp2, socket=self.daemon.socket)
        tried = []
        original = _views._mapping

        def hostile(key, fd, size):
            os.fchmod(fd, 0o600)
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                try:
                    os.pwrite(rw, b"\xff" * 64, 0)
                    tried.append(("pwrite", "succeeded"))
                except OSError as e:
                    tried.append(("pwrite", errno.errorcode.get(e.errno, e.errno)))
                try:
                    mmap.mmap(rw, size, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
                    tried.append(("writable mmap", "succeeded"))
                except OSError as e:
                    tried.append(("writable mmap", errno.errorcode.get(e.errno, e.errno)))
            finally:
                os.close(rw)
            return original(key, fd, size)

        part = np.full(full.shape, np.nan, np.float32)
        _views._mapping = hostile
        try:
            rep = ckptd.load_state_dict({name: part}, self.tp2, socket=self.daemon.socket,
                                        transport="cache_view")
        finally:
            _views._mapping = original
        self.assertEqual(rep.transport, "cache_view")
        self.assertGreater(rep.bytes_from_views, 0)
        self.assertTrue(tried, "no view was mapped")
        self.assertEqual(set(r for _, r in tried), {"EPERM"}, f"attempts: {tried}")
        np.testing.assert_array_equal(part, full)
        # Served from the cache again (a stream load: the daemon copies).
        rpc = self.stream_load(self.tp2, [target(name, dt, full.shape)])
        self.assertRpc(rpc, "OK", what="a load from the cache after the attempts")
        self.assertEqual(self.stream_bytes(rpc, full.nbytes), full.tobytes())

    # === 23. locks and buffers no other uid can hold (issue 33) =======================

    def test_23_a_reader_cannot_hold_the_save_lock(self):
        """uid 65534 may read a checkpoint directory but not open its save lock
        (flock works on a read-only descriptor: a 0644 lock file let any reader
        hold it forever and every save into the directory got ABORTED); a lock
        file an earlier version left 0644 is closed to others at the next save.
        Root's save goes through while uid 65534 tries."""
        self.need_other_uid()
        d = os.path.join(self.shared, f"locked-{os.getpid()}-{self.counter}")
        x = np.arange(256, dtype=np.float32)
        self.assertRpc(self.raw_save(d, {"x": x}, 0), "OK", what="root's first save")
        os.chmod(d, 0o755)
        lock = os.path.join(d, ".ckptd.lock")
        self.assertEqual(os.stat(lock).st_mode & 0o777, 0o600)
        os.chmod(lock, 0o644)  # as an earlier version left it
        self.assertRpc(self.raw_save(d, {"x": x}, 1), "OK", what="root's second save")
        self.assertEqual(os.stat(lock).st_mode & 0o777, 0o600, "the old lock file stayed 0644")
        holder = subprocess.Popen(
            self.setpriv + ["/usr/bin/python3", "-c",
                            "import fcntl, os, sys, time\n"
                            "try:\n"
                            "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                            "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
                            "    print('HELD', flush=True)\n"
                            "    time.sleep(20)\n"
                            "except OSError as e:\n"
                            "    print('REFUSED', e.errno, flush=True)\n", lock],
            stdout=subprocess.PIPE, text=True)
        self.cleanups.append(holder.kill)
        said = holder.stdout.readline().split()
        self.assertEqual(said[:2], ["REFUSED", str(errno.EACCES)],
                         f"uid {OTHER_UID} opening the save lock: {said}")
        self.assertRpc(self.raw_save(d, {"x": x * 2}, 2), "OK",
                       what="root's save while another uid tried the lock")

    def other_uid_dir(self, what):
        """A new directory of uid 65534 under the savable root."""
        d = os.path.join(self.savable, f"{what}-{os.getpid()}-{self.counter}")
        os.makedirs(d)
        os.chown(d, OTHER_UID, OTHER_UID)
        os.chmod(d, 0o755)
        self.cleanups.append(lambda: shutil.rmtree(d, ignore_errors=True))
        return d

    def test_24_a_rank_that_never_comes_holds_no_save_buffer(self):
        """save_buffer is charged once a job's ranks are all in: rank 0 of a
        2-rank asynchronous save whose rank 1 never comes holds none of it
        (Status: 0 bytes staged), and another uid's asynchronous save of more
        than the room left beside rank 0's bytes goes through at once (it used
        to wait for rank 0's barrier to time out)."""
        self.need_other_uid()
        cfg = os.path.join(self.base, f"save-buffer-{self.counter}.yaml")
        write_config(cfg, [self.root, self.savable], extra=(
            "save_buffer: 4MiB\n"
            "access:\n"
            f"  - root: {json.dumps(self.savable)}\n"
            f"    save_uids: [{OTHER_UID}]\n"))
        dmn = Daemon(cfg)
        self.cleanups.append(dmn.stop)
        path = os.path.join(self.root, f"sb-{os.getpid()}-{self.counter}")
        big = np.arange(3 << 18, dtype=np.float32)  # 3 MiB
        req = self.save_request(path, {"w": big}, 0, job=self.job("sb-half"), world=2,
                                boxes={"w": ([2 * big.size], [0])}, dmn=dmn,
                                barrier_timeout_ms=60000)
        req.async_save = True
        waiting = dmn.stub.Save.future(req, timeout=90)
        self.cleanups.append(waiting.cancel)
        deadline = time.monotonic() + 10
        while True:
            st = call("Status", dmn.stub.Status, pb2.StatusRequest(), timeout=10)
            self.assertRpc(st, "OK", what="Status")
            if any(j.job_id == req.job_id for j in st.value.jobs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.assertTrue(any(j.job_id == req.job_id for j in st.value.jobs), "rank 0 never registered")
        self.assertEqual(st.value.save_staged_bytes, 0,
                         "rank 0 of an incomplete job holds save_buffer")
        # Another uid: 2 MiB, more than the 1 MiB left beside rank 0's 3 MiB.
        other = os.path.join(self.other_uid_dir("sb"), "ckpt")
        t0 = time.monotonic()
        out = self.peer_calls([
            {"memfd": "m", "size": 2 << 20},
            {"rpc": "Save", "timeout": 60, "request": {
                "job_id": "sb-other", "rank": 0, "world_size": 1, "path": other,
                "unique_id": 0, "async_save": True,
                "shm": {"fd_token": "${m}", "size": 2 << 20},
                "targets": [{"name": "o", "dtype": "U8", "global_shape": [2 << 20],
                             "offset": [0], "shape": [2 << 20]}]}},
            {"rpc": "AwaitSave", "request": {"job_id": "sb-other", "rank": 0,
                                             "timeout_ms": 60000}, "timeout": 90}],
            socket=dmn.socket)
        self.assertRpc(out[1], "OK", what=f"uid {OTHER_UID}'s asynchronous save")
        self.assertRpc(out[2], "OK", what=f"uid {OTHER_UID} awaiting its save")
        self.assertLess(time.monotonic() - t0, 30, "the other uid's save waited for room")
        waiting.cancel()

    def test_25_save_records_are_per_uid(self):
        """Two uids pick the same job id for asynchronous saves at once (job ids
        are the clients' own names): both go through, each AwaitSave finds its
        own uid's save, and neither error names the other's job."""
        self.need_other_uid()
        cfg = os.path.join(self.base, f"records-{self.counter}.yaml")
        write_config(cfg, [self.root, self.savable], extra=(
            "access:\n"
            f"  - root: {json.dumps(self.savable)}\n"
            f"    save_uids: [{OTHER_UID}]\n"))
        dmn = Daemon(cfg, "--testing_delay_persist_ms=1500")
        self.cleanups.append(dmn.stop)
        job = self.job("same-id")
        mine = os.path.join(self.root, f"rec-{os.getpid()}-{self.counter}")
        req = self.save_request(mine, {"w": np.arange(64, dtype=np.float32)}, 0, job=job, dmn=dmn)
        req.async_save = True
        first = call("Save", dmn.stub.Save, req, timeout=60)
        self.assertRpc(first, "OK", what="root's asynchronous save")
        self.assertFalse(first.value.persisted)
        theirs = os.path.join(self.other_uid_dir("rec"), "ckpt")
        out = self.peer_calls([
            {"memfd": "m", "size": 4096},
            {"rpc": "Save", "timeout": 60, "request": {
                "job_id": job, "rank": 0, "world_size": 1, "path": theirs, "unique_id": 0,
                "async_save": True, "shm": {"fd_token": "${m}", "size": 4096},
                "targets": [{"name": "o", "dtype": "U8", "global_shape": [4096],
                             "offset": [0], "shape": [4096]}]}},
            {"rpc": "AwaitSave", "request": {"job_id": job, "rank": 0, "timeout_ms": 60000},
             "timeout": 90}],
            socket=dmn.socket)
        self.assertRpc(out[1], "OK", what=f"uid {OTHER_UID}'s save of the same job id")
        self.assertRpc(out[2], "OK", what=f"uid {OTHER_UID} awaiting its own save")
        self.assertTrue(os.path.exists(os.path.join(theirs, "0.metadata")))
        done = call("AwaitSave", dmn.stub.AwaitSave,
                    pb2.AwaitSaveRequest(job_id=job, rank=0, timeout_ms=60000), timeout=90)
        self.assertRpc(done, "OK", what="root awaiting its own save")
        self.assertTrue(done.value.persisted)
        self.assertTrue(os.path.exists(os.path.join(mine, "0.metadata")))

    def test_26_a_socket_another_uid_may_not_open_names_the_group(self):
        """issue 38: a uid outside the socket's group gets PERMISSION_DENIED naming
        the group to join (Python: a PermissionError; ckptctl and the C++ client
        alike), not "is the daemon running?"."""
        self.need_other_uid()
        import grp
        cfg = os.path.join(self.base, f"mode-{os.getpid()}-{self.counter}.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots:\n  - {json.dumps(self.root)}\nsocket_mode: \"0660\"\n")
        dmn = Daemon(cfg)
        self.cleanups.append(dmn.stop)
        st = os.stat(dmn.socket)
        group = grp.getgrgid(st.st_gid).gr_name
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o660)
        pkg = os.path.join(self.peer_dir, "ckptd")
        if not os.path.isdir(pkg):
            shutil.copytree(os.path.dirname(ckptd.__file__), pkg,
                            ignore=shutil.ignore_patterns("__pycache__"))
            ctl = os.path.join(self.peer_dir, "ckptctl")
            shutil.copyfile(testlib.CKPTCTL, ctl)
            for dirpath, dirs, files in os.walk(self.peer_dir):
                for d in dirs:
                    os.chmod(os.path.join(dirpath, d), 0o755)
                for f in files:
                    os.chmod(os.path.join(dirpath, f), 0o755)
        script = ("import sys, ckptd\n"
                  "try:\n    ckptd.status(socket=sys.argv[1])\n"
                  "except PermissionError as e:\n    print(e.code, e.message)\n")
        p = subprocess.run(self.setpriv + ["/usr/bin/python3", "-c", script, dmn.socket],
                           cwd=self.peer_dir, env=self.peer_env(), capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("PERMISSION_DENIED", p.stdout)
        self.assertIn(f"group '{group}', mode 0660; this process is uid {OTHER_UID}", p.stdout)
        self.assertIn(f"join group '{group}'", p.stdout)
        c = subprocess.run(self.setpriv + [os.path.join(self.peer_dir, "ckptctl"), "status",
                                           "--daemon", dmn.socket],
                           cwd=self.peer_dir, env=self.peer_env(), capture_output=True, text=True,
                           timeout=60)
        self.assertNotEqual(c.returncode, 0)
        self.assertIn(f"join group '{group}'", c.stderr)
        self.assertNotIn("is the daemon running", c.stderr)


def file_tensors(path):
    """name -> (begin, end) file offsets of each tensor's bytes (numpy-free
    header parse of a safetensors file)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def unblock_fifos(d):
    """Opens every FIFO in d for writing (non-blocking), releasing a reader an
    old daemon may have left blocked in open()."""
    for f in os.listdir(d):
        p = os.path.join(d, f)
        if stat.S_ISFIFO(os.lstat(p).st_mode):
            try:
                fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass


class OtherUidDaemonTest(unittest.TestCase):
    """docs/grpc-api.md "Transports": a daemon running as another uid may not write this
    process's memory. It refuses process_memory with FAILED_PRECONDITION before
    the job registers, and transport="auto" then loads the same job over shm."""

    def test_auto_falls_back_to_shm(self):
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        if os.geteuid() != 0 or not os.path.exists(setpriv):
            self.skipTest(f"runs ckptd as uid {OTHER_UID} with setpriv [needs: root]")
        base = tempfile.mkdtemp(prefix="ckptd-uid-", dir="/tmp")
        self.addCleanup(shutil.rmtree, base, True)
        os.chmod(base, 0o755)
        root = os.path.join(base, "root")
        hf = os.path.join(root, "tiny-model")
        shutil.copytree(os.path.join(EXAMPLES, "tiny-model"), hf)
        for d, _, files in os.walk(root):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        run = os.path.join(base, "run")
        os.mkdir(run)
        os.chown(run, OTHER_UID, OTHER_UID)
        sock = os.path.join(run, "ckptd.sock")
        log = open(os.path.join(base, "ckptd.log"), "wb")
        self.addCleanup(log.close)
        p = subprocess.Popen([setpriv, "--reuid", str(OTHER_UID), "--regid", str(OTHER_UID), "--clear-groups",
                              os.path.abspath(testlib.CKPTD), "--socket", sock, "--root", root],
                             stdout=log, stderr=subprocess.STDOUT)

        def stop():
            if p.poll() is None:
                p.terminate()
            self.assertEqual(p.wait(30), 0)
        self.addCleanup(stop)
        testlib.wait_for(f"ckptd as uid {OTHER_UID}", lambda: p.poll() is None and
                         os.path.exists(sock) and os.path.exists(sock + ".fd"), 20, 0.05)
        ref = testlib.read_safetensors(os.path.join(hf, "model.safetensors"))
        name = "model.norm.weight"
        want = ref[name][1]
        got = np.full(want.shape, np.nan, want.dtype)
        r = ckptd.load_state_dict({name: got}, hf, socket=sock)
        self.assertEqual(r.transport, "shm")
        np.testing.assert_array_equal(got, want)
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.load_state_dict({name: got}, hf, socket=sock, transport="process_memory")
        self.assertEqual(cm.exception.code, "FAILED_PRECONDITION")
        self.assertIn("process_memory", cm.exception.message)


if __name__ == "__main__":
    testlib.main("abuse_test")
