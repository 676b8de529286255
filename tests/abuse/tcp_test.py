"""The TCP client API (issue 14): refused at start-up without mutual TLS unless
insecure_tcp is set; with TLS a client must present a certificate signed by the
configured CA, and then acts as tcp_uid (nobody), which may not read a root
whose default rule admits only the daemon's uid and the socket's group."""
import os
import subprocess
import tempfile
import time
import unittest

import testlib
import ckptd
from ckptd.errors import CkptdError

CKPTD = os.path.abspath(testlib.CKPTD)


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d):
    """A CA, a server certificate for 127.0.0.1 and two client certificates:
    one signed by the CA, one self-signed (a stranger)."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ckptd-test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    with open(os.path.join(d, "san.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-out", f"{name}.pem", cwd=d)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=stranger",
            "-keyout", "stranger.key", "-out", "stranger.pem", cwd=d)


class TcpTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pki = tempfile.mkdtemp(prefix="pki-", dir=os.environ.get("TEST_TMPDIR"))
        make_pki(cls.pki)
        cls.root = testlib.tmp_root()
        os.chmod(cls.root, 0o700)  # only root (the daemon's uid) may read it

    def p(self, name):
        return os.path.join(self.pki, name)

    def test_plaintext_tcp_refused_at_start_up(self):
        sock = os.path.join(tempfile.mkdtemp(dir="/tmp"), "s.sock")
        r = subprocess.run([CKPTD, "--socket", sock, "--root", self.root,
                            "--tcp", "127.0.0.1:0"],
                           capture_output=True, text=True, timeout=30)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("tcp_tls_cert", r.stderr)
        self.assertIn("insecure_tcp", r.stderr)

    def test_half_tls_config_refused(self):
        sock = os.path.join(tempfile.mkdtemp(dir="/tmp"), "s.sock")
        r = subprocess.run([CKPTD, "--socket", sock, "--root", self.root,
                            "--tcp", "127.0.0.1:0", "--tcp-tls-cert", self.p("server.pem")],
                           capture_output=True, text=True, timeout=30)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("tcp_tls_ca", r.stderr)

    def test_insecure_tcp_explicit_starts_with_a_warning(self):
        # Port 0: the daemon binds one and reports it (no free-port race).
        with testlib.Daemon(self.root, "--tcp", "127.0.0.1:0", "--insecure-tcp") as d:
            port = d.ports()["tcp"]
            self.assertIn(f"tcp service listening on 127.0.0.1:{port}", d.read_log())
            with ckptd.Client(f"127.0.0.1:{port}", tcp=True) as c:
                c.status()
            self.assertIn("WITHOUT TLS", d.read_log())

    def test_mutual_tls(self):
        with testlib.Daemon(self.root, "--tcp", "127.0.0.1:0", "--tcp-tls-cert", self.p("server.pem"),
                            "--tcp-tls-key", self.p("server.key"), "--tcp-tls-ca", self.p("ca.pem")) as d:
            # The port file is written once the TCP listener is up.
            target = f"127.0.0.1:{d.ports()['tcp']}"
            with ckptd.Client(target, tcp=True, tls=(self.p("ca.pem"), self.p("client.pem"),
                                                     self.p("client.key"))) as c:
                st = c.status()
            self.assertTrue(st is not None)
            # A TCP caller acts as tcp_uid (65534): the private root is not its to read.
            with ckptd.Client(target, tcp=True, tls=(self.p("ca.pem"), self.p("client.pem"),
                                                     self.p("client.key"))) as c:
                with self.assertRaises(CkptdError) as e:
                    c.inspect(self.root)
            self.assertEqual(e.exception.code, "PERMISSION_DENIED")
            self.assertIn("65534", str(e.exception))
            # No certificate, or one the CA did not sign: no call gets through.
            for tls in (None, (self.p("ca.pem"), self.p("stranger.pem"), self.p("stranger.key"))):
                with self.assertRaises(Exception):
                    if tls is None:
                        import grpc
                        ch = grpc.secure_channel(target, grpc.ssl_channel_credentials(
                            root_certificates=open(self.p("ca.pem"), "rb").read()))
                        from ckptd import _proto
                        pb2, pb2_grpc = _proto.load_stubs()
                        pb2_grpc.CkptdStub(ch).Status(pb2.StatusRequest(), timeout=5)
                    else:
                        with ckptd.Client(target, tcp=True, tls=tls) as c:
                            c.status()
            self.assertIsNone(d.proc.poll())


if __name__ == "__main__":
    testlib.main("tcp_test")
