"""Asynchronous saves (issue 21, docs/saving.md) with the real daemon and real
rank processes or threads: the call returns once the daemon holds the bytes,
the tensors may change at once, the version appears only once durable, a load
right after reads no storage, save_buffer back-pressure, a client that exits
after the call, SIGKILL of the daemon at several points of a persist, SIGTERM.

Values are checked against the arrays the test made (never against the
daemon's own output); the files are also read with testlib's independent
safetensors reader. --testing-delay-persist-ms (a pause before each file a
persist writes) keeps a persist in flight long enough to act during it."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import unittest

import numpy as np

import ckptd
import testlib

G = (64, 1024)  # float32: 256 KiB per tensor


def split_rows(full, r, world):
    rows = full.shape[0] // world
    return full[r * rows:(r + 1) * rows].copy(), (r * rows, 0)


def make_state(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(G, dtype=np.float32),
            "v": rng.standard_normal(G, dtype=np.float32),
            "step": np.array([seed], dtype=np.int64)}


def rank_sd(full, r, world):
    """Rank r's part: w and v split by rows, step replicated."""
    sd = {}
    for k in ("w", "v"):
        part, off = split_rows(full[k], r, world)
        sd[k] = ckptd.ShardedTensor(part, G, off)
    sd["step"] = full["step"].copy()
    return sd


run_ranks = testlib.run_ranks


def load_whole(sock, path, unique_id=None):
    """Loads w, v and step whole (one rank, so resharded from the saved split)."""
    out = {"w": np.full(G, np.nan, np.float32), "v": np.full(G, np.nan, np.float32),
           "step": np.zeros(1, np.int64)}
    rep = ckptd.load_state_dict(out, path, unique_id=unique_id, socket=sock, strict=True)
    return out, rep


def assert_same(test, got, want):
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def save_status(sock, job_id):
    for s in ckptd.status(socket=sock).get("saves", []):
        if s["job_id"] == job_id:
            return s
    return None


class AsyncSaveTest(unittest.TestCase):
    def setUp(self):
        self.root = testlib.tmp_root()

    def test_caller_may_change_tensors_once_the_call_returned(self):
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "200") as d:
            out = os.path.join(self.root, "ckpt")
            full = make_state(1)
            sds = [rank_sd(full, r, 2) for r in range(2)]
            futs = run_ranks(2, lambda r: ckptd.save_state_dict(
                sds[r], out, rank=r, world_size=2, job_id="a1", socket=d.socket,
                async_save=True))
            # Training goes on: every tensor changes while the daemon persists.
            for sd in sds:
                for k in ("w", "v"):
                    sd[k].local[...] = -1
                sd["step"][...] = 99
            self.assertFalse(os.path.exists(os.path.join(out, "0.metadata")),
                             "the version is visible before it is durable")
            for f in futs:
                self.assertIsInstance(f, ckptd.SaveFuture)
                self.assertFalse(f.staged.persisted)
                self.assertGreater(f.staged.stall_s, 0)
                # Both ranks; the segments the client hands over are charged the
                # pages the daemon maps (w's half and step on each rank: at most
                # a page more per tensor).
                self.assertGreaterEqual(f.staged.bytes_staged, 2 * full["w"].nbytes + 16)
                self.assertLessEqual(f.staged.bytes_staged, 2 * full["w"].nbytes + 16 + 4 * 4096)
            reps = [f.result(timeout=60) for f in futs]
            for rep in reps:
                self.assertTrue(rep.persisted)
                self.assertGreater(rep.persist_s, 0.2)  # at least one testing pause
                self.assertEqual(rep.bytes_written, 2 * full["w"].nbytes + 8)
                self.assertTrue(rep.files)
            self.assertTrue(futs[0].done())
            self.assertIsNone(futs[1].exception())
            got, _ = load_whole(d.socket, out)
            assert_same(self, got, full)
            # The files themselves, read without ckptd: rank 0's rows of w.
            arrays = []
            for name in sorted(os.listdir(out)):
                if name.endswith(".safetensors"):
                    arrays += [a for _, a in testlib.read_safetensors(
                        os.path.join(out, name)).values()]
            for want in (full["w"][:32], full["w"][32:], full["v"][:32], full["v"][32:]):
                self.assertTrue(any(np.array_equal(a, want) for a in arrays))

    def test_load_right_after_the_call_waits_and_reads_no_storage(self):
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "300") as d:
            out = os.path.join(self.root, "ckpt")
            full = make_state(2)
            futs = run_ranks(2, lambda r: ckptd.save_state_dict(
                rank_sd(full, r, 2), out, rank=r, world_size=2, job_id="a2", socket=d.socket,
                async_save=True))
            self.assertFalse(futs[0].done(), "the persist ended before the load began")
            self.assertEqual(save_status(d.socket, "a2")["state"], "persisting")
            got, rep = load_whole(d.socket, out)  # waits for the version to be durable
            assert_same(self, got, full)
            self.assertEqual(rep.unique_id, 0)
            self.assertEqual(rep.bytes_read, 0, "the just-saved version was read from storage")
            self.assertGreater(rep.bytes_from_cache, 0)
            # Durable before the load returned; the future learns it on its own
            # thread's AwaitSave, answered at the same moment: a bounded wait.
            self.assertTrue(futs[0].result(timeout=10).persisted)
            st = save_status(d.socket, "a2")
            self.assertEqual((st["state"], int(st["bytes_persisted"])),
                             ("durable", 2 * full["w"].nbytes + 8))

    def test_loads_of_other_checkpoints_do_not_wait_for_a_persist(self):
        """The persist thread is the daemon's own: a load of another checkpoint
        runs while a persist is in flight (here 3 files x 1.5 s)."""
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "1500") as d:
            other = os.path.join(self.root, "other")
            ckptd.save_state_dict(make_state(30), other, rank=0, world_size=1, job_id="o0",
                                  socket=d.socket)
            f = ckptd.save_state_dict(make_state(31), os.path.join(self.root, "ckpt"), rank=0,
                                      world_size=1, job_id="o1", socket=d.socket,
                                      async_save=True)
            got, _ = load_whole(d.socket, other)
            # Still persisting once the load is done: the load did not wait for it.
            self.assertFalse(f.done(), "the load of another checkpoint waited for the persist")
            assert_same(self, got, make_state(30))
            f.result(timeout=60)

    def test_full_save_buffer_makes_the_caller_wait(self):
        one = 2 * full_bytes() + 8  # one world-1 save of make_state
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "400",
                            "--save_buffer", str(one + one // 2)) as d:
            out = os.path.join(self.root, "ckpt")
            a = ckptd.save_state_dict(make_state(3), out, world_size=1, rank=0, job_id="b1",
                                      unique_id=0, socket=d.socket, async_save=True)
            self.assertLess(a.staged.buffer_wait_s, 0.2)
            t0 = time.monotonic()
            b = ckptd.save_state_dict(make_state(4), out, world_size=1, rank=0, job_id="b2",
                                      unique_id=1, socket=d.socket, async_save=True)
            # b needed a's room: it waited for a's persist (3 files x 400 ms).
            self.assertGreater(b.staged.buffer_wait_s, 0.5)
            self.assertGreater(time.monotonic() - t0, 0.5)
            # a's room went back as its persist ended, a moment before its
            # outcome is published (the daemon frees the bytes first), so a
            # is durable now or an instant later.
            self.assertTrue(a.result(timeout=10).persisted)
            b.result(timeout=60)
            assert_same(self, load_whole(d.socket, out, 0)[0], make_state(3))
            assert_same(self, load_whole(d.socket, out, 1)[0], make_state(4))
            # A save larger than the whole buffer is refused, naming it.
            big = {"x": np.zeros(2 * one, np.uint8)}
            with self.assertRaises(ckptd.CkptdError) as cm:
                ckptd.save_state_dict(big, out, world_size=1, rank=0, job_id="b3", unique_id=2,
                                      socket=d.socket, async_save=True)
            self.assertEqual(cm.exception.code, "RESOURCE_EXHAUSTED")
            self.assertIn("save_buffer", str(cm.exception))
            self.assertEqual(int(ckptd.status(socket=d.socket)["save_staged_bytes"]), 0)

    def test_version_completes_after_the_client_exits(self):
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "300") as d:
            out = os.path.join(self.root, "ckpt")
            script = textwrap.dedent(f"""
                import os, sys
                sys.path[:0] = {sys.path!r}
                import ckptd, async_save_test as t
                f = ckptd.save_state_dict(t.make_state(5), {out!r}, rank=0, world_size=1,
                                          job_id="c1", socket={d.socket!r}, async_save=True)
                assert not f.staged.persisted
                os._exit(0)  # gone before the version is durable
            """)
            subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
            self.assertFalse(os.path.exists(os.path.join(out, "0.metadata")))
            testlib.wait_for("version 0 to appear", lambda: os.path.exists(
                os.path.join(out, "0.metadata")), 30, 0.05)
            assert_same(self, load_whole(d.socket, out)[0], make_state(5))

    def test_sigkill_during_persist_leaves_the_previous_version(self):
        # Points of a world-2 persist (2 data files, then the metadata, each
        # after a 500 ms pause): before any file, after the first data file,
        # after both data files (the metadata not yet written).
        # Rank 0's file: its rows of w and v (one tensor's bytes) and step
        # (8 bytes, written once by the replica with the fewest bytes: rank 0).
        per_file = full_bytes()
        for point, persisted in (("before any file", 0), ("after one data file", per_file + 8),
                                 ("before the metadata", 2 * per_file + 8)):
            with self.subTest(point=point):
                root = testlib.tmp_root()
                out = os.path.join(root, "ckpt")
                old = make_state(6)
                d = testlib.Daemon(root, "--testing-delay-persist-ms", "500")
                try:
                    ckptd.save_state_dict(old, out, rank=0, world_size=1, job_id="v0",
                                          socket=d.socket)
                    new = make_state(7)
                    run_ranks(2, lambda r: ckptd.save_state_dict(
                        rank_sd(new, r, 2), out, rank=r, world_size=2, job_id="v1",
                        socket=d.socket, async_save=True))

                    def reached():
                        s = save_status(d.socket, "v1")
                        return s is not None and int(s["bytes_persisted"]) >= persisted
                    testlib.wait_for(f"persist {point}", reached, 30, 0.02)
                    d.proc.send_signal(signal.SIGKILL)
                    d.proc.wait(30)
                finally:
                    d.stop()
                self.assertFalse(os.path.exists(os.path.join(out, "1.metadata")), point)
                with testlib.Daemon(root) as d2:
                    info = ckptd.inspect(out, socket=d2.socket)
                    self.assertEqual(info.versions, [0], point)
                    assert_same(self, load_whole(d2.socket, out)[0], old)

    def save_then_sigterm(self, seed, job, *flags):
        """An asynchronous save, SIGTERM right after the call; the daemon must
        exit 0. Returns (its log, the checkpoint directory)."""
        d = testlib.Daemon(self.root, *flags)
        out = os.path.join(self.root, "ckpt")
        ckptd.save_state_dict(make_state(seed), out, rank=0, world_size=1, job_id=job,
                              socket=d.socket, async_save=True)
        d.proc.send_signal(signal.SIGTERM)
        self.assertEqual(d.proc.wait(30), 0, d.read_log()[-3000:])
        d.stop()
        return d, out

    def test_sigterm_waits_for_persists(self):
        d, out = self.save_then_sigterm(8, "t1", "--testing-delay-persist-ms", "300")
        self.assertTrue(os.path.exists(os.path.join(out, "0.metadata")), d.read_log()[-3000:])
        with testlib.Daemon(self.root) as d2:
            assert_same(self, load_whole(d2.socket, out)[0], make_state(8))

    def test_drain_timeout_abandons_a_persist_and_says_so(self):
        cfg = os.path.join(self.root, "ckptd.yaml")
        with open(cfg, "w") as f:
            f.write("drain_timeout: 200ms\n")
        d, out = self.save_then_sigterm(9, "t2", "--config", cfg,
                                        "--testing-delay-persist-ms", "1000")
        self.assertRegex(d.read_log(), r"abandoned 1 save job\(s\) still persisting .*: t2")
        self.assertFalse(os.path.exists(os.path.join(out, "0.metadata")))

    def test_back_to_back_saves_keep_their_own_bytes(self):
        """The client keeps its staging segments mapped between saves and reuses
        one only once the save that used it is durable: four saves in a row,
        none waited for, each version holds its own values."""
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "100") as d:
            out = os.path.join(self.root, "ckpt")
            sd = make_state(20)
            futs, want = [], []
            for v in range(4):
                for k in ("w", "v"):
                    sd[k] += 1.0  # a training step
                want.append({k: a.copy() for k, a in sd.items()})
                futs.append(ckptd.save_state_dict(sd, out, rank=0, world_size=1,
                                                  job_id=f"bb{v}", unique_id=v,
                                                  socket=d.socket, async_save=True))
            for f in futs:
                self.assertTrue(f.result(timeout=60).persisted)
            for v in range(4):
                assert_same(self, load_whole(d.socket, out, v)[0], want[v])
            # The next save reuses a kept segment (every earlier one is durable).
            again = ckptd.save_state_dict(sd, out, rank=0, world_size=1, job_id="bb4",
                                          unique_id=4, socket=d.socket)
            self.assertTrue(again.persisted)
            assert_same(self, load_whole(d.socket, out, 4)[0], sd)
            ckptd.release_staging()

    def test_versions_without_unique_id_while_one_persists(self):
        """unique_id=None takes one more than the newest version listed or saved
        by this process: a save right after an asynchronous one (not listed yet)
        gets the next version instead of ALREADY_EXISTS."""
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "300") as d:
            out = os.path.join(self.root, "ckpt")
            futs = [ckptd.save_state_dict(make_state(40 + i), out, rank=0, world_size=1,
                                          socket=d.socket, job_id=f"n{i}", async_save=True)
                    for i in range(3)]
            self.assertEqual([f.staged.unique_id for f in futs], [0, 1, 2])
            self.assertFalse(futs[0].done())
            for f in futs:
                f.result(timeout=60)
            self.assertEqual(ckptd.inspect(out, socket=d.socket).versions, [0, 1, 2])
            for i in range(3):
                assert_same(self, load_whole(d.socket, out, i)[0], make_state(40 + i))

    def test_the_daemon_picks_the_version_for_every_process(self):
        """issue 37: unique_id=None is the daemon's choice (one more than the
        newest visible or persisting version), so a new process (a restarted
        job, which never saw this process's saves) saving while one persists
        gets the next version, and the two ranks of a job agree without
        listing the directory (both asynchronous: a synchronous save does not wait
        for the directory's lock)."""
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "500") as d:
            out = os.path.join(self.root, "ckpt")
            first = ckptd.save_state_dict(make_state(50), out, rank=0, world_size=1,
                                          socket=d.socket, job_id="p0", async_save=True)
            self.assertEqual(first.staged.unique_id, 0)
            self.assertFalse(first.done())
            child = textwrap.dedent(f"""
                import json, sys
                sys.path[:0] = {sys.path!r}
                import numpy as np, ckptd
                full = {{"w": np.arange(64, dtype=np.float32)}}
                reps = []
                import threading
                def rank(r):
                    sd = {{"w": ckptd.ShardedTensor(full["w"][r * 32:(r + 1) * 32].copy(), (64,),
                                                   (r * 32,))}}
                    f = ckptd.save_state_dict(sd, {out!r}, rank=r, world_size=2, job_id="p1",
                                              socket={d.socket!r}, async_save=True)
                    reps.append((f.staged.unique_id, f.result(timeout=60).unique_id))
                ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
                [t.start() for t in ts]; [t.join() for t in ts]
                print(json.dumps(sorted(reps)))
            """)
            r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                               timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            self.assertEqual(json.loads(r.stdout.strip().splitlines()[-1]), [[1, 1], [1, 1]],
                             r.stderr[-3000:])
            first.result(timeout=60)
            self.assertEqual(ckptd.inspect(out, socket=d.socket).versions, [0, 1])
            got = {"w": np.zeros(64, np.float32)}
            ckptd.load_state_dict(got, out, unique_id=1, socket=d.socket)
            np.testing.assert_array_equal(got["w"], np.arange(64, dtype=np.float32))

    def test_the_future_is_a_concurrent_futures_future(self):
        """issue 37: async_save returns a concurrent.futures.Future, as DCP's
        async_save: callbacks run once durable (at once when added after),
        concurrent.futures.wait works, cancel() is honest (False: the daemon
        persists a staged save whatever happens here), result(timeout) while
        persisting raises a TimeoutError, and polling opens no connection per
        poll (one waiting thread per future)."""
        import concurrent.futures
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "700") as d:
            out = os.path.join(self.root, "ckpt")
            f = ckptd.save_state_dict(make_state(21), out, rank=0, world_size=1, job_id="fut",
                                      socket=d.socket, async_save=True)
            self.assertIsInstance(f, concurrent.futures.Future)
            self.assertTrue(f.running())
            self.assertFalse(f.cancel())
            self.assertFalse(f.cancelled())
            with self.assertRaises(TimeoutError) as cm:
                f.result(timeout=0.01)
            self.assertIsInstance(cm.exception, ckptd.DeadlineExceededError)
            seen = []
            f.add_done_callback(lambda fut: seen.append(fut.result().persisted))
            done, pending = concurrent.futures.wait([f], timeout=60)
            self.assertEqual((len(done), len(pending)), (1, 0))
            self.assertTrue(f.result().persisted)
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertEqual(seen, [True])
            late = []
            f.add_done_callback(late.append)  # already done: runs at once
            self.assertEqual(late, [f])
            self.assertIsNone(f.exception())
            assert_same(self, load_whole(d.socket, out)[0], make_state(21))

    def test_failed_persist_is_never_visible(self):
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "200") as d:
            out = os.path.join(self.root, "ckpt")
            ckptd.save_state_dict(make_state(12), out, rank=0, world_size=1, job_id="f0",
                                  socket=d.socket)
            # A directory where version 1's data file must go: its rename fails
            # (for root too) after the call returned.
            os.mkdir(os.path.join(out, "0_1.safetensors"))
            f = ckptd.save_state_dict(make_state(13), out, rank=0, world_size=1, job_id="f1",
                                      socket=d.socket, async_save=True)
            self.assertFalse(f.staged.persisted)
            err = f.exception(timeout=60)
            self.assertIsNotNone(err)
            self.assertIn("save job 'f1'", str(err))
            self.assertIn("0_1.safetensors", str(err))
            self.assertEqual(ckptd.inspect(out, socket=d.socket).versions, [0])
            self.assertFalse(os.path.exists(os.path.join(out, "1.metadata")))
            st = ckptd.status(socket=d.socket)
            self.assertEqual(int(st["saves_failed"]), 1)
            self.assertEqual(save_status(d.socket, "f1")["state"], "failed")
            with self.assertRaises(ckptd.CkptdError) as cm:
                f.result(timeout=10)
            self.assertIs(cm.exception, err)
            assert_same(self, load_whole(d.socket, out)[0], make_state(12))

    def test_status_ckptctl_and_errors(self):
        with testlib.Daemon(self.root, "--testing-delay-persist-ms", "300") as d:
            out = os.path.join(self.root, "ckpt")
            f = ckptd.save_state_dict(make_state(10), out, rank=0, world_size=1, job_id="s1",
                                      socket=d.socket, async_save=True)
            r = subprocess.run([testlib.CKPTCTL, "status", "--daemon", d.socket],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("asynchronous saves: 1", r.stdout)
            self.assertRegex(r.stdout, r"s1 +persisting +0 ")
            # The same version again while it persists: refused, naming the job.
            with self.assertRaises(ckptd.CkptdError) as cm:
                ckptd.save_state_dict(make_state(11), out, rank=0, world_size=1, unique_id=0,
                                      job_id="s2", socket=d.socket, async_save=True)
            self.assertEqual(cm.exception.code, "ALREADY_EXISTS")
            self.assertIn("'s1' (still persisting)", str(cm.exception))
            f.result(timeout=60)
            st = ckptd.status(socket=d.socket)
            self.assertEqual(int(st["saves_durable"]), 1)
            self.assertGreater(float(st["save_stall_seconds_total"]), 0)
            # AwaitSave of a job nobody ran.
            with ckptd.Client(d.socket) as c:
                with self.assertRaises(ckptd.CkptdError) as cm:
                    c._call("AwaitSave", c._pb2.AwaitSaveRequest(job_id="nope", rank=0), 10)
            self.assertEqual(cm.exception.code, "NOT_FOUND")
            self.assertIn("'nope'", str(cm.exception))


def full_bytes():
    return int(np.prod(G)) * 4


if __name__ == "__main__":
    testlib.main("async_save_test")
