"""The version of VERSION everywhere, and the API level check at connect time:
a client whose API level is above its daemon's is refused with
FAILED_PRECONDITION naming both versions ("upgrade the daemon"); the daemon
is asked once per client. The Python client, and the C++ client through
ckptctl, against the real daemon; a stand-in gRPC server plays a daemon from
before the Version RPC. CKPTD_TESTING_API_LEVEL (testing only) raises the
clients' level."""
import os
import shutil
import subprocess
import tempfile
import unittest
from concurrent import futures

import numpy as np

import ckptd
from ckptd import _proto, _version
import testlib

pb2, pb2_grpc = _proto.load_stubs()
import grpc  # noqa: E402  (after the stubs, like the client)

VERSION, API_LEVEL = _version.read_version_file(testlib.runfile("VERSION"))
NEWER = str(API_LEVEL + 1)


def refusal(socket, daemon, level, client_level=NEWER):
    return (f"ckptd client {VERSION} (api {client_level}) is newer than the daemon at {socket} "
            f"({daemon}, api {level}); upgrade the daemon")


class CountingStub:
    """Wraps a client's generated stub, counting its Version calls."""

    def __init__(self, stub):
        self.stub, self.versions = stub, 0

    def __getattr__(self, name):
        if name == "Version":
            self.versions += 1
        return getattr(self.stub, name)


def counted(client):
    client._stub._stub = CountingStub(client._stub._stub)
    return client._stub._stub


class TestingLevel:
    """Sets $CKPTD_TESTING_API_LEVEL for the block."""

    def __init__(self, level):
        self.level = level

    def __enter__(self):
        os.environ["CKPTD_TESTING_API_LEVEL"] = self.level

    def __exit__(self, *exc):
        os.environ.pop("CKPTD_TESTING_API_LEVEL", None)


def ckptctl(*args, level=None):
    env = dict(os.environ)
    env.pop("CKPTD_TESTING_API_LEVEL", None)
    if level is not None:
        env["CKPTD_TESTING_API_LEVEL"] = level
    return subprocess.run([testlib.CKPTCTL, *args], env=env, capture_output=True, text=True,
                          timeout=60)


class OldDaemon:
    """A gRPC server on a Unix socket serving only Status (and Version when
    `version` is a VersionResponse): a daemon from before the Version RPC,
    or one whose answer has no api_level."""

    def __init__(self, version=None):
        self.dir = tempfile.mkdtemp(prefix="ckptd-old-", dir="/tmp")
        self.socket = os.path.join(self.dir, "ckptd.sock")
        handlers = {"Status": grpc.unary_unary_rpc_method_handler(
            lambda req, ctx: pb2.StatusResponse(version="ckptd 0.0 (old)"),
            request_deserializer=pb2.StatusRequest.FromString,
            response_serializer=pb2.StatusResponse.SerializeToString)}
        if version is not None:
            handlers["Version"] = grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: version,
                request_deserializer=pb2.VersionRequest.FromString,
                response_serializer=pb2.VersionResponse.SerializeToString)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("ckptd.v1.Ckptd", handlers),))
        self.server.add_insecure_port("unix:" + self.socket)
        self.server.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop(None)
        shutil.rmtree(self.dir, ignore_errors=True)


class ApiVersionTest(testlib.DaemonTestCase):

    def test_package_version_is_VERSION(self):
        self.assertEqual(ckptd.__version__, VERSION)
        self.assertEqual(_version.API_LEVEL, API_LEVEL)

    def test_version_flags(self):
        r = subprocess.run([testlib.CKPTD, "--version"], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual((r.returncode, r.stdout),
                         (0, f"ckptd {VERSION} (api ckptd.v1, level {API_LEVEL})\n"))
        r = ckptctl("--version")
        self.assertEqual((r.returncode, r.stdout),
                         (0, f"ckptctl {VERSION} (ckptd api level {API_LEVEL})\n"))

    def test_daemon_reports_version_and_level(self):
        with ckptd.Client(self.sock) as c:
            st = c.status()
            v = c._stub.Version(pb2.VersionRequest(), timeout=10)
        self.assertEqual(st["version"], f"ckptd {VERSION} (api ckptd.v1)")
        self.assertEqual(st["api_level"], API_LEVEL)
        self.assertEqual((v.version, v.api_level, v.release), (st["version"], API_LEVEL, VERSION))

    def test_same_level_asks_once_per_client(self):
        with ckptd.Client(self.sock) as c:
            stub = counted(c)
            c.status()
            c.status()
            with self.assertRaises(ckptd.CkptdError) as e:
                c.inspect(os.path.join(self.root, "nothing-here"))
            self.assertEqual(e.exception.code, "NOT_FOUND")
            self.assertEqual(stub.versions, 1)
        with ckptd.Client(self.sock) as c:  # a new client asks again
            stub = counted(c)
            c.status()
            self.assertEqual(stub.versions, 1)

    def test_newer_python_client_is_refused(self):
        with TestingLevel(NEWER), ckptd.Client(self.sock) as c:
            stub = counted(c)
            for call in (c.status, lambda: c.load_state_dict({"w": np.zeros(4, np.float32)},
                                                             self.root, job_id="refused")):
                with self.assertRaises(ckptd.CkptdError) as e:
                    call()
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                self.assertEqual(e.exception.message,
                                 refusal(self.sock, f"ckptd {VERSION}", API_LEVEL))
            self.assertEqual(stub.versions, 1)  # the refusal is kept, not asked again
        # The module-level calls (one Client each) too; nothing reached the daemon.
        with TestingLevel(NEWER), self.assertRaises(ckptd.CkptdError) as e:
            ckptd.load_state_dict({"w": np.zeros(4, np.float32)}, self.root, socket=self.sock)
        self.assertIn("upgrade the daemon", e.exception.message)
        with ckptd.Client(self.sock) as c:
            self.assertEqual(int(c.status()["loads_started"]), 0)

    def test_newer_cpp_client_is_refused(self):
        r = ckptctl("status", "--daemon", self.sock, "--json", level=NEWER)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertEqual(r.stderr, "ckptctl: error: " +
                         refusal(self.sock, f"ckptd {VERSION}", API_LEVEL) +
                         " [FAILED_PRECONDITION]\n")
        r = ckptctl("status", "--daemon", self.sock, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f'"api_level":{API_LEVEL}', r.stdout.replace(" ", ""))

    def test_daemon_from_before_the_version_rpc_is_level_1(self):
        with OldDaemon() as old:
            with TestingLevel("1"), ckptd.Client(old.socket) as c:
                self.assertEqual(c.status()["version"], "ckptd 0.0 (old)")
            self.assertEqual(ckptctl("status", "--daemon", old.socket, level="1").returncode, 0)
            with TestingLevel("2"), ckptd.Client(old.socket) as c:
                with self.assertRaises(ckptd.CkptdError) as e:
                    c.status()
            want = refusal(old.socket, "a ckptd from before the Version RPC", 1, "2")
            self.assertEqual(e.exception.message, want)
            r = ckptctl("status", "--daemon", old.socket, level="2")
            self.assertEqual((r.returncode, r.stderr),
                             (1, f"ckptctl: error: {want} [FAILED_PRECONDITION]\n"))

    def test_unset_api_level_is_level_1(self):
        with OldDaemon(pb2.VersionResponse(version="ckptd 0.0 (old)", release="0.0")) as old:
            with TestingLevel("1"), ckptd.Client(old.socket) as c:
                c.status()
            with TestingLevel("2"), ckptd.Client(old.socket) as c:
                with self.assertRaises(ckptd.CkptdError) as e:
                    c.status()
            self.assertEqual(e.exception.message, refusal(old.socket, "ckptd 0.0", 1, "2"))

    def test_unreachable_daemon_error_is_the_calls_own(self):
        # The version check stays out of the way of other errors: a daemon
        # gone after connecting fails the call itself with UNAVAILABLE.
        with OldDaemon() as old:
            c = ckptd.Client(old.socket)
        with c, self.assertRaises(ckptd.CkptdError) as e:
            c.status()
        self.assertEqual(e.exception.code, "UNAVAILABLE")
        self.assertIn("Status: daemon unavailable", e.exception.message)


if __name__ == "__main__":
    testlib.main("api_version_test")
