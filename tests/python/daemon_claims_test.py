"""docs/daemon.md claims held by real processes (the test-honesty issue).

Every case runs the real ckptd binary (testlib.Daemon: a socket in a fresh
/tmp directory; it must exit 0 on SIGTERM at teardown unless the case is
about how it exits), real clients (the Python client in threads of this
process, or in child /usr/bin/python3 processes that get SIGKILLed), real
files, the real /dev/shm and the daemon's /proc entries.

Jobs are kept provably in flight with the daemon's testing-only
--testing-delay-read-ms (a pause before each planned read; cut short when a
job is aborted) on a 4-file checkpoint read in 16 reads (io_request_size
16KiB, one I/O thread). Every wait is for a condition (a progress event of
the Load stream, a Status field, a log line, /proc) under a deadline.

  FileChangeTest  a data file appended to, truncated, renamed over or deleted
                  during a load fails it with ABORTED naming the file on every
                  rank: a file already read (only the end-of-load check can
                  see it) and a file not yet opened; an unchanged copy loads
                  byte-exact through the same slowed daemon (the control).
  DrainTest       SIGTERM: the running load completes byte-exact, new requests
                  (new connection, new call on an old one) are UNAVAILABLE, exit
                  0; drain_timeout running out: UNAVAILABLE naming it on every
                  rank, exit 0 within drain_timeout + 3 s.
  KilledClientTest  a client process SIGKILLed mid-load (the daemon's lent
                  staging arena, an arena it lent to a SharedArena, the
                  client's own memfd passed by fd token) or while holding a
                  lent arena: no /dev/shm entry, no daemon fd or memfd mapping
                  left, no leased bytes; one killed at the barrier is dropped
                  and the job completes for the ranks that come.
  StatusCodeTest  ALREADY_EXISTS (rank registered twice), FAILED_PRECONDITION
                  (job already running; a multi-node job on a daemon without
                  peer_listen), DEADLINE_EXCEEDED within barrier_timeout and
                  within load_timeout (+ margin), fd tokens single use and
                  expiring.
  BeforeBarrierTest  bad targets (box outside the global shape, unknown dtype,
                  segment too small, overlapping destinations) refused with
                  INVALID_ARGUMENT before the rank registers (rank 1 of 2 never
                  comes; the job id stays free); a good rank waits (the control).
  MetadataCacheTest  Inspect and Load of an unchanged checkpoint reuse one cached
                  entry; files rewritten in place (size, inode, mtime kept) and a
                  new version saved by another daemon are seen (Status
                  metadata_cache_entries, the "reopening" log line, the values).
  DisagreeingRanksTest  path, unique_id, world_size (at registration: the rank alone
                  is refused, naming both values) and aoa_config (when the job
                  runs: every rank fails, naming two ranks).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import ckptd
from ckptd import _shm
import testlib

ROWS, COLS = 64, 256
NAMES = [f"layers.{i}.w" for i in range(4)]
SAVE_WORLD = 4                                  # data files of the checkpoint
FILE_BYTES = len(NAMES) * (ROWS // SAVE_WORLD) * COLS * 4  # tensor bytes per data file
TOTAL_BYTES = SAVE_WORLD * FILE_BYTES
READ = "16KiB"                                  # io_request_size: 4 reads per data file
LOAD_WORLD = 2                                  # a load rank holds half the columns
RANK_BYTES = TOTAL_BYTES // LOAD_WORLD


def slowed(delay_ms, *extra):
    """Flags of a daemon whose load jobs take 16 x delay_ms (16 reads, one thread)."""
    return ("--testing-delay-read-ms", str(delay_ms), "--io-threads", "1",
            "--io-request-size", READ, *extra)


def wait_for(what, fn, timeout=20.0, every=0.01):
    """fn()'s first truthy value, polled until `timeout` s; else AssertionError."""
    return testlib.wait_for(what, fn, timeout, every)


def config_file(root, text):
    fd, path = tempfile.mkstemp(suffix=".yaml", dir=root)
    with os.fdopen(fd, "w") as f:
        f.write(f"roots: [{root}]\n{text}")
    return path


_FULL = {}


def full_tensors():
    if not _FULL:
        rng = np.random.default_rng(20)
        for n in NAMES:
            _FULL[n] = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    return _FULL


def make_checkpoint(root):
    """A native checkpoint saved by SAVE_WORLD ranks through a real daemon (one
    data file per rank, split on rows); returns its directory."""
    path = os.path.join(root, "src")
    full = full_tensors()
    rows = ROWS // SAVE_WORLD
    errors = []

    def save(d, r):
        state = {n: ckptd.ShardedTensor(full[n][r * rows:(r + 1) * rows].copy(), (ROWS, COLS),
                                        (r * rows, 0)) for n in NAMES}
        try:
            ckptd.save_state_dict(state, path, rank=r, world_size=SAVE_WORLD, unique_id=0,
                                  job_id="claims-save", socket=d.socket, barrier_timeout=20)
        except ckptd.CkptdError as e:
            errors.append(e)

    with testlib.Daemon(root) as d:
        ts = [threading.Thread(target=save, args=(d, r)) for r in range(SAVE_WORLD)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert not errors, errors
    assert len(data_files(path)) == SAVE_WORLD, os.listdir(path)
    return path


def data_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


class Rank(threading.Thread):
    """One rank of a load job: the Python client (real socket, real shared
    memory) in a thread; rank r of `world` holds columns [r*c, (r+1)*c)."""

    def __init__(self, sock, path, job, rank, world=LOAD_WORLD, **kw):
        super().__init__(daemon=True)
        self.sock, self.path, self.job, self.rank, self.world, self.kw = \
            sock, path, job, rank, world, kw
        c = COLS // world
        self.cols = (rank * c, (rank + 1) * c)
        self.arrays = {n: np.full((ROWS, c), -1.0, np.float32) for n in NAMES}
        self.progress = []  # (bytes_done, bytes_total) of the stream's progress events
        self.report = self.error = self.ended = None
        self.start()

    def run(self):
        state = {n: ckptd.ShardedTensor(a, (ROWS, COLS), (0, self.cols[0]))
                 for n, a in self.arrays.items()}
        try:
            self.report = ckptd.load_state_dict(
                state, self.path, rank=self.rank, world_size=self.world, job_id=self.job,
                socket=self.sock, timeout=60, progress=self._event, **self.kw)
        except ckptd.CkptdError as e:
            self.error = e
        finally:
            self.ended = time.monotonic()

    def _event(self, ev):
        if ev.WhichOneof("event") == "progress":
            self.progress.append((ev.bytes_done, ev.bytes_total))

    def done(self):
        return self.progress[-1][0] if self.progress else 0

    def reading(self, at_least=1):
        """True once a progress event showed >= at_least bytes read of a job not
        yet done reading."""
        return any(at_least <= d < t for d, t in self.progress)

    def finish(self, timeout=60):
        self.join(timeout)
        assert not self.is_alive(), f"rank {self.rank} of job {self.job} still loading"
        return self

    def expected(self):
        full = full_tensors()
        return {n: full[n][:, self.cols[0]:self.cols[1]] for n in NAMES}


def wait_reading(ranks, at_least=1, timeout=20.0):
    wait_for(f"job {ranks[0].job} to be reading (>= {at_least} bytes read, not done)",
             lambda: any(r.reading(at_least) for r in ranks), timeout)


def assert_loaded(tc, r):
    tc.assertIsNone(r.error, f"rank {r.rank} of {r.job}: {r.error}")
    tc.assertEqual(r.report.bytes_delivered, RANK_BYTES, f"rank {r.rank}")
    for n, want in r.expected().items():
        np.testing.assert_array_equal(r.arrays[n], want, err_msg=f"rank {r.rank} {n}")


def assert_failed(tc, r, code, *texts):
    tc.assertIsNone(r.report, f"rank {r.rank} of {r.job} succeeded; expected {code}")
    tc.assertIsNotNone(r.error, f"rank {r.rank} of {r.job} neither failed nor succeeded")
    tc.assertEqual(r.error.code, code, f"rank {r.rank}: {r.error}")
    for t in texts:
        tc.assertIn(t, r.error.message, f"rank {r.rank}")


def refused(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return True
        except FileNotFoundError:
            return False  # gone: the daemon exited (not what is asked)
    return False


def status(sock):
    with ckptd.Client(sock) as c:
        return c.status()


def jobs(sock):
    return {j["job_id"]: j for j in status(sock).get("jobs", [])}


# --- 1. a data file changing during a load ---------------------------------------------

class FileChangeTest(unittest.TestCase):
    """docs/daemon.md: "a file that changes or vanishes during a load fails that load
    (ABORTED)" (and Errors: ABORTED "a file changed during the load")."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        # 16 reads x 100 ms: a job is in flight for ~1.6 s.
        cls.daemon = testlib.Daemon(cls.root, *slowed(100))

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc} at teardown: {cls.daemon.read_log()[-3000:]}"

    def change_during_load(self, change, which):
        """Starts a 2-rank load of a fresh copy, changes one data file while the
        job is provably in flight, and checks every rank fails ABORTED naming
        it. which="read": the first file, after all its reads (only a check at
        the end of the load can see it); "unopened": the last file, before the
        job opened it."""
        path = os.path.join(self.root, f"{change}-{which}")
        shutil.copytree(self.src, path)
        files = data_files(path)
        target = files[0] if which == "read" else files[-1]
        f = os.path.join(path, target)
        job = f"change-{change}-{which}"
        ranks = [Rank(self.daemon.socket, path, job, r) for r in range(LOAD_WORLD)]
        # Reads go in file-name order on the one I/O thread: after FILE_BYTES
        # the first file has been read whole; the last is opened at 3 x FILE_BYTES.
        wait_reading(ranks, FILE_BYTES if which == "read" else 1)
        if which == "unopened":
            self.assertLess(max(r.done() for r in ranks), 3 * FILE_BYTES)
        size = os.path.getsize(f)
        if change == "append":
            with open(f, "ab") as fh:
                fh.write(b"\0" * 4096)
        elif change == "truncate":
            os.truncate(f, size // 2)
        elif change == "rename":
            # Same size, other bytes, a new inode renamed over the old name.
            with open(f, "rb") as fh:
                data = bytearray(fh.read())
            for i in range(size - FILE_BYTES, size, 4):
                data[i] ^= 0x40
            with open(f + ".new", "wb") as fh:
                fh.write(data)
            os.replace(f + ".new", f)
        elif change == "delete":
            os.unlink(f)
        # The change was made while the job ran: no rank had its answer yet
        # and none had seen every byte read.
        for r in ranks:
            self.assertTrue(r.is_alive() and r.done() < TOTAL_BYTES,
                            f"job {job} ended before the file changed; slow it more")
        for r in ranks:
            r.finish()
            assert_failed(self, r, "ABORTED", target)
        self.assertNotIn(job, jobs(self.daemon.socket))

    def test_append_to_file_already_read(self):
        self.change_during_load("append", "read")

    def test_append_to_file_not_yet_opened(self):
        self.change_during_load("append", "unopened")

    def test_truncate_file_already_read(self):
        self.change_during_load("truncate", "read")

    def test_truncate_file_not_yet_opened(self):
        self.change_during_load("truncate", "unopened")

    def test_rename_over_file_already_read(self):
        self.change_during_load("rename", "read")

    def test_rename_over_file_not_yet_opened(self):
        self.change_during_load("rename", "unopened")

    def test_delete_file_already_read(self):
        self.change_during_load("delete", "read")

    def test_delete_file_not_yet_opened(self):
        self.change_during_load("delete", "unopened")

    def test_unchanged_copy_loads_byte_exact(self):
        """The control: the same slowed daemon loads an untouched copy."""
        path = os.path.join(self.root, "unchanged")
        shutil.copytree(self.src, path)
        ranks = [Rank(self.daemon.socket, path, "unchanged", r) for r in range(LOAD_WORLD)]
        for r in ranks:
            assert_loaded(self, r.finish())


# --- 2. SIGTERM drains -----------------------------------------------------------------

class DrainTest(unittest.TestCase):
    """docs/daemon.md: "SIGTERM stops accepting, waits up to drain_timeout for running
    loads, and exits" (exit status 0; loads still running when drain_timeout
    runs out fail with UNAVAILABLE naming it)."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)

    def test_running_load_completes_new_requests_refused_exit_0(self):
        with testlib.Daemon(self.root, *slowed(150)) as d:  # ~2.4 s per job
            before = ckptd.Client(d.socket)  # a connection made before SIGTERM
            before.status()
            ranks = [Rank(d.socket, self.src, "drained", r) for r in range(LOAD_WORLD)]
            wait_reading(ranks)
            d.proc.send_signal(signal.SIGTERM)
            wait_for("the drain to begin", lambda: "draining running loads" in d.read_log())
            # New connections are refused at once (not left in the backlog).
            wait_for("connections to be refused", lambda: refused(d.socket), timeout=5)
            with self.assertRaises(ckptd.CkptdError) as new_client:
                ckptd.Client(d.socket, connect_timeout=5)
            self.assertEqual(new_client.exception.code, "UNAVAILABLE", new_client.exception)
            # A new Load on a connection from before SIGTERM is refused too.
            late = {n: np.zeros((ROWS, COLS), np.float32) for n in NAMES}
            with self.assertRaises(ckptd.CkptdError) as new_call:
                before.load_state_dict(late, self.src, rank=0, world_size=1, job_id="late",
                                       timeout=10)
            self.assertEqual(new_call.exception.code, "UNAVAILABLE", new_call.exception)
            before.close()
            # ... all while the job was still running.
            for r in ranks:
                self.assertTrue(r.is_alive(), "the drained job ended before the checks")
            # Every rank gets its result although ckptd exits right after the
            # job (it keeps the connections open a moment, and a client that
            # has the result does not fail on a connection lost after it).
            for r in ranks:
                r.finish()
                assert_loaded(self, r)
            self.assertEqual(d.proc.wait(30), 0, d.read_log()[-3000:])
            self.assertRegex(d.read_log(),
                             rf"load job=drained .* delivered={RANK_BYTES * LOAD_WORLD}B ")

    def test_drain_timeout_fails_running_load_and_exits_in_time(self):
        cfg = config_file(self.root, "drain_timeout: 1s\n")
        with testlib.Daemon(self.root, "--config", cfg, *slowed(500)) as d:  # ~8 s per job
            ranks = [Rank(d.socket, self.src, "cut", r) for r in range(LOAD_WORLD)]
            wait_reading(ranks)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            try:
                rc = d.proc.wait(1 + 3)
            except subprocess.TimeoutExpired:
                self.fail(f"ckptd still running 4 s after SIGTERM with drain_timeout 1s: "
                          f"{d.read_log()[-2000:]}")
            exited = time.monotonic() - t0
            self.assertEqual(rc, 0, d.read_log()[-3000:])  # docs/daemon.md: exits 0 either way
            for r in ranks:
                r.finish(10)
                assert_failed(self, r, "UNAVAILABLE", "job 'cut'", "drain_timeout 1s")
                # It waited for the drain, and no longer than it plus the margin.
                self.assertGreater(r.ended - t0, 0.9)
                self.assertLess(r.ended - t0, 1 + 3)
            self.assertGreater(exited, 0.9)
            self.assertIn("drain_timeout 1s ran out: failed 1 load job(s) still waiting or "
                          "running: cut", d.read_log())


# --- 3. clients SIGKILLed --------------------------------------------------------------

CHILD = r"""
import os, sys, time
import numpy as np
import ckptd
mode, sock, path, job, name = sys.argv[1:6]
rows, cols, names = %d, %d, %r
nbytes = len(names) * rows * cols * 4
if mode == "idle-arena":
    arena = ckptd.SharedArena(nbytes, daemon=sock)
    time.sleep(600)
transport = "auto"
if mode == "staging":        # plain arrays: staged through an arena the daemon lends
    state = {n: np.zeros((rows, cols), np.float32) for n in names}
    transport = "shm"
elif mode == "process-memory":  # plain arrays written by the daemon (process_vm_writev)
    state = {n: np.zeros((rows, cols), np.float32) for n in names}
    transport = "process_memory"
else:
    arena = ckptd.SharedArena(nbytes, name=name, daemon=sock if mode == "lent-arena" else None)
    state = {n: arena.empty((rows, cols), np.float32) for n in names}
ckptd.load_state_dict(state, path, rank=0, world_size=1, job_id=job, socket=sock, timeout=120,
                      transport=transport)
time.sleep(600)
""" % (ROWS, COLS, NAMES)


def leased(client):
    return int(client.status()["arena_leased_bytes"])


def fd_links(pid):
    out = {}
    d = f"/proc/{pid}/fd"
    for fd in os.listdir(d):
        try:
            out[int(fd)] = os.readlink(os.path.join(d, fd))
        except OSError:
            pass  # closed meanwhile
    return out


def maps(pid):
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def memfd_maps(pid):
    """The memfd mappings of `pid` (address range and name)."""
    return {l for l in maps(pid).splitlines() if "/memfd:" in l}


class KilledClientTest(unittest.TestCase):
    """docs/daemon.md: lent arenas are "given back when the client closes its lease or
    dies"; a client's own memfd segment means "nothing is left in /dev/shm if
    anyone dies"; "A client that leaves while waiting is dropped from the job
    without affecting the others"."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        # arena_pool 0: an arena given back is unmapped and closed at once
        # (none kept for the next client), so every fd and mapping must go.
        cfg = config_file(cls.root, "arena_pool: 0\n")
        cls.daemon = testlib.Daemon(cls.root, "--config", cfg, *slowed(100))
        cls.pid = cls.daemon.proc.pid
        cls.client = ckptd.Client(cls.daemon.socket)
        cls.client.status()  # its connection is part of the baseline

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc} at teardown: {cls.daemon.read_log()[-3000:]}"

    def spawn(self, mode, job):
        name = f"ckptd-claims-{mode}-{os.getpid()}"
        env = dict(os.environ)
        p = subprocess.Popen([sys.executable, "-c", CHILD, mode, self.daemon.socket, self.src,
                              job, name], env=env, stdout=subprocess.DEVNULL)
        self.addCleanup(lambda: (p.poll() is None and p.kill(), p.wait()))
        return p, name

    def kill_and_check(self, mode, in_flight):
        sock, pid = self.daemon.socket, self.pid
        wait_for("no lent arenas", lambda: leased(self.client) == 0)
        fds0 = fd_links(pid)
        memfds0 = memfd_maps(pid)
        shm0 = set(os.listdir("/dev/shm"))
        job = f"killed-{mode}"
        p, name = self.spawn(mode, job)

        def child(cond):
            if p.poll() is not None:
                raise AssertionError(f"the {mode} client exited {p.returncode}")
            return cond()

        if in_flight:
            wait_for(f"job {job} reading",
                     lambda: child(lambda: jobs(sock).get(job, {}).get("state") == "reading"))
        if mode == "process-memory":
            # No segment: the daemon holds a pidfd on the client instead.
            wait_for("the daemon's pidfd on the client", lambda: child(
                lambda: "anon_inode:[pidfd]" in fd_links(pid).values()))
        else:  # its segment is mapped (a memfd)
            wait_for(f"the {mode} client's segment",
                     lambda: child(lambda: "/memfd:" in maps(p.pid)))
        st = self.client.status()
        lent = leased(self.client)
        # What the client and the daemon hold now: memfds, nothing in /dev/shm.
        cmaps, dmaps = maps(p.pid), maps(pid)
        self.assertNotIn("/dev/shm/", cmaps)
        self.assertNotIn("/dev/shm/", dmaps)
        for who in (p.pid, pid):
            self.assertFalse([l for l in fd_links(who).values() if l.startswith("/dev/shm/")])
        if mode == "process-memory":
            self.assertEqual(lent, 0)
            self.assertNotIn("/memfd:", cmaps)
        elif mode == "own-memfd":
            self.assertEqual(lent, 0)
            self.assertIn(f"/memfd:{name}", cmaps)
            self.assertIn(f"/memfd:{name}", dmaps)  # the daemon mapped the client's segment
        else:
            self.assertGreater(lent, 0, st)
            self.assertIn("/memfd:", cmaps)
        # The daemon holds something of this client now (so "nothing left"
        # below says something): its segment mapped, its connections open.
        if mode != "process-memory":
            self.assertTrue({m for m in memfd_maps(pid) - memfds0 if "/memfd:ckptd-cache" not in m},
                            "the daemon maps no segment of the client")
        self.assertTrue({fd for fd, l in fd_links(pid).items()
                         if fds0.get(fd) != l and "/memfd:ckptd-cache" not in l},
                        "the daemon holds no fd of the client")
        p.send_signal(signal.SIGKILL)
        self.assertEqual(p.wait(10), -signal.SIGKILL)

        def released():
            # (The daemon's data cache is in memfds of its own, "ckptd-cache":
            # the load may have filled some; they are not the client's.)
            st = self.client.status()
            extra = {fd: l for fd, l in fd_links(pid).items()
                     if fds0.get(fd) != l and "/memfd:ckptd-cache" not in l}
            left = {m for m in memfd_maps(pid) - memfds0 if "/memfd:ckptd-cache" not in m}
            lent = int(st["arena_leased_bytes"])
            if st.get("jobs") or lent or extra or left:
                self.last = (st.get("jobs"), lent, extra, left)
                return False
            return True

        self.last = None
        try:
            wait_for(f"the daemon to let go of everything of the killed {mode} client", released)
        except AssertionError as e:
            raise AssertionError(f"{e}: jobs, leased bytes, extra fds, mappings left: "
                                 f"{self.last}") from None
        # (Python multiprocessing's named semaphores, sem.mp-*, are other tests'
        # running at the same time, e.g. the gloo ranks of tests/foreign; neither
        # the daemon nor this client makes any.)
        self.assertEqual({f for f in set(os.listdir("/dev/shm")) - shm0
                          if not f.startswith("sem.mp-")}, set())
        self.assertIsNone(self.daemon.proc.poll(), "ckptd died")

    def test_killed_mid_load_staging_arena(self):
        """Plain arrays: the client stages them in an arena the daemon lends
        (its memfd passed to the client over the fd socket)."""
        self.kill_and_check("staging", in_flight=True)

    def test_killed_mid_load_process_memory(self):
        """Plain arrays written by the daemon itself (process_vm_writev): the
        daemon lets go of its pidfd and the job; the daemon does not crash."""
        self.kill_and_check("process-memory", in_flight=True)

    def test_killed_mid_load_into_lent_shared_arena(self):
        """ckptd.SharedArena(n, daemon=socket): the lent arena is the destination."""
        self.kill_and_check("lent-arena", in_flight=True)

    def test_killed_mid_load_into_own_memfd(self):
        """ckptd.SharedArena(n): the client's memfd, handed over by fd token."""
        self.kill_and_check("own-memfd", in_flight=True)

    def test_killed_while_holding_lent_arena(self):
        self.kill_and_check("idle-arena", in_flight=False)

    def test_killed_while_waiting_for_ranks_others_unaffected(self):
        """A rank killed at the barrier is dropped; the job completes for the
        ranks that register afterwards (the dead one's rank re-registered)."""
        sock = self.daemon.socket
        job = "killed-waiting"
        p, _ = self.spawn_waiting(job)
        wait_for("rank 0 registered", lambda: jobs(sock).get(job, {}).get("registered_ranks") == [0])
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        wait_for("the dead rank dropped", lambda: job not in jobs(sock))
        ranks = [Rank(sock, self.src, job, r) for r in range(LOAD_WORLD)]
        for r in ranks:
            assert_loaded(self, r.finish())
        wait_for("no lent arenas", lambda: leased(self.client) == 0)

    def spawn_waiting(self, job):
        """Rank 0 of a 2-rank job, in a child process, waiting at the barrier."""
        code = ("import sys, numpy as np, ckptd\n"
                f"s = {{n: ckptd.ShardedTensor(np.zeros(({ROWS}, {COLS // 2}), np.float32), "
                f"({ROWS}, {COLS}), (0, 0)) for n in {NAMES!r}}}\n"
                "ckptd.load_state_dict(s, sys.argv[2], rank=0, world_size=2, job_id=sys.argv[3],"
                " socket=sys.argv[1], timeout=120)\n")
        p = subprocess.Popen([sys.executable, "-c", code, self.daemon.socket, self.src, job])
        self.addCleanup(lambda: (p.poll() is None and p.kill(), p.wait()))
        return p, None


class ClientThreadsTest(unittest.TestCase):
    """Threads of one process making their first client calls at once (as the
    rank threads above do): the lazily imported stubs must be whole for all."""

    def test_first_calls_from_many_threads_at_once(self):
        code = ("import sys, threading, ckptd\n"
                "b, errors = threading.Barrier(8), []\n"
                "def call():\n"
                "    b.wait()\n"
                "    try:\n"
                "        with ckptd.Client(sys.argv[1]) as c:\n"
                "            c.status()\n"
                "    except Exception as e:\n"
                "        errors.append(repr(e))\n"
                "ts = [threading.Thread(target=call) for _ in range(8)]\n"
                "for t in ts: t.start()\n"
                "for t in ts: t.join()\n"
                "print(errors)\n"
                "sys.exit(1 if errors else 0)\n")
        with testlib.Daemon(testlib.tmp_root()) as d:
            for _ in range(3):
                p = subprocess.run([sys.executable, "-c", code, d.socket], capture_output=True,
                                   text=True, timeout=60)
                self.assertEqual(p.returncode, 0, p.stdout + p.stderr)


# --- 4. status codes -------------------------------------------------------------------

VIEWS_CHILD = r"""
import os, sys, time
import numpy as np
import ckptd
from ckptd import _shm, _views
sock, path, ready = sys.argv[1:4]
def stuck(fd_socket, views, targets, timeout=10.0):
    s, fds = _shm.take_views(fd_socket, views.token, len(views.view_bytes))
    maps = [_views._mapping(k, fd, n) for k, fd, n in zip(views.view_keys, fds, views.view_bytes)]
    open(ready, "w").close()
    time.sleep(600)  # holds the views, never copies
_views.copy_views = stuck
state = {n: np.zeros((%d, %d), np.float32) for n in %r}
ckptd.load_state_dict(state, path, rank=0, world_size=1, job_id="views-stuck", socket=sock,
                      transport="cache_view", timeout=120)
""" % (ROWS, COLS, NAMES)


class CacheViewsTest(unittest.TestCase):
    """docs/grpc-api.md "Transports", cache_view: the client copies what the daemon's
    cache holds from read-only views; the daemon holds the views until the client is
    done, out of time (load_timeout) or gone, and then fails only that rank."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        cls.daemon = testlib.Daemon(cls.root, "--config", config_file(cls.root, "load_timeout: 3s\n"))
        ckptd.prefetch(cls.src, socket=cls.daemon.socket)

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc}: {cls.daemon.read_log()[-3000:]}"

    def held(self):
        return int(ckptd.status(socket=self.daemon.socket).get("views_held", 0))

    def load(self, job):
        state = {n: np.full((ROWS, COLS), np.nan, np.float32) for n in NAMES}
        rep = ckptd.load_state_dict(state, self.src, rank=0, world_size=1, job_id=job,
                                    socket=self.daemon.socket, transport="cache_view")
        for n in NAMES:
            np.testing.assert_array_equal(state[n], full_tensors()[n])
        return rep

    def test_views_are_copied_exactly(self):
        rep = self.load("views-exact")
        self.assertEqual(rep.transport, "cache_view")
        self.assertEqual(rep.bytes_from_views, TOTAL_BYTES)
        self.assertEqual(self.held(), 0)

    def test_a_client_that_never_takes_its_views_fails_within_load_timeout(self):
        from ckptd import _views
        real = _views.copy_views
        _views.copy_views = lambda *a, **k: None  # takes nothing, copies nothing
        t0 = time.monotonic()
        try:
            with self.assertRaises(ckptd.CkptdError) as cm:
                self.load("views-ignored")
        finally:
            _views.copy_views = real
        self.assertEqual(cm.exception.code, "DEADLINE_EXCEEDED")
        self.assertIn("job 'views-ignored' rank 0: the client did not take its cache views",
                      cm.exception.message)
        self.assertLess(time.monotonic() - t0, 3 + 5)
        wait_for("the views let go", lambda: self.held() == 0)
        self.assertEqual(self.load("views-after-ignored").bytes_from_views, TOTAL_BYTES)

    def test_a_client_killed_holding_its_views_leaves_nothing_held(self):
        ready = os.path.join(self.root, "views-ready")
        p = subprocess.Popen([sys.executable, "-c", VIEWS_CHILD, self.daemon.socket, self.src,
                              ready], stdout=subprocess.DEVNULL)
        self.addCleanup(lambda: (p.poll() is None and p.kill(), p.wait()))
        wait_for("the child mapping its views",
                 lambda: os.path.exists(ready) or p.poll() is not None)
        self.assertIsNone(p.poll(), "the child exited")
        self.assertIn("/memfd:ckptd-cache", maps(p.pid))  # the cache's blocks, read-only
        for line in maps(p.pid).splitlines():
            if "/memfd:ckptd-cache" in line:
                self.assertTrue(line.split()[1].startswith("r--"), line)
        self.assertEqual(self.held(), 1)
        p.send_signal(signal.SIGKILL)
        self.assertEqual(p.wait(10), -signal.SIGKILL)
        wait_for("the views let go", lambda: self.held() == 0)
        self.assertEqual(self.load("views-after-killed").bytes_from_views, TOTAL_BYTES)
        self.assertIsNone(self.daemon.proc.poll(), "ckptd died")


class StatusCodeTest(unittest.TestCase):
    """docs/grpc-api.md "Errors use the standard codes": the ones no other test held."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)

    def load_one(self, sock, job, rank=0, world=1, **kw):
        r = Rank(sock, self.src, job, rank, world=world, **kw)
        return r.finish(30)

    def test_rank_registered_twice_is_already_exists(self):
        with testlib.Daemon(self.root) as d:
            first = Rank(d.socket, self.src, "twice", 0)
            wait_for("rank 0 registered",
                     lambda: jobs(d.socket).get("twice", {}).get("registered_ranks") == [0])
            again = self.load_one(d.socket, "twice", rank=0, world=LOAD_WORLD)
            assert_failed(self, again, "ALREADY_EXISTS", "job 'twice' rank 0 is already registered")
            # The refused duplicate did not disturb the job.
            second = Rank(d.socket, self.src, "twice", 1)
            assert_loaded(self, first.finish())
            assert_loaded(self, second.finish())

    def test_joining_a_running_job_is_failed_precondition(self):
        with testlib.Daemon(self.root, *slowed(60)) as d:
            running = Rank(d.socket, self.src, "running", 0, world=1)
            # (A job's last rank runs it: its own stream gets no progress events.)
            wait_for("job running reading",
                     lambda: jobs(d.socket).get("running", {}).get("state") == "reading")
            late = self.load_one(d.socket, "running", rank=0, world=1)
            assert_failed(self, late, "FAILED_PRECONDITION", "job 'running' is already running")
            self.assertTrue(running.is_alive(), "the running job ended before the late rank came")
            r = running.finish()
            self.assertIsNone(r.error, r.error)
            self.assertEqual(r.report.bytes_delivered, TOTAL_BYTES)

    def test_multi_node_job_without_peer_listen_is_failed_precondition(self):
        with testlib.Daemon(self.root) as d:
            r = self.load_one(d.socket, "two-nodes", rank=0, world=LOAD_WORLD, node_ranks=[0])
            assert_failed(self, r, "FAILED_PRECONDITION", "no peer_listen configured")

    def test_missing_ranks_fail_within_barrier_timeout(self):
        with testlib.Daemon(self.root) as d:
            t0 = time.monotonic()
            r = self.load_one(d.socket, "alone", rank=0, world=LOAD_WORLD, barrier_timeout=0.5)
            assert_failed(self, r, "DEADLINE_EXCEEDED", "ranks 1 never registered")
            self.assertGreater(r.ended - t0, 0.45)
            self.assertLess(r.ended - t0, 0.5 + 2)
            self.assertNotIn("alone", jobs(d.socket))

    def test_running_job_fails_within_load_timeout(self):
        cfg = config_file(self.root, "load_timeout: 1s\n")
        with testlib.Daemon(self.root, "--config", cfg, *slowed(300)) as d:  # ~5 s per job
            ranks = [Rank(d.socket, self.src, "slow", r) for r in range(LOAD_WORLD)]
            wait_for("both ranks registered", lambda: all(r.progress for r in ranks))
            t0 = time.monotonic()
            for r in ranks:
                r.finish(10)
                assert_failed(self, r, "DEADLINE_EXCEEDED", "job 'slow'", "load_timeout 1s")
                self.assertLess(r.ended - t0, 1 + 2)

    def test_fd_token_is_single_use(self):
        with testlib.Daemon(self.root) as d:
            with _shm.Segment(TOTAL_BYTES, "ckptd-claims-token") as seg:
                token = _shm.send_fd(d.socket + ".fd", seg.fd)
                codes = [self.raw_load(d.socket, f"token-{i}", token) for i in range(2)]
            self.assertEqual(codes[0][0], "OK", codes[0])
            self.assertEqual(codes[1][0], "INVALID_ARGUMENT", codes[1])
            self.assertIn("is unknown or expired", codes[1][1])

    def test_fd_token_expires(self):
        # fd tokens expire after barrier_timeout + 1 minute; the testing-only
        # flag shortens that so the expiry itself can be seen.
        with testlib.Daemon(self.root, "--testing-fd-token-ttl-ms", "300") as d:
            with _shm.Segment(TOTAL_BYTES, "ckptd-claims-expiring") as seg:
                token = _shm.send_fd(d.socket + ".fd", seg.fd)
                pid = d.proc.pid
                held = lambda: any("/memfd:ckptd-claims-expiring" in l
                                   for l in fd_links(pid).values())
                self.assertTrue(held(), "the daemon should hold the fd under its token")
                wait_for("the daemon to drop the expired fd", lambda: not held(), timeout=10)
                code = self.raw_load(d.socket, "token-late", token)
            self.assertEqual(code[0], "INVALID_ARGUMENT", code)
            self.assertIn("is unknown or expired", code[1])

    def raw_load(self, sock, job, token):
        """(code, message) of a 1-rank Load of every tensor into the segment
        named by fd `token`."""
        with ckptd.Client(sock) as c:
            pb2 = c._pb2
            req = pb2.LoadRequest(job_id=job, rank=0, world_size=1, path=self.src)
            req.shm.fd_token, req.shm.size = token, TOTAL_BYTES
            for i, n in enumerate(NAMES):
                req.targets.add(name=n, dtype="F32", global_shape=[ROWS, COLS], offset=[0, 0],
                                shape=[ROWS, COLS], dest_offset=i * ROWS * COLS * 4)
            try:
                for ev in c._stub.Load(req, timeout=30):
                    pass
            except c._grpc.RpcError as e:
                return e.code().name, e.details()
            return "OK", ""


# --- 5. requests refused before the barrier --------------------------------------------

def raw_load(sock, path, job, rank, world, targets, shm=None, barrier_ms=60000, timeout=20):
    """One raw Load call: (code, message, events). `targets`: (name, dtype,
    global_shape, offset, shape, dest_offset) tuples; `shm`: (fd_token, size).
    The gRPC deadline (`timeout`) is far below the barrier deadline, so a call
    that waited at the barrier comes back DEADLINE_EXCEEDED, not the refusal."""
    events = []
    with ckptd.Client(sock) as c:
        req = c._pb2.LoadRequest(job_id=job, rank=rank, world_size=world, path=path,
                                barrier_timeout_ms=barrier_ms)
        for name, dtype, gshape, offset, shape, dest in targets:
            req.targets.add(name=name, dtype=dtype, global_shape=gshape, offset=offset,
                            shape=shape, dest_offset=dest)
        if shm is not None:
            req.shm.fd_token, req.shm.size = shm
        else:
            req.stream.SetInParent()
        try:
            for ev in c._stub.Load(req, timeout=timeout):
                events.append(ev)
        except c._grpc.RpcError as e:
            return e.code().name, e.details(), events
        return "OK", "", events


def whole(name, i=0, dtype="F32", gshape=(ROWS, COLS), offset=(0, 0), shape=(ROWS, COLS)):
    return (name, dtype, list(gshape), list(offset), list(shape), i * ROWS * COLS * 4)


class BeforeBarrierTest(unittest.TestCase):
    """docs/daemon.md "What one load does", step 1: bad targets are refused at once
    with INVALID_ARGUMENT naming the rank and tensor; the rank never registers, so it
    does not wait for the others (here rank 1 of 2 never comes)."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        cls.daemon = testlib.Daemon(cls.root)

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc} at teardown: {cls.daemon.read_log()[-3000:]}"

    def refused_at_once(self, job, targets, *texts, shm=None):
        sock = self.daemon.socket
        code, msg, events = raw_load(sock, self.src, job, 0, LOAD_WORLD, targets, shm=shm)
        self.assertEqual(code, "INVALID_ARGUMENT", msg)
        for t in (f"job '{job}'", "rank 0") + texts:
            self.assertIn(t, msg)
        # Refused before it registered: no "registered rank" event, no job.
        self.assertEqual([e.WhichOneof("event") for e in events], [])
        self.assertNotIn(job, jobs(sock))
        # The job id is still free: a good job under it runs (rank 0 was never
        # registered, else this rank 0 would be ALREADY_EXISTS).
        ranks = [Rank(sock, self.src, job, r) for r in range(LOAD_WORLD)]
        for r in ranks:
            assert_loaded(self, r.finish())

    def test_box_outside_global_shape(self):
        self.refused_at_once("early-box", [whole(NAMES[0]), whole(NAMES[1], 1, offset=(1, 0))],
                             f"job 'early-box': rank 0 tensor '{NAMES[1]}': box "
                             f"({ROWS},{COLS})@(1,0) lies outside the global shape [{ROWS},{COLS}]")

    def test_unknown_dtype(self):
        self.refused_at_once("early-dtype", [whole(NAMES[0]), whole(NAMES[2], 1, dtype="F33")],
                             f"rank 0 tensor '{NAMES[2]}'", "F33")

    def test_segment_too_small(self):
        with _shm.Segment(ROWS * COLS * 4, "ckptd-claims-small") as seg:
            token = _shm.send_fd(self.daemon.socket + ".fd", seg.fd)
            self.refused_at_once("early-small", [whole(NAMES[0]), whole(NAMES[3], 1)],
                                 f"rank 0 tensor '{NAMES[3]}'", "(segment too small)",
                                 shm=(token, ROWS * COLS * 4))

    def test_overlapping_destinations(self):
        size = 2 * ROWS * COLS * 4
        with _shm.Segment(size, "ckptd-claims-overlap") as seg:
            token = _shm.send_fd(self.daemon.socket + ".fd", seg.fd)
            t1 = whole(NAMES[1], 0)
            t1 = t1[:5] + (ROWS * COLS * 2,)  # halfway into NAMES[0]'s bytes
            self.refused_at_once("early-overlap", [whole(NAMES[0], 0), t1],
                                 "job 'early-overlap' rank 0: two targets overlap in the "
                                 f"segment at byte {ROWS * COLS * 2}: tensor '{NAMES[0]}' "
                                 f"[0, {ROWS * COLS * 4}) and tensor '{NAMES[1]}' "
                                 f"[{ROWS * COLS * 2}, {ROWS * COLS * 6})", shm=(token, size))

    def test_control_good_rank_waits_at_the_barrier(self):
        """The control: the same call with good targets registers and waits (its
        first event says so) until its barrier deadline names the missing rank."""
        code, msg, events = raw_load(self.daemon.socket, self.src, "early-good", 0, LOAD_WORLD,
                                     [whole(NAMES[0])], barrier_ms=300)
        self.assertEqual(code, "DEADLINE_EXCEEDED", msg)
        self.assertIn("ranks 1 never registered", msg)
        self.assertEqual([e.progress for e in events][:1],
                         ["registered rank 0 (1 of 2 ranks of job 'early-good')"])


# --- 6. the metadata cache -------------------------------------------------------------

def save_values(sock, path, values, unique_id=0, job="claims-resave", overwrite=False):
    """Saves `values` ({name: (ROWS, COLS) array}) as version `unique_id` of `path` over
    SAVE_WORLD ranks, split on rows as make_checkpoint does (same files, same sizes)."""
    rows = ROWS // SAVE_WORLD
    errors = []

    def save(r):
        state = {n: ckptd.ShardedTensor(values[n][r * rows:(r + 1) * rows].copy(), (ROWS, COLS),
                                        (r * rows, 0)) for n in NAMES}
        try:
            with ckptd.Client(sock) as c:
                c.save_state_dict(state, path, rank=r, world_size=SAVE_WORLD, unique_id=unique_id,
                                  job_id=job, overwrite=overwrite, barrier_timeout=20)
        except ckptd.CkptdError as e:
            errors.append(e)

    ts = [threading.Thread(target=save, args=(r,)) for r in range(SAVE_WORLD)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


def load_whole(sock, path, job):
    """{name: array} of a 1-rank load of every tensor of `path`."""
    out = {n: np.full((ROWS, COLS), -1.0, np.float32) for n in NAMES}
    ckptd.load_state_dict(out, path, rank=0, world_size=1, job_id=job, socket=sock, timeout=60)
    return out


class MetadataCacheTest(unittest.TestCase):
    """docs/daemon.md "What one load does", step 3: metadata from the metadata cache
    when no file changed (directory, metadata and data files compared by
    device/inode/size/mtime/ctime). Seen from outside: Status
    `metadata_cache_entries`, and the log line "metadata of DIR changed on disk;
    reopening" that a cached entry found stale writes (it is written for nothing else)."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        rng = np.random.default_rng(21)
        cls.other = {n: rng.standard_normal((ROWS, COLS)).astype(np.float32) for n in NAMES}
        # The same layout with other values, saved elsewhere by another daemon.
        cls.src2 = os.path.join(cls.root, "src2")
        with testlib.Daemon(cls.root) as d:
            save_values(d.socket, cls.src2, cls.other)
        assert os.listdir(cls.src2) and sorted(os.listdir(cls.src2)) == sorted(os.listdir(cls.src))

    def setUp(self):
        self.daemon = testlib.Daemon(self.root)
        self.addCleanup(self.stop)

    def stop(self):
        rc = self.daemon.stop()
        self.assertEqual(rc, 0, self.daemon.read_log()[-3000:])

    def entries(self):
        return int(status(self.daemon.socket)["metadata_cache_entries"])

    def reopened(self, path):
        return self.daemon.read_log().count(
            f"metadata of {os.path.realpath(path)} changed on disk; reopening")

    def inspect(self, path):
        with ckptd.Client(self.daemon.socket) as c:
            return c.inspect(path)

    def cached_copy(self, name):
        """A copy of src, inspected twice and loaded once through the daemon: one
        cache entry, opened once and reused (never found stale)."""
        path = os.path.join(self.root, name)
        shutil.copytree(self.src, path)
        self.assertEqual(self.entries(), 0)
        first = self.inspect(path)
        self.assertEqual(self.entries(), 1)
        self.assertEqual(self.inspect(path), first)
        got = load_whole(self.daemon.socket, path, f"{name}-1")
        for n in NAMES:
            np.testing.assert_array_equal(got[n], full_tensors()[n], err_msg=n)
        self.assertEqual(self.entries(), 1)
        self.assertEqual(self.reopened(path), 0)
        return path, first

    def test_unchanged_checkpoint_reuses_cached_metadata(self):
        path, first = self.cached_copy("unchanged")
        self.assertEqual(first.unique_id, 0)
        self.assertEqual(sorted(first.tensors), NAMES)
        # A second checkpoint is a second entry; the first stays cached.
        self.inspect(self.src)
        self.assertEqual(self.entries(), 2)
        self.inspect(path)
        self.assertEqual(self.reopened(path), 0)
        self.assertEqual(self.reopened(self.src), 0)

    def test_files_rewritten_in_place_invalidate(self):
        """Every file of the checkpoint rewritten in place with other values: same
        names, same sizes, same inodes, mtime put back; only ctime tells. The load
        sees the new values."""
        path, first = self.cached_copy("rewritten")
        files = [f for f in sorted(os.listdir(self.src2)) if not f.startswith(".")]
        self.assertEqual(len(files), SAVE_WORLD + 1, files)  # data files and the metadata
        for f in files:
            before = os.stat(os.path.join(path, f))
            shutil.copyfile(os.path.join(self.src2, f), os.path.join(path, f))
            os.utime(os.path.join(path, f), ns=(before.st_atime_ns, before.st_mtime_ns))
            after = os.stat(os.path.join(path, f))
            self.assertEqual((after.st_ino, after.st_size, after.st_mtime_ns),
                             (before.st_ino, before.st_size, before.st_mtime_ns), f)
        got = load_whole(self.daemon.socket, path, "rewritten-2")
        for n in NAMES:
            np.testing.assert_array_equal(got[n], self.other[n], err_msg=n)
        self.assertEqual(self.reopened(path), 1)
        self.assertEqual(self.entries(), 1)
        # Cached again: the next open reuses it.
        self.inspect(path)
        self.assertEqual(self.reopened(path), 1)

    def test_new_version_written_by_another_daemon_invalidates(self):
        """Version 1 saved into the directory by another daemon (this one is not told):
        Inspect names it the newest, and a load without unique_id reads it."""
        path, first = self.cached_copy("versioned")
        self.assertEqual((first.unique_id, first.versions), (0, [0]))
        with testlib.Daemon(self.root) as other:
            save_values(other.socket, path, self.other, unique_id=1)
        info = self.inspect(path)
        self.assertEqual((info.unique_id, info.versions), (1, [0, 1]))
        self.assertEqual(self.reopened(path), 1)
        got = load_whole(self.daemon.socket, path, "versioned-2")
        for n in NAMES:
            np.testing.assert_array_equal(got[n], self.other[n], err_msg=n)
        self.assertEqual(self.reopened(path), 1)
        self.assertEqual(self.entries(), 1)


# --- 7. ranks of one job disagreeing ---------------------------------------------------

class DisagreeingRanksTest(unittest.TestCase):
    """docs/grpc-api.md Errors: INVALID_ARGUMENT for a rank disagreeing with its job.
    Path, unique_id and world_size are compared when the rank registers: it alone is
    refused, naming both values, and the job goes on; aoa_config is compared when the
    job runs: every rank fails, naming both ranks."""

    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.src = make_checkpoint(cls.root)
        cls.copy = os.path.join(cls.root, "copy")
        shutil.copytree(cls.src, cls.copy)
        cls.daemon = testlib.Daemon(cls.root)

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc} at teardown: {cls.daemon.read_log()[-3000:]}"

    def late_rank_refused(self, job, message, path=None, world=LOAD_WORLD, **kw):
        sock = self.daemon.socket
        first = Rank(sock, self.src, job, 0)
        wait_for("rank 0 registered",
                 lambda: jobs(sock).get(job, {}).get("registered_ranks") == [0])
        bad = Rank(sock, path or self.src, job, 1, world=world, **kw).finish(30)
        assert_failed(self, bad, "INVALID_ARGUMENT")
        self.assertEqual(bad.error.message, message)
        # The job is undisturbed: rank 0 still waits; a good rank 1 completes it.
        self.assertEqual(jobs(sock)[job]["registered_ranks"], [0])
        good = Rank(sock, self.src, job, 1)
        assert_loaded(self, first.finish())
        assert_loaded(self, good.finish())

    def test_other_path(self):
        self.late_rank_refused(
            "other-path", "job 'other-path' rank 1 disagrees with the ranks already registered: "
            f"checkpoint {os.path.realpath(self.copy)} vs {os.path.realpath(self.src)}",
            path=self.copy)

    def test_other_unique_id(self):
        self.late_rank_refused(
            "other-version", "job 'other-version' rank 1 disagrees with the ranks already "
            "registered: unique_id 0 vs unset (the newest)", unique_id=0)

    def test_other_world_size(self):
        self.late_rank_refused(
            "other-world", "job 'other-world' rank 1 disagrees with the ranks already "
            "registered: world_size 4 vs 2", world=4)

    def test_other_aoa_config_fails_every_rank(self):
        sock = self.daemon.socket
        ranks = [Rank(sock, self.src, "other-aoa", 0),
                 Rank(sock, self.src, "other-aoa", 1, aoa=[f"{NAMES[0]} -> {NAMES[0]}"])]
        for r in ranks:
            r.finish()
            assert_failed(self, r, "INVALID_ARGUMENT")
            self.assertEqual(r.error.message,
                             "job 'other-aoa': ranks 0 and 1 send different aoa_config")
        self.assertNotIn("other-aoa", jobs(sock))


if __name__ == "__main__":
    testlib.main("daemon_claims_test")
