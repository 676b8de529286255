"""Restarts that jobs survive (issue 38; docs/operations.md, "Upgrades and restarts").

A daemon restarted while a job's ranks are calling it (a rolling update of
the DaemonSet: SIGTERM, drain, the new binary on the same socket; or a crash)
does not fail the training script: every client call that fails because the
daemon went away or is restarting (UNAVAILABLE from the transport, or the
daemon's own marked "ckptd-retry: restart") is made again, the same job, on a
new connection, with backoff and jitter, within the call's timeout and
retry_timeout. Real daemons, real sockets, ranks as threads each with its own
client; every rank's tensors compared with the saved values.
"""
import os
import signal
import tempfile
import threading
import time
import unittest

import numpy as np

import ckptd
import testlib

ROWS, COLS = 64, 128
NAMES = [f"layers.{i}.w" for i in range(3)]
WORLD = 4  # load ranks; rank r holds rows [r*ROWS/4, (r+1)*ROWS/4)
RETRY_S = 60.0


def full():
    rng = np.random.default_rng(38)
    return {n: rng.standard_normal((ROWS, COLS)).astype(np.float32) for n in NAMES}


class LoadRank(threading.Thread):
    """One rank of a load job: ckptd.load_state_dict (its own client) in a thread."""

    def __init__(self, sock, path, job, rank, transport="auto"):
        super().__init__(daemon=True)
        self.sock, self.path, self.job, self.rank = sock, path, job, rank
        self.transport = transport
        rows = ROWS // WORLD
        self.state = {n: ckptd.ShardedTensor(np.full((rows, COLS), np.nan, np.float32),
                                             (ROWS, COLS), (rank * rows, 0)) for n in NAMES}
        self.report = self.error = None

    def run(self):
        try:
            self.report = ckptd.load_state_dict(
                self.state, self.path, rank=self.rank, world_size=WORLD, job_id=self.job,
                socket=self.sock, timeout=120, barrier_timeout=60, retry_timeout=RETRY_S,
                transport=self.transport)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e

    def check(self, test, want):
        self.join(120)
        test.assertFalse(self.is_alive(), f"rank {self.rank} still running")
        test.assertIsNone(self.error, f"rank {self.rank}: {self.error!r}")
        rows = ROWS // WORLD
        for n in NAMES:
            np.testing.assert_array_equal(
                self.state[n].local, want[n][self.rank * rows:(self.rank + 1) * rows],
                err_msg=f"rank {self.rank} {n}")


def job_ranks(sock, job):
    """Ranks of `job` registered on the daemon at `sock` (0 if it is not there)."""
    try:
        for j in ckptd.status(socket=sock, retry_timeout=0)["jobs"]:
            if j["job_id"] == job:
                return len(j["registered_ranks"])
    except ckptd.CkptdError:
        pass
    return 0


class RestartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.want = full()
        cls.path = os.path.join(cls.root, "ckpt")
        with testlib.Daemon(cls.root) as d:
            ckptd.save_state_dict(cls.want, cls.path, rank=0, world_size=1, unique_id=0,
                                  job_id="restart-src", socket=d.socket)

    def restarted(self, old, *extra):
        """A new daemon on `old`'s socket (once `old` exited), stopped at the end."""
        new = testlib.Daemon(self.root, *extra, socket=old.socket)
        self.addCleanup(old.stop)  # (after new: old's directory holds the socket)
        self.addCleanup(new.stop)
        return new

    def test_a_rolling_update_while_a_job_gathers_its_ranks(self):
        """Ranks 0 and 1 wait for 2 and 3 when the daemon gets SIGTERM: the drain
        fails the waiting job at once (retryable), 2 and 3 start while it is gone,
        and all four load from the new daemon, the same job, exact."""
        old = testlib.Daemon(self.root)
        early = [LoadRank(old.socket, self.path, "rolling", r) for r in (0, 1)]
        for r in early:
            r.start()
        testlib.wait_for("ranks 0 and 1 registered", lambda: job_ranks(old.socket, "rolling") == 2,
                         20, 0.02)
        old.proc.send_signal(signal.SIGTERM)
        testlib.wait_for("the drain to begin", lambda: "draining running loads" in old.read_log(),
                         20, 0.005)
        late = [LoadRank(old.socket, self.path, "rolling", r) for r in (2, 3)]
        for r in late:
            r.start()
        self.assertEqual(old.proc.wait(30), 0, old.read_log()[-3000:])
        self.assertIn("drain: failed 1 job(s) still waiting for ranks (their clients retry): "
                      "rolling", old.read_log())
        time.sleep(0.3)  # the clients find no daemon for a moment, as in a real update
        new = self.restarted(old)
        for r in early + late:
            r.check(self, self.want)
        for r in early:
            self.assertGreaterEqual(r.report.retries, 1, f"rank {r.rank}")
        self.assertRegex(new.read_log(), r"load job=rolling path=\S+ ranks=4 ")

    def test_a_daemon_killed_in_the_middle_of_a_load(self):
        """SIGKILL while the job reads (a crash, an OOM kill): every rank's stream
        breaks, and each rank loads again, the same job, from the new daemon."""
        old = testlib.Daemon(self.root, "--testing-delay-read-ms", "300", "--io-threads", "1",
                             "--io-request-size", "16KiB")
        # shm: the daemon reads every byte (with cache views, bytes it does not
        # hold would be read by the clients from the files, not in its job).
        ranks = [LoadRank(old.socket, self.path, "killed", r, transport="shm")
                 for r in range(WORLD)]
        for r in ranks:
            r.start()
        testlib.wait_for("the job reading", lambda: "reading" in str(
            [j for j in ckptd.status(socket=old.socket, retry_timeout=0)["jobs"]
             if j["job_id"] == "killed"]), 20, 0.02)
        old.proc.kill()
        old.proc.wait(10)
        new = self.restarted(old)
        for r in ranks:
            r.check(self, self.want)
            self.assertGreaterEqual(r.report.retries, 1, f"rank {r.rank}")
        self.assertRegex(new.read_log(), r"load job=killed path=\S+ ranks=4 ")

    def test_a_save_made_again_after_a_restart(self):
        """A 2-rank save whose rank 1 comes while the daemon restarts: both ranks'
        calls succeed on the new daemon and the version holds their bytes."""
        old = testlib.Daemon(self.root)
        out = os.path.join(self.root, "saved-across")
        halves = [{n: ckptd.ShardedTensor(self.want[n][r * ROWS // 2:(r + 1) * ROWS // 2].copy(),
                                          (ROWS, COLS), (r * ROWS // 2, 0)) for n in NAMES}
                  for r in range(2)]
        results = {}

        def save(r):
            try:
                results[r] = ckptd.save_state_dict(
                    halves[r], out, rank=r, world_size=2, job_id="save-across",
                    socket=old.socket, timeout=120, barrier_timeout=60, retry_timeout=RETRY_S)
            except BaseException as e:  # noqa: BLE001
                results[r] = e

        first = threading.Thread(target=save, args=(0,))
        first.start()
        testlib.wait_for("rank 0 registered", lambda: job_ranks(old.socket, "save-across") == 1,
                         20, 0.02)
        old.proc.send_signal(signal.SIGTERM)
        self.assertEqual(old.proc.wait(30), 0)
        second = threading.Thread(target=save, args=(1,))
        second.start()
        new = self.restarted(old)
        first.join(120)
        second.join(120)
        for r in range(2):
            self.assertIsInstance(results[r], ckptd.SaveReport, results[r])
        self.assertGreaterEqual(results[0].retries, 1)
        self.assertEqual(results[0].unique_id, results[1].unique_id)
        got = {n: np.zeros((ROWS, COLS), np.float32) for n in NAMES}
        ckptd.load_state_dict(got, out, socket=new.socket)
        for n in NAMES:
            np.testing.assert_array_equal(got[n], self.want[n], err_msg=n)

    def test_the_retry_budget_and_the_calls_timeout_bound_the_wait(self):
        d = tempfile.mkdtemp(prefix="ckptd-gone-", dir="/tmp")  # socket paths < 108 bytes
        self.addCleanup(os.rmdir, d)
        missing = os.path.join(d, "nobody.sock")
        t0 = time.monotonic()
        with self.assertRaises(ConnectionError) as cm:  # UnavailableError
            ckptd.status(socket=missing, retry_timeout=1.0)
        waited = time.monotonic() - t0
        self.assertGreaterEqual(waited, 0.9)
        self.assertLess(waited, 5.0)
        self.assertEqual(cm.exception.code, "UNAVAILABLE")
        self.assertIn("ckptd did not come back within retry_timeout=1 s", cm.exception.message)
        self.assertIn(missing, cm.exception.message)
        # The call's own timeout is the tighter bound.
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError):
            ckptd.status(socket=missing, retry_timeout=60, timeout=0.5)
        self.assertLess(time.monotonic() - t0, 3.0)
        # 0: no retries, the first error at once.
        t0 = time.monotonic()
        with self.assertRaises(ckptd.CkptdError) as cm:
            ckptd.status(socket=missing, retry_timeout=0)
        self.assertLess(time.monotonic() - t0, 0.5)
        self.assertNotIn("retry_timeout", cm.exception.message)
        with self.assertRaises(ValueError):  # InvalidArgumentError
            ckptd.status(socket=missing, retry_timeout="soon")

    def test_errors_of_the_request_are_not_retried(self):
        with testlib.Daemon(self.root) as d:
            t0 = time.monotonic()
            with self.assertRaises(FileNotFoundError):
                ckptd.load_state_dict({"x": np.zeros(2, np.float32)},
                                      os.path.join(self.root, "no-such"), socket=d.socket,
                                      retry_timeout=RETRY_S)
            self.assertLess(time.monotonic() - t0, 5.0)


if __name__ == "__main__":
    testlib.main("restart_test")
