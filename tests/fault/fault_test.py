"""Faults at the I/O layer, injected into the real ckptctl and ckptd
processes by a preloaded shim (tests/fault/fault_shim.cc): a disk that
returns EIO, short reads, a file that shrinks mid-read, a full disk, a
failing fsync. Every fault is a clear error naming the file; nothing
half-written is left visible; short reads still load every byte; the daemon
serves the next request after a fault."""
import filecmp
import glob
import os
import shutil
import subprocess
import unittest

import testlib

CKPTCTL = os.path.abspath(testlib.CKPTCTL)
SHIM = os.path.abspath(testlib.runfile("tests/fault/libfault_shim.so"))
EXAMPLES = testlib.runfile("examples")
LAYOUT2 = os.path.abspath(os.path.join(EXAMPLES, "layout-tp2.json"))
LAYOUT4 = os.path.abspath(os.path.join(EXAMPLES, "layout-tp4-dim0.json"))
MODEL = os.path.abspath(os.path.join(EXAMPLES, "tiny-model"))


def faulty_env(rule, times=None):
    env = dict(os.environ, LD_PRELOAD=SHIM, CKPTD_FAULT=rule)
    if times is not None:
        env["CKPTD_FAULT_TIMES"] = str(times)
    return env


def ckptctl(*args, env=None):
    return subprocess.run([CKPTCTL, *args], capture_output=True, text=True, timeout=120, env=env)


def visible(d):
    """What a reader could see in `d`: every entry that is not a temporary."""
    return sorted(n for n in os.listdir(d) if ".tmp." not in n) if os.path.isdir(d) else []


class FaultTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = testlib.tmp_root()
        cls.ckpt = os.path.join(cls.tmp, "ckpt")
        r = ckptctl("shard", MODEL, "--layout", LAYOUT2, "--out", cls.ckpt)
        assert r.returncode == 0, r.stderr
        cls.data = sorted(os.path.basename(p) for p in glob.glob(os.path.join(cls.ckpt, "*.safetensors")))
        assert len(cls.data) == 2, cls.data
        cls.expected = os.path.join(cls.tmp, "expected")
        r = ckptctl("load", cls.ckpt, "--layout", LAYOUT4, "--out", cls.expected)
        assert r.returncode == 0, r.stderr
        cls.ranks = sorted(os.listdir(cls.expected))

    def out(self, name):
        return os.path.join(self.tmp, name)

    def assert_same_as_expected(self, out):
        for f in self.ranks:
            self.assertTrue(filecmp.cmp(os.path.join(out, f), os.path.join(self.expected, f),
                                        shallow=False), f)

    def test_the_shim_is_live(self):
        # Without a matching pattern nothing changes; with one, the fault shows.
        r = ckptctl("load", self.ckpt, "--layout", LAYOUT4, "--out", self.out("clean"),
                    env=faulty_env("pread-eio:no-such-file:0"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_as_expected(self.out("clean"))

    def test_read_error_names_the_file_and_writes_no_rank(self):
        victim = self.data[1]
        r = ckptctl("load", self.ckpt, "--layout", LAYOUT4, "--out", self.out("eio"),
                    env=faulty_env(f"pread-eio:{victim}:0"))
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn(victim, r.stderr)
        self.assertIn("Input/output error", r.stderr)
        self.assertIn("[DATA_LOSS]", r.stderr)
        self.assertEqual(visible(self.out("eio")), [], "no rank file after a failed load")

    def test_short_reads_still_load_every_byte(self):
        r = ckptctl("load", self.ckpt, "--layout", LAYOUT4, "--out", self.out("short"),
                    env=faulty_env("pread-short:.safetensors:777"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_as_expected(self.out("short"))

    def test_file_shrinking_mid_read_is_an_error_naming_it(self):
        ckpt = self.out("shrinking")
        shutil.copytree(self.ckpt, ckpt)
        victim = self.data[0]
        size = os.path.getsize(os.path.join(ckpt, victim))
        r = ckptctl("load", ckpt, "--layout", LAYOUT4, "--out", self.out("shrunk"),
                    env=faulty_env(f"pread-truncate:{victim}:{size // 2}"))
        self.assertEqual(os.path.getsize(os.path.join(ckpt, victim)), size // 2, "the fault ran")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn(victim, r.stderr)
        self.assertEqual(visible(self.out("shrunk")), [])

    def test_full_disk_during_shard_leaves_nothing_visible(self):
        out = self.out("enospc")
        r = ckptctl("shard", MODEL, "--layout", LAYOUT2, "--out", out,
                    env=faulty_env("write-enospc:.safetensors:1000"))
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("No space left on device", r.stderr)
        self.assertIn("[RESOURCE_EXHAUSTED]", r.stderr)
        self.assertIn(".safetensors", r.stderr)
        self.assertEqual([n for n in visible(out) if n != ".ckptd.lock"], [],
                         "no data file or metadata of a failed save")
        self.assertEqual(glob.glob(os.path.join(out, "*.tmp.*")), [], "temporaries removed")

    def test_fsync_failure_during_convert_leaves_nothing_visible(self):
        out = self.out("fsync")
        r = ckptctl("convert", MODEL, "--out", out, env=faulty_env("fsync-eio:.safetensors"))
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("fsync", r.stderr)
        self.assertIn("Input/output error", r.stderr)
        self.assertEqual([n for n in visible(out) if n != ".ckptd.lock"], [])

    def test_write_error_during_merge_leaves_nothing_visible(self):
        out = self.out("merge-eio")
        r = ckptctl("merge", self.ckpt, "--out", out, env=faulty_env("write-eio:.safetensors:0"))
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("Input/output error", r.stderr)
        self.assertEqual([n for n in visible(out) if n.endswith((".safetensors", ".json"))], [])

    def test_daemon_reports_the_fault_and_serves_the_next_request(self):
        victim = self.data[1]
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "CKPTD_FAULT", "CKPTD_FAULT_TIMES")}
        os.environ.update(faulty_env(f"pread-eio:{victim}:0", times=1))
        try:
            d = testlib.Daemon(self.tmp)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with d:
            r = ckptctl("load", self.ckpt, "--layout", LAYOUT4, "--out", self.out("d1"),
                        "--daemon", d.socket)
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn(victim, r.stderr)
            self.assertIn("Input/output error", r.stderr)
            self.assertEqual(visible(self.out("d1")), [])
            r = ckptctl("load", self.ckpt, "--layout", LAYOUT4, "--out", self.out("d2"),
                        "--daemon", d.socket)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assert_same_as_expected(self.out("d2"))
        self.assertEqual(d.proc.returncode, 0, d.read_log())


if __name__ == "__main__":
    testlib.main("fault_test")
