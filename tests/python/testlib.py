"""Helpers of the Python client tests: the real ckptd daemon as a child
process, an independent numpy reader of safetensors files, and a unittest
runner that writes JUnit XML for Bazel ($XML_OUTPUT_FILE)."""
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import xml.etree.ElementTree as ET

import numpy as np


def runfile(rel):
    """A path of the test's runfiles (the test runs in the workspace runfiles dir)."""
    return os.path.abspath(rel)


CKPTD = os.environ.get("CKPTD_BIN", "server/ckptd")
CKPTCTL = os.environ.get("CKPTCTL", "client/ckptctl")
# The suites test one call's own outcome: a daemon that is not there (or
# stops) fails a call at once. The clients' retries after a restart
# (CKPTD_RETRY_TIMEOUT, default 60 s) have their own suite, restart_test.py,
# which passes retry_timeout explicitly.
os.environ.setdefault("CKPTD_RETRY_TIMEOUT", "0")


_CLEANUP = []


@atexit.register
def _cleanup():
    for d in _CLEANUP:
        shutil.rmtree(d, ignore_errors=True)


def tmp_root():
    """A fresh directory for checkpoints (under $TEST_TMPDIR when Bazel runs the
    test; else in /tmp, removed at exit)."""
    if os.environ.get("TEST_TMPDIR"):
        return tempfile.mkdtemp(prefix="root-", dir=os.environ["TEST_TMPDIR"])
    d = tempfile.mkdtemp(prefix="ckptd-pytest-")
    _CLEANUP.append(d)
    return d


def _log_dir():
    d = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
    if not d:
        d = tempfile.mkdtemp(prefix="ckptd-log-")
        _CLEANUP.append(d)
    return d


_LOGS = []


class Daemon:
    """The real ckptd binary on a socket in a fresh /tmp directory (Unix socket
    paths must stay under 108 bytes), serving `root`."""

    def __init__(self, root, *extra, socket=None):
        self.dir = tempfile.mkdtemp(prefix="ckptd-py-", dir="/tmp")
        # socket=: another daemon's path (a restart), else one in self.dir.
        self.socket = socket or os.path.join(self.dir, "ckptd.sock")
        self.log = os.path.join(_log_dir(), f"ckptd-{os.getpid()}-{len(_LOGS)}.log")
        _LOGS.append(self.log)
        self.root = root
        # The ports it bound (port 0 in --tcp/--peer-listen/--metrics-address):
        # see ports().
        self.port_file = os.path.join(self.dir, "ports.json")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [os.path.abspath(CKPTD), "--socket", self.socket, "--root", root,
                 "--port-file", self.port_file, *extra],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not (os.path.exists(self.socket) and os.path.exists(self.socket + ".fd")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ckptd did not start: {self.read_log()}")
            time.sleep(0.01)

    def ports(self, timeout=20):
        """The daemon's port file ({"tcp": N, "peer": N, "peer_address": ...,
        "metrics": N}, the listeners it has), once it is written (every
        listener up); AssertionError with the daemon's log if it is not
        within `timeout` s or the daemon exits first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.port_file) as f:
                    return json.load(f)  # written atomically: whole or absent
            except FileNotFoundError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited {self.proc.returncode}" if self.proc.poll() is not None
                       else f"not within {timeout:g} s")
                raise AssertionError(f"ckptd wrote no port file {self.port_file} ({why}); "
                                     f"its log:\n{self.read_log()[-3000:]}")
            time.sleep(0.01)

    def read_log(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # A daemon that does not exit 0 on SIGTERM (crash, hang, failed
        # drain) fails the test, unless the test already failed.
        rc = self.stop()
        if exc[0] is None and rc != 0:
            raise AssertionError(f"ckptd exited {rc} at teardown (expected 0): "
                                 f"{self.read_log()[-3000:]}")


class DaemonTestCase(unittest.TestCase):
    """A test class sharing one real daemon: cls.root (a fresh checkpoint root, filled
    by the class's `prepare(root)` before the daemon starts), cls.daemon, cls.sock. The
    daemon must exit 0 at teardown."""

    @classmethod
    def prepare(cls, root):
        pass

    @classmethod
    def setUpClass(cls):
        cls.root = tmp_root()
        cls.prepare(cls.root)
        cls.daemon = Daemon(cls.root)
        cls.sock = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc} at teardown: {cls.daemon.read_log()[-2000:]}"


# --- an independent safetensors reader (numpy only) -----------------------------

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
       "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


def run_ranks(world, fn, timeout=120):
    """Runs fn(rank) on `world` threads (the ranks of one job); returns their
    results in rank order, or raises the first rank's exception."""
    results, errors = [None] * world, []

    def go(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append((r, e))

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise sorted(errors, key=lambda x: x[0])[0][1]
    return results


def wait_for(what, fn, timeout, every):
    """fn()'s first truthy value, polled every `every` s until `timeout` s;
    else AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def read_safetensors(path):
    """{name: (dtype name, array)}; BF16 comes back as uint16 bit patterns."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        arr = np.frombuffer(data[b:e], dtype=_NP[t["dtype"]]).reshape(t["shape"])
        out[name] = (t["dtype"], arr.copy())
    return out


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_hf_dir(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(d, f)))
    return out


# --- unittest -> JUnit XML ------------------------------------------------------

class _Result(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.cases = []
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _add(self, test, kind, text=""):
        self.cases.append((test, kind, text, time.monotonic() - self._t0))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._add(test, "ok")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._add(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._add(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._add(test, "skipped", reason)


def main(suite_name):
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules["__main__"])
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Result)
    result = runner.run(suite)
    xml_path = os.environ.get("XML_OUTPUT_FILE")
    if xml_path:
        ts = ET.Element("testsuite", name=suite_name, tests=str(len(result.cases)),
                        failures=str(len(result.failures)), errors=str(len(result.errors)),
                        skipped=str(len(result.skipped)))
        for test, kind, text, secs in result.cases:
            cls, _, name = test.id().rpartition(".")
            tc = ET.SubElement(ts, "testcase", classname=cls, name=name, time=f"{secs:.3f}")
            if kind != "ok":
                el = ET.SubElement(tc, kind, message=text.strip().splitlines()[-1] if text else "")
                el.text = text
        root = ET.Element("testsuites")
        root.append(ts)
        ET.ElementTree(root).write(xml_path, encoding="utf-8", xml_declaration=True)
    ok = result.wasSuccessful() and result.testsRun > 0
    if not ok:
        for log in _LOGS:
            try:
                with open(log, errors="replace") as f:
                    print(f"--- {log} (last 4000 chars) ---\n{f.read()[-4000:]}", file=sys.stderr)
            except OSError:
                pass
    sys.exit(0 if ok else 1)
