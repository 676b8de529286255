"""Faults between ckptd and the S3 gateway (issue 36): a proxy in the test
(faultproxy.py) answers 503 SlowDown, resets connections, cuts bodies short,
stalls them and flips a byte, and every load either succeeds exactly (the
faults retried away) or fails with a clear error naming the object; never
a success with wrong bytes."""
import os
import re
import tempfile
import time
import unittest
import uuid

import numpy as np

import ckptd
import faultproxy
import rgwlib
from rgwlib import split
from testlib import Daemon, main, run_ranks

BUCKET = rgwlib.start()
MAX_ATTEMPTS = 4


def save_split_rows(full, path, ranks, job, socket):
    """`full` saved into `path` by `ranks` ranks, each its block of rows."""
    def save(r):
        off, shp = split(full.shape, 0, ranks, r)
        part = full[off[0]:off[0] + shp[0]].copy()
        return ckptd.save_state_dict({"w": ckptd.ShardedTensor(part, full.shape, off)}, path,
                                     rank=r, world_size=ranks, job_id=job, socket=socket)
    run_ranks(ranks, save)


def load_split_cols(full, path, job, socket):
    """`path` evicted from the daemon, then loaded by 2 ranks, each its half of
    the columns of `full`'s shape (NaN-filled first); the halves side by side."""
    ckptd.evict(path, socket=socket)
    outs = {}

    def one(r):
        off, shp = split(full.shape, 1, 2, r)
        outs[r] = np.full(shp, np.nan, np.float32)
        ckptd.load_state_dict({"w": ckptd.ShardedTensor(outs[r], full.shape, off)}, path,
                              rank=r, world_size=2, job_id=job, socket=socket)
    run_ranks(2, one)
    return np.concatenate([outs[0], outs[1]], axis=1)


class S3FaultsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        port = int(rgwlib.ENDPOINT.rsplit(":", 1)[1])
        cls.proxy = faultproxy.FaultProxy(port)
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{cls.proxy.port}"
        cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        cfg.write(f"s3: {{stall_timeout: 1s, max_attempts: {MAX_ATTEMPTS}}}\n")
        cfg.close()
        cls.root = f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:8]}"
        cls.daemon = Daemon(cls.root, "--config", cfg.name)
        cls.sock = cls.daemon.socket
        cls.path = f"{cls.root}/ckpt"
        cls.full = (np.arange(512 * 256, dtype=np.float32).reshape(512, 256) * 0.5 - 7)
        save_split_rows(cls.full, cls.path, 2, "faults-save", cls.sock)
        cls.jobs = 0

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc}: {cls.daemon.read_log()[-2000:]}"

    def tearDown(self):
        self.proxy.clear()

    def cold_load(self):
        """Evicts the checkpoint, then loads it split on dim 1 by 2 ranks."""
        type(self).jobs += 1
        return load_split_cols(self.full, self.path, f"faults-load-{self.jobs}", self.sock)

    def retries(self):
        return ckptd.status(socket=self.sock)["object_storage"]["retries"]

    def test_opening_a_checkpoint_asks_for_its_objects_at_once(self):
        """Opening a checkpoint in a far-away store (every request 0.2 s late
        here) opens its data objects and reads their headers several at a
        time, not one after the other (whose round trips add up over many
        objects); the checks once a load is done likewise."""
        ckptd.evict(self.path, socket=self.sock)
        self.proxy.max_inflight.clear()
        self.proxy.delay_s = 0.2
        try:
            info = ckptd.inspect(self.path, socket=self.sock)
        finally:
            self.proxy.delay_s = 0.0
        self.assertEqual(len(info.files), 2)
        # (An object opened within 0.5 s of the prefix's listing takes its size
        # and ETag from it, with no HEAD: those that need one go at once too.)
        self.assertLessEqual(self.proxy.max_inflight.get("HEAD", 0), 2, dict(self.proxy.max_inflight))
        self.assertEqual(self.proxy.max_inflight["GET"], 2, dict(self.proxy.max_inflight))
        np.testing.assert_array_equal(self.cold_load(), self.full)
        # The checks once a load is done (a HEAD per object, the load's last
        # two HEADs) go at once too.
        self.proxy.spans.clear()
        self.proxy.delay_s = 0.2
        try:
            np.testing.assert_array_equal(self.cold_load(), self.full)
        finally:
            self.proxy.delay_s = 0.0
        heads = sorted(self.proxy.spans["HEAD"])
        self.assertGreaterEqual(len(heads), 2, heads)
        (s1, e1), (s2, e2) = heads[-2:]
        self.assertLess(s2, e1, f"the last two HEADs one after the other: {heads}")

    def test_slowdown_bursts_resets_and_short_bodies_are_retried_away(self):
        for faults in (["slowdown"] * (MAX_ATTEMPTS - 1),
                       ["reset", "truncate", "reset"],
                       ["truncate"] * (MAX_ATTEMPTS - 1)):
            before = self.retries()
            self.proxy.plan("GET", faults)
            np.testing.assert_array_equal(self.cold_load(), self.full, err_msg=str(faults))
            # (libcurl itself retries a request whose reused connection was
            # reset before any answer: not every reset shows as a retry.)
            want = len(faults) if faults[0] != "reset" else 1
            self.assertGreaterEqual(self.retries() - before, want, faults)

    def test_heads_and_listings_are_retried_too(self):
        self.proxy.plan("HEAD", ["slowdown", "reset", None, "slowdown"])
        self.proxy.plan("GET", ["slowdown"])  # the listing is the first GET of a load
        np.testing.assert_array_equal(self.cold_load(), self.full)

    def test_a_stalled_body_is_cut_and_retried(self):
        self.proxy.stall_s = 4.0
        self.proxy.plan("GET", [None, "stall"])
        t = time.monotonic()
        np.testing.assert_array_equal(self.cold_load(), self.full)
        self.assertEqual(self.proxy.faults["stall"], 1)
        # stall_timeout 1 s: cut within about 2 s, not waited out (4 s).
        self.assertLess(time.monotonic() - t, 3.9, "the stall was waited out, not cut")

    def test_more_faults_than_attempts_fail_the_load_naming_the_object(self):
        self.proxy.plan("GET", ["slowdown"] * 50)
        with self.assertRaises(ckptd.UnavailableError) as e:
            self.cold_load()
        msg = str(e.exception)
        self.assertIn(f"s3://{BUCKET}/", msg)
        self.assertIn("SlowDown", msg)
        self.assertIn(f"after {MAX_ATTEMPTS} attempts", msg)
        self.proxy.clear()
        np.testing.assert_array_equal(self.cold_load(), self.full)

    def test_a_flipped_byte_is_never_delivered(self):
        # Every GET of the load gets one byte flipped: the metadata's, the
        # data's. The load must fail; no rank may be told it succeeded.
        self.proxy.plan("GET", [None] + ["flip"] * 50)
        with self.assertRaises(ckptd.CkptdError) as e:
            self.cold_load()
        self.assertIn(f"s3://{BUCKET}/", str(e.exception))
        self.proxy.clear()
        np.testing.assert_array_equal(self.cold_load(), self.full)

    def test_max_requests_bounds_the_requests_in_flight_and_waiters_outlast_a_stall(self):
        """s3.max_requests: 1 with 4 I/O threads: the store never has two
        requests at once (the opening's, the data GETs and the checks after
        the load; each 0.05 s late here, so unbounded they would overlap, as
        test_opening_a_checkpoint_asks_for_its_objects_at_once shows), the
        load is exact and Status says the bound, the peak and the waiting. A
        GET whose body stalls while others wait for its slot is cut after
        stall_timeout and retried; the waiting requests do not give up."""
        cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        cfg.write(f"s3: {{max_requests: 1, stall_timeout: 1s, max_attempts: {MAX_ATTEMPTS}}}\n")
        cfg.close()
        path = f"{self.root}/bounded"
        full = np.random.default_rng(5).standard_normal((1024, 512), dtype=np.float32)
        d = Daemon(self.root, "--io-threads", "4", "--config", cfg.name)
        try:
            save_split_rows(full, path, 4, "bounded-save", d.socket)
            with self.proxy.lock:
                self.proxy.max_inflight_all = 0
            gets = self.proxy.seen["GET"]
            self.proxy.delay_s = 0.05
            try:
                got = load_split_cols(full, path, "bounded-1", d.socket)
            finally:
                self.proxy.delay_s = 0.0
            np.testing.assert_array_equal(got, full)
            gets = self.proxy.seen["GET"] - gets
            self.assertEqual(self.proxy.max_inflight_all, 1)
            st = ckptd.status(socket=d.socket)["object_storage"]
            reads = int(re.findall(r"job=bounded-1 .* reads=(\d+)", d.read_log())[-1])
            self.assertGreaterEqual(reads, 2)  # several data GETs, one thread each
            self.assertEqual((st["max_requests"], st["requests_peak"]), (1, 1), st)
            self.assertGreater(st["request_wait_seconds"], 0.0, st)
            # The load's first data GET (the others wait for its slot)
            # stalls mid-body.
            stalls = self.proxy.faults["stall"]
            self.proxy.plan("GET", [None] * (gets - reads) + ["stall"])
            np.testing.assert_array_equal(load_split_cols(full, path, "bounded-2", d.socket), full)
            self.assertEqual(self.proxy.faults["stall"], stalls + 1)
            after = ckptd.status(socket=d.socket)["object_storage"]
            self.assertEqual(after["retries"], st["retries"] + 1, after)
            # Others waited out the stall (about 1 s) for the slot it held.
            self.assertGreater(after["request_wait_seconds"] - st["request_wait_seconds"], 0.9,
                               after)
            self.assertEqual(after["requests_peak"], 1, after)
        finally:
            rc = d.stop()
            self.assertEqual(rc, 0, d.read_log()[-2000:])

    def test_ranks_copy_while_the_job_still_reads_and_a_bad_last_read_fails_them(self):
        """A cold load's ranks get their cache views in batches while the
        daemon still reads (one I/O thread, every request 0.2 s late: the
        later GETs come after the first batches were copied), every byte
        exact; when the last GET brings a flipped byte, ranks that already
        copied earlier batches still fail, none is told it succeeded."""
        path = f"{self.root}/batches"
        full = np.random.default_rng(3).standard_normal((2048, 8192), dtype=np.float32)
        d = Daemon(self.root, "--io-threads", "1")
        try:
            save_split_rows(full, path, 2, "batches-save", d.socket)

            def load(job):
                """Each rank's (tensor, report) or error, and the GETs made."""
                ckptd.evict(path, socket=d.socket)
                out = {}

                def one(r):
                    off, shp = split(full.shape, 1, 2, r)
                    buf = np.full(shp, np.nan, np.float32)
                    try:
                        out[r] = (buf, ckptd.load_state_dict(
                            {"w": ckptd.ShardedTensor(buf, full.shape, off)}, path, rank=r,
                            world_size=2, job_id=job, socket=d.socket, transport="cache_view"))
                    except ckptd.CkptdError as e:
                        out[r] = e
                gets = self.proxy.seen["GET"]
                self.proxy.delay_s = 0.2
                try:
                    run_ranks(2, one)
                finally:
                    self.proxy.delay_s = 0.0
                return out, self.proxy.seen["GET"] - gets

            load("batches-1")  # the first cold load also reads metadata and headers
            out, gets = load("batches-2")
            for r in range(2):
                self.assertIsInstance(out[r], tuple, f"rank {r}: {out[r]}")
            np.testing.assert_array_equal(np.concatenate([out[0][0], out[1][0]], axis=1), full)
            for r in range(2):
                rep = out[r][1]
                self.assertEqual(rep.bytes_from_views, full.nbytes // 2)
                self.assertGreaterEqual(rep.timings["client_view_batches"], 2, rep.timings)
            # The same load again, its last GET's body with a byte flipped.
            flips = self.proxy.faults["flip"]
            self.proxy.plan("GET", [None] * (gets - 1) + ["flip"])
            out, _ = load("batches-3")
            self.assertEqual(self.proxy.faults["flip"], flips + 1)
            for r in range(2):
                self.assertIsInstance(out[r], ckptd.CkptdError, f"rank {r} succeeded")
                self.assertRegex(str(out[r]), r"\.safetensors: tensor 'w' .* fail their checksum")
        finally:
            rc = d.stop()
            self.assertEqual(rc, 0, d.read_log()[-2000:])


if __name__ == "__main__":
    main("s3_faults_test")
