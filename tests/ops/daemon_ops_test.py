"""Operating the real ckptd: the Prometheus endpoint (plain HTTP scrapes,
`promtool check metrics`, and Debian's real Prometheus server scraping it on
loopback), JSON-lines logs, systemd readiness (sd_notify), the gRPC health
service on the peer port (what Kubernetes probes), and `ckptctl status`.
Loads run through bazel-bin/client/ckptctl against the bundled example."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import testlib

CKPTCTL = os.path.abspath(testlib.CKPTCTL)
CKPTD = os.path.abspath(testlib.CKPTD)
EXAMPLE = os.path.abspath("examples/tiny-model")
LAYOUT_TP2 = os.path.abspath("examples/layout-tp2.json")
LAYOUT_TP4 = os.path.abspath("examples/layout-tp4-dim0.json")
RULES = os.path.abspath("deploy/prometheus/ckptd-rules.yml")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, fn, timeout=30.0, every=0.1):
    return testlib.wait_for(what, fn, timeout, every)


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def parse_metrics(text):
    """{(name, ((label, value), ...)): value} of a text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        assert m, f"unparsable sample line: {line!r}"
        labels = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def ckptctl(*args, check=True):
    r = subprocess.run([CKPTCTL, *args], capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(args)}: exit {r.returncode}: {r.stderr}")
    return r


class MetricsDaemon(testlib.Daemon):
    """ckptd with metrics on a free loopback port (port 0: ckptd reports the
    one it got in its port file and its log)."""

    def __init__(self, root, *extra):
        super().__init__(root, "--metrics-address", "127.0.0.1:0", *extra)
        self.metrics_port = self.ports()["metrics"]
        assert f"metrics on http://127.0.0.1:{self.metrics_port}/metrics" in self.read_log(), \
            self.read_log()
        self.url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self):
        status, ctype, body = http_get(self.url)
        assert status == 200, status
        assert ctype.startswith("text/plain"), ctype
        return body


def promtool_check(text):
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    return r.returncode, (r.stdout + r.stderr).strip()


class OpsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = testlib.tmp_root()
        cls.ckpt = os.path.join(cls.root, "tp2")
        ckptctl("shard", EXAMPLE, "--layout", LAYOUT_TP2, "--out", cls.ckpt, "--unique-id", "1")
        # A copy with one data byte flipped: its loads fail their checksum.
        cls.bad = os.path.join(cls.root, "bad")
        shutil.copytree(cls.ckpt, cls.bad)
        with open(os.path.join(cls.bad, "0_1.safetensors"), "r+b") as f:
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        cls.out = tempfile.mkdtemp(prefix="out-", dir=cls.root)

    def load(self, daemon, ckpt=None, job=None, check=True):
        args = ["load", ckpt or self.ckpt, "--layout", LAYOUT_TP4, "--out",
                tempfile.mkdtemp(dir=self.out), "--daemon", daemon.socket, "--json"]
        if job:
            args += ["--job-id", job]
        r = ckptctl(*args, check=check)
        return json.loads(r.stdout) if r.returncode == 0 else r

    # --- metrics -----------------------------------------------------------------

    def test_scrape_after_loads_shows_counters_moved_and_passes_promtool(self):
        with MetricsDaemon(self.root) as d:
            before = d.scrape()
            rc, msg = promtool_check(before)
            self.assertEqual((rc, msg), (0, ""), "promtool on the first scrape")
            m0 = parse_metrics(before)
            self.assertEqual(m0[("ckptd_loads_started_total", ())], 0)
            self.assertEqual(m0[("ckptd_cache_bytes", ())], 0)
            self.assertEqual(m0[("ckptd_active_jobs", (("state", "waiting"),))], 0)

            r1 = self.load(d)
            # What an offline load reports, a daemon load reports (issue 38).
            self.assertEqual(r1["reads"], 2)
            self.assertGreater(r1["checksums_verified"], 0)
            m1 = parse_metrics(d.scrape())
            self.assertEqual(m1[("ckptd_loads_started_total", ())], 4)  # one per rank
            self.assertEqual(m1[("ckptd_loads_succeeded_total", ())], 4)
            self.assertEqual(m1[("ckptd_loads_failed_total", ())], 0)
            self.assertEqual(m1[("ckptd_load_jobs_total", (("result", "ok"),))], 1)
            self.assertEqual(m1[("ckptd_storage_read_bytes_total", ())], r1["bytes_read"])
            self.assertGreater(r1["bytes_read"], 0)
            self.assertEqual(m1[("ckptd_delivered_bytes_total", ())], r1["bytes_delivered"])
            # The first load after start may leave the cache to the background
            # fill (docs/daemon.md, "The data cache": no load waits for fresh cache memory).
            wait_for("the cache filled", lambda: parse_metrics(d.scrape())[
                ("ckptd_cache_bytes", ())] > 0)
            m1 = parse_metrics(d.scrape())
            self.assertGreater(m1[("ckptd_cache_bytes", ())], 0)
            self.assertGreater(m1[("ckptd_cache_entries", ())], 0)
            # Whatever the fill published is what the cache holds (the load kept
            # nothing itself when it deferred, everything when it did not).
            self.assertEqual(m1[("ckptd_cache_fills_failed_total", ())], 0)
            if m1[("ckptd_cache_fills_total", ())] > 0:
                self.assertEqual(m1[("ckptd_cache_fills_total", ())], 1)
                self.assertEqual(m1[("ckptd_cache_fill_bytes_total", ())],
                                 m1[("ckptd_cache_bytes", ())])
            else:
                self.assertEqual(m1[("ckptd_cache_fill_bytes_total", ())], 0)
            self.assertGreater(m1[("ckptd_cache_misses_total", ())], 0)
            for phase in ("list", "plan", "read", "copy", "total"):
                self.assertEqual(m1[("ckptd_load_phase_duration_seconds_count",
                                     (("phase", phase),))], 1, phase)
                self.assertEqual(m1[("ckptd_load_phase_duration_seconds_bucket",
                                     (("le", "+Inf"), ("phase", phase)))], 1, phase)
            self.assertGreater(m1[("process_resident_memory_bytes", ())], 1 << 20)

            # The same job again comes from the cache: hits move, storage does not.
            self.load(d)
            m2 = parse_metrics(d.scrape())
            self.assertEqual(m2[("ckptd_loads_succeeded_total", ())], 8)
            self.assertEqual(m2[("ckptd_storage_read_bytes_total", ())],
                             m1[("ckptd_storage_read_bytes_total", ())])
            self.assertGreater(m2[("ckptd_cache_hits_total", ())], m1[("ckptd_cache_hits_total", ())])
            self.assertEqual(m2[("ckptd_delivered_bytes_total", ())], 2 * r1["bytes_delivered"])

            # A corrupt checkpoint: the job fails for its 4 ranks.
            r = self.load(d, ckpt=self.bad, check=False)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("DATA_LOSS", r.stderr)
            after = d.scrape()
            m3 = parse_metrics(after)
            self.assertEqual(m3[("ckptd_loads_failed_total", ())], 4)
            self.assertEqual(m3[("ckptd_load_jobs_total", (("result", "error"),))], 1)
            # By code, for the alert tiers (deploy/prometheus: DATA_LOSS pages).
            self.assertEqual(m3[("ckptd_load_job_errors_total", (("code", "DATA_LOSS"),))], 1)
            self.assertEqual(m3[("ckptd_load_phase_duration_seconds_count",
                                 (("phase", "total"),))], 2)  # failures are not timed

            # Evicting drops the cached bytes.
            ckptctl("evict", self.ckpt, "--daemon", d.socket)
            ckptctl("evict", self.bad, "--daemon", d.socket)
            m4 = parse_metrics(d.scrape())
            self.assertEqual(m4[("ckptd_cache_bytes", ())], 0)
            self.assertGreater(m4[("ckptd_cache_evictions_total", ())], 0)

            rc, msg = promtool_check(after)
            self.assertEqual((rc, msg), (0, ""), "promtool on the scrape after loads")
            # The check is not vacuous: a counter without _total is flagged.
            rc, msg = promtool_check(after.replace("ckptd_loads_started_total",
                                                   "ckptd_loads_started"))
            self.assertIn("counter metrics should have \"_total\" suffix", msg)
            # Only /metrics is served.
            with self.assertRaises(urllib.error.HTTPError):
                http_get(f"http://127.0.0.1:{d.metrics_port}/other")

    def test_a_strict_load_missing_a_key_counts_as_a_failed_job(self):
        """issue 38: a strict rank that fails on a missing key while the others load
        is a failed job in the metrics and the log (the failing-jobs alert sees it)."""
        with open(LAYOUT_TP4) as f:
            layout = json.load(f)
        extra = dict(layout["ranks"][0]["tensors"][0], name="model.no_such_tensor")
        layout["ranks"][0]["tensors"].append(extra)
        path = os.path.join(self.out, "layout-missing.json")
        with open(path, "w") as f:
            json.dump(layout, f)
        with MetricsDaemon(self.root) as d:
            r = ckptctl("load", self.ckpt, "--layout", path, "--out", tempfile.mkdtemp(dir=self.out),
                        "--daemon", d.socket, "--job-id", "typo", check=False)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("model.no_such_tensor", r.stderr)
            m = parse_metrics(d.scrape())
            self.assertEqual(m[("ckptd_load_jobs_total", (("result", "error"),))], 1)
            self.assertEqual(m.get(("ckptd_load_jobs_total", (("result", "ok"),)), 0), 0)
            # A user's error: counted by its code, which no paging alert watches.
            self.assertEqual(m[("ckptd_load_job_errors_total", (("code", "NOT_FOUND"),))], 1)
            wait_for("the job's line", lambda: "job=typo" in d.read_log(), timeout=10)
            line = [x for x in d.read_log().splitlines() if "load job=typo" in x][0]
        self.assertIn(" warn ckptd: load job=typo", line)
        self.assertIn("ranks=4 ranks_failed=1 failed: NOT_FOUND", line)

    def test_help_exits_zero_and_lists_the_flags_version_follows_the_api_level(self):
        """issue 38: `ckptd --help` exits 0 and lists its flags (it printed "No flags
        matched" and exited 1); --version names the API level its minor follows."""
        r = subprocess.run([CKPTD, "--help"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        for flag in ("--socket=", "--root=", "--cache_budget=", "--log_level=", "--check_config="):
            self.assertRegex(r.stdout, r"(?m)^  " + re.escape(flag), flag)
        self.assertNotIn("No flags matched", r.stdout + r.stderr)
        self.assertNotIn("--flagfile=", r.stdout)  # Abseil's own: --helpfull
        full = subprocess.run([CKPTD, "--helpfull"], capture_output=True, text=True, timeout=30)
        self.assertEqual(full.returncode, 0)
        self.assertIn("--flagfile=", full.stdout)
        v = subprocess.run([CKPTD, "--version"], capture_output=True, text=True, timeout=30)
        m = re.match(r"^ckptd (\d+)\.(\d+) \(api ckptd\.v1, level (\d+)\)$", v.stdout.strip())
        self.assertIsNotNone(m, v.stdout)
        self.assertEqual(m.group(2), m.group(3))  # 0.4 is level 4

    def test_a_missing_root_warns_at_start_and_fails_check_config(self):
        """issue 38: a root that does not exist (an unmounted NFS path) was accepted
        without a word."""
        missing = os.path.join(self.root, "not-mounted")
        cfg = os.path.join(self.out, "missing-root.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots: [{self.root}, {missing}]\n")
        r = subprocess.run([CKPTD, "--check-config", cfg], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn(f"root {missing}: No such file or directory (an unmounted volume, or a typo?)",
                      r.stderr)
        with testlib.Daemon(self.root, "--root", f"{self.root},{missing}") as d:
            self.load(d, job="with-a-missing-root")  # the roots that exist serve
            log = d.read_log()
        self.assertRegex(log, r"warn ckptd: root " + re.escape(missing) +
                         r": No such file or directory .*NOT_FOUND until it exists")

    def test_the_fd_table_is_grown_at_start_not_in_the_first_connection(self):
        # Client connections are moved to fd numbers in the upper half of the
        # fd limit (uds_listener.h); the kernel grows the fd table when such a
        # number is first used, and with threads that waits for an RCU grace
        # period (10-25 ms): the daemon grows it before it serves, so the
        # first client after a start does not pay it. /proc's FDSize is the
        # table's size.
        with testlib.Daemon(self.root) as d:
            with open(f"/proc/{d.proc.pid}/status") as f:
                status = f.read()
            fd_size = int(re.search(r"^FDSize:\s+(\d+)$", status, re.M).group(1))
            with open(f"/proc/{d.proc.pid}/limits") as f:
                limit = int(re.search(r"^Max open files\s+(\d+)", f.read(), re.M).group(1))
            self.assertGreaterEqual(fd_size, min(limit, 1 << 20) - 16,
                                    f"FDSize {fd_size}, open files limit {limit}")

    def test_metrics_are_off_by_default_and_address_errors_are_reported(self):
        with testlib.Daemon(self.root) as d:
            self.assertNotIn("metrics on", d.read_log())
            # No TCP socket listens in the daemon: its sockets' inodes are
            # none of the LISTEN (0A) entries of /proc/net/tcp{,6}.
            inodes = set()
            for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
            self.assertTrue(inodes, "the daemon's Unix sockets are there")
            listening = set()
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                with open(table) as f:
                    for line in f.readlines()[1:]:
                        cols = line.split()
                        if cols[3] == "0A":
                            listening.add(cols[9])
            self.assertEqual(inodes & listening, set(), "no TCP listener (metrics off)")
        # A port in use stops the start with a message naming the address.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            tmp = tempfile.mkdtemp(prefix="ckptd-m-", dir="/tmp")
            try:
                r = subprocess.run([CKPTD, "--socket", os.path.join(tmp, "s.sock"), "--root",
                                    self.root, "--metrics-address", f"127.0.0.1:{port}"],
                                   capture_output=True, text=True, timeout=30)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.assertEqual(r.returncode, 1)
            self.assertIn(f"cannot serve metrics on 127.0.0.1:{port}", r.stderr)
        r = subprocess.run([CKPTD, "--root", self.root, "--metrics-address", "nope",
                            "--print-config"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 1)
        self.assertIn("metrics_address", r.stderr)

    def test_peer_health_metrics_and_grpc_health_on_peer_port(self):
        # a's peer port is TCP (port 0: the kernel picks it, the port file says
        # which), where Kubernetes would probe it; b, started later, is a Unix
        # socket, so a can name it before it exists.
        b_addr = "unix:" + os.path.join(tempfile.mkdtemp(prefix="ckptd-p-", dir="/tmp"), "b.peer")
        with MetricsDaemon(self.root, "--peer-listen", "127.0.0.1:0", "--peers", b_addr) as a:
            a_addr = a.ports()["peer_address"]
            self.assertEqual(a_addr, f"127.0.0.1:{a.ports()['peer']}")
            self.assertIn(f"peer service listening on {a_addr}", a.read_log())
            m = parse_metrics(a.scrape())
            self.assertEqual(m[("ckptd_peers", ())], 1)
            self.assertEqual(m[("ckptd_peer_up", (("peer", b_addr),))], 0)
            self.assertEqual(grpc_health(a_addr), "SERVING")
            with testlib.Daemon(self.root, "--peer-listen", b_addr, "--peers", f"{a_addr},{b_addr}"):
                wait_for("the peer to be up", lambda: parse_metrics(a.scrape()).get(
                    ("ckptd_peer_up", (("peer", b_addr),))) == 1)
                m = parse_metrics(a.scrape())
                self.assertGreater(m[("ckptd_peer_rtt_seconds", (("peer", b_addr),))], 0)
            # Peer health is cached a few seconds (Status and every scrape
            # share one parallel round of pings): the stopped peer shows
            # DOWN within that.
            t0 = time.monotonic()
            wait_for("the stopped peer to show DOWN", lambda: "peers: 0 of 1 reachable" in
                     ckptctl("status", "--daemon", a.socket).stdout)
            self.assertLess(time.monotonic() - t0, 6)
            out = ckptctl("status", "--daemon", a.socket).stdout
            self.assertRegex(out, r"peers: 0 of 1 reachable, this daemon is 127\.0\.0\.1:\d+")
            self.assertRegex(out, rf"{re.escape(b_addr)}\s+DOWN")
            rc, msg = promtool_check(a.scrape())
            self.assertEqual((rc, msg), (0, ""))

    def test_a_large_peer_set_is_pinged_only_where_this_daemon_called(self):
        # 70 peers (more than the 64 a status pings): a status pings 64 of
        # them (those this daemon called most recently first) and says how
        # many there are (issue 34: a scrape of every daemon of a large peer
        # set must not cost N^2 pings). Nothing listens there.
        # All 70 stay bound (not listening: a connection is refused) for the
        # whole test, so they are 70 different ports that neither this
        # daemon's own --peer-listen 127.0.0.1:0 nor a test running beside
        # this one can be handed (a port closed early once came back as a
        # listening daemon's: a reachable "peer").
        held = [socket.socket() for _ in range(70)]
        try:
            for s in held:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in held]
            peers = ",".join(f"127.0.0.1:{p}" for p in ports)
            with testlib.Daemon(self.root, "--peer-listen", "127.0.0.1:0", "--peers", peers) as d:
                st = json.loads(ckptctl("status", "--daemon", d.socket, "--json").stdout)
                self.assertEqual(st["peers_known"], 70, st)
                self.assertEqual(len(st["peers"]), 64, st)
                self.assertTrue(all(not p["reachable"] for p in st["peers"]), st["peers"])
                out = ckptctl("status", "--daemon", d.socket).stdout
                self.assertIn("peers: 0 of 64 checked reachable (of 70;", out)
        finally:
            for s in held:
                s.close()

    def test_status_pings_silent_peers_in_parallel_and_caches_the_answer(self):
        # Eight peers that accept TCP connections but never answer: each ping
        # ends at its 300 ms deadline. One after another that is 2.4 s per
        # Status; in parallel, one deadline.
        silent = []
        for _ in range(8):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            silent.append(s)
        try:
            peers = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in silent)
            with testlib.Daemon(self.root, "--peer-listen", "127.0.0.1:0", "--peers", peers) as d:
                t0 = time.monotonic()
                out = ckptctl("status", "--daemon", d.socket).stdout
                first = time.monotonic() - t0
                self.assertIn("peers: 0 of 8 reachable", out)
                self.assertLess(first, 1.5, "the pings ran one after another")
                # Within the next few seconds the same answer, without pinging.
                t0 = time.monotonic()
                again = ckptctl("status", "--daemon", d.socket).stdout
                self.assertLess(time.monotonic() - t0, first)
                self.assertIn("peers: 0 of 8 reachable", again)
        finally:
            for s in silent:
                s.close()

    def test_multi_node_load_counts_peer_bytes(self):
        # Two daemons that must know each other's address before either
        # starts: Unix socket peer addresses (nothing here is about TCP).
        d = tempfile.mkdtemp(prefix="ckptd-p-", dir="/tmp")
        p1, p2 = f"unix:{d}/a.peer", f"unix:{d}/b.peer"
        peers = f"{p1},{p2}"
        with MetricsDaemon(self.root, "--peer-listen", p1, "--peers", peers) as a, \
                MetricsDaemon(self.root, "--peer-listen", p2, "--peers", peers) as b:
            for sock in (p1, p2):  # owner-only socket files
                self.assertEqual(os.stat(sock[len("unix:"):]).st_mode & 0o777, 0o600, sock)
            r = ckptctl("load", self.ckpt, "--layout", LAYOUT_TP4, "--out",
                        tempfile.mkdtemp(dir=self.out), "--daemon", f"{a.socket},{b.socket}",
                        "--json")
            report = json.loads(r.stdout)
            ma, mb = parse_metrics(a.scrape()), parse_metrics(b.scrape())
            for m in (ma, mb):
                self.assertEqual(m[("ckptd_load_jobs_total", (("result", "ok"),))], 1)
                self.assertEqual(m[("ckptd_loads_succeeded_total", ())], 2)  # 2 ranks each
                self.assertEqual(m[("ckptd_peer_up", (("peer", p2 if m is ma else p1),))], 1)
            received = (ma[("ckptd_peer_received_bytes_total", ())] +
                        mb[("ckptd_peer_received_bytes_total", ())])
            sent = ma[("ckptd_peer_sent_bytes_total", ())] + mb[("ckptd_peer_sent_bytes_total", ())]
            self.assertGreater(received, 0)
            self.assertEqual(received, sent)
            # Every byte was read from storage once, by one node or the other.
            self.assertEqual(ma[("ckptd_storage_read_bytes_total", ())] +
                             mb[("ckptd_storage_read_bytes_total", ())], report["bytes_read"])
            self.assertIn("load job=", a.read_log())
            self.assertRegex(a.read_log() + b.read_log(), r"from_peers=[1-9]\d*B")

    def test_prometheus_server_scrapes_ckptd(self):
        """Debian's prometheus, on loopback, scrapes ckptd every second and
        evaluates the example alert rules (deploy/prometheus)."""
        if not shutil.which("prometheus"):
            self.fail("prometheus is not installed (deploy/install-deps.sh installs it)")
        r = subprocess.run(["promtool", "check", "rules", RULES], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with MetricsDaemon(self.root) as d:
            work = tempfile.mkdtemp(prefix="prom-", dir=os.environ.get("TEST_TMPDIR"))
            port = free_port()
            with open(os.path.join(work, "prometheus.yml"), "w") as f:
                f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                        f"rule_files:\n  - {RULES}\n"
                        "scrape_configs:\n  - job_name: ckptd\n    static_configs:\n"
                        f"      - targets: ['127.0.0.1:{d.metrics_port}']\n")
            with open(os.path.join(work, "prometheus.log"), "w") as log:
                prom = subprocess.Popen(
                    ["prometheus", f"--config.file={work}/prometheus.yml",
                     f"--storage.tsdb.path={work}/data", f"--web.listen-address=127.0.0.1:{port}",
                     "--storage.tsdb.retention.time=1h"],
                    stdout=log, stderr=subprocess.STDOUT)
            try:
                api = f"http://127.0.0.1:{port}/api/v1"

                def query(q):
                    try:
                        _, _, body = http_get(f"{api}/query?" + urllib.parse.urlencode({"query": q}))
                    except OSError:
                        return None
                    res = json.loads(body)["data"]["result"]
                    return float(res[0]["value"][1]) if res else None

                wait_for("prometheus to scrape ckptd", lambda: query('up{job="ckptd"}') == 1,
                         timeout=60, every=0.5)
                self.load(d)
                wait_for("the load in prometheus",
                         lambda: query("ckptd_loads_succeeded_total") == 4, timeout=60, every=0.5)
                self.assertGreater(query("ckptd_storage_read_bytes_total"), 0)
                self.assertEqual(query('ckptd_load_phase_duration_seconds_count{phase="read"}'), 1)
                _, _, body = http_get(f"{api}/rules")
                groups = json.loads(body)["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                self.assertTrue(rules)
                wait_for("every rule evaluated", lambda: all(
                    r.get("health") == "ok" for g in json.loads(http_get(f"{api}/rules")[2])
                    ["data"]["groups"] for r in g["rules"]), timeout=30, every=0.5)
                _, _, body = http_get(f"{api}/targets")
                (target,) = json.loads(body)["data"]["activeTargets"]
                self.assertEqual(target["health"], "up", target.get("lastError"))
            finally:
                prom.send_signal(signal.SIGTERM)
                try:
                    prom.wait(30)
                except subprocess.TimeoutExpired:
                    prom.kill()
                    prom.wait()
                shutil.rmtree(work, ignore_errors=True)

    # --- logs ---------------------------------------------------------------------

    def test_json_logs_one_line_per_job(self):
        with testlib.Daemon(self.root, "--log-format", "json") as d:
            ok = self.load(d, job="json-ok")
            self.load(d, ckpt=self.bad, job="json-bad", check=False)
            wait_for("the failed job's line", lambda: "json-bad" in d.read_log(), timeout=10)
            lines = d.read_log().splitlines()
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        for r in records:
            self.assertRegex(r["ts"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
            self.assertIn(r["level"], ("trace", "debug", "info", "warn", "error", "critical"))
            self.assertTrue("msg" in r or r.get("event") == "load", r)
        # Every line is structured (issue 38): its key=value tokens are fields,
        # numbers as numbers, the words before them the event.
        serving = [r for r in records if r.get("event", "").startswith("serving on")]
        self.assertEqual(len(serving), 1, lines)
        self.assertIsInstance(serving[0]["cache_budget"], int)
        self.assertGreater(serving[0]["io_threads"], 0)
        fills = [r for r in records if r.get("event") == "cache fill"]
        for f in fills:
            self.assertEqual(f["path"], os.path.realpath(self.ckpt))
            self.assertIsInstance(f["read"], int)
        jobs = [r for r in records if r.get("event") == "load"]
        self.assertEqual([j["job"] for j in jobs], ["json-ok", "json-bad"])
        good, bad = jobs
        self.assertEqual(good["level"], "info")
        self.assertEqual(good["result"], "ok")
        self.assertEqual(good["path"], os.path.realpath(self.ckpt))
        self.assertEqual(good["ranks"], 4)
        self.assertEqual(good["bytes_read"], ok["bytes_read"])
        self.assertEqual(good["bytes_delivered"], ok["bytes_delivered"])
        for k in ("list_s", "plan_s", "read_s", "copy_s", "wall_s"):
            self.assertGreaterEqual(good[k], 0)
        self.assertEqual(bad["level"], "warn")
        self.assertEqual(bad["result"], "error")
        self.assertEqual(bad["code"], "DATA_LOSS")
        self.assertIn("checksum", bad["error"])
        # No line per tensor at the default level: the example has 8 tensors
        # and each job wrote one line; the rest are start-up, per-rank
        # failures, and shutdown.
        self.assertLessEqual(len(records), 12, lines)

    def test_text_logs_and_level_from_config(self):
        cfg = os.path.join(self.root, "warn.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots: [{self.root}]\nlog_level: warn\nlog_format: json\n")
        r = subprocess.run([CKPTD, "--check-config", cfg], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with testlib.Daemon(self.root, "--config", cfg) as d:
            self.load(d, job="quiet")
            self.load(d, ckpt=self.bad, job="loud", check=False)
            wait_for("the failed job's line", lambda: "loud" in d.read_log(), timeout=10)
            log = d.read_log()
        records = [json.loads(x) for x in log.splitlines()]
        self.assertTrue(records)
        self.assertTrue(all(r["level"] in ("warn", "error") for r in records), log)
        self.assertNotIn("quiet", log)
        # Default: text lines, the job's line as before.
        with testlib.Daemon(self.root) as d:
            self.load(d, job="texty")
            log = d.read_log()
        self.assertRegex(log, r"info ckptd: load job=texty path=\S+ ranks=4 read=\d+B .* wall=")
        self.assertNotIn(" warning ckptd:", log)
        with self.assertRaises(json.JSONDecodeError):
            json.loads(log.splitlines()[0])
        bad = os.path.join(self.root, "bad.yaml")
        with open(bad, "w") as f:
            f.write(f"roots: [{self.root}]\nlog_format: xml\n")
        r = subprocess.run([CKPTD, "--check-config", bad], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("key 'log_format': must be text or json", r.stderr)
        # A boolean key that is neither true nor false, in the file and as a flag.
        with open(bad, "w") as f:
            f.write(f"roots: [{self.root}]\ncache_laid_out_copies: maybe\n")
        r = subprocess.run([CKPTD, "--check-config", bad], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("key 'cache_laid_out_copies': must be true or false", r.stderr)
        r = subprocess.run([CKPTD, "--root", self.root, "--cache-laid-out-copies", "maybe",
                            "--print-config"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("cache_laid_out_copies", r.stderr)

    # --- memory budgets (docs/operations.md, "Memory") --------------------------------

    def test_memory_budgets_must_fit_the_memory_limit(self):
        """Budgets the operator set that do not fit memory_limit stop the daemon at
        start-up (exit 1, each budget named, no socket left); budgets left at their
        defaults shrink to fit instead, say so in the log, and the daemon serves."""
        sock = os.path.join(tempfile.mkdtemp(prefix="ckptd-mem-", dir="/tmp"), "d.sock")
        r = subprocess.run([CKPTD, "--root", self.root, "--socket", sock, "--cache-budget", "3GiB",
                            "--memory-limit", "2GiB"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("the memory budgets do not fit the memory this daemon may use: "
                      "cache_budget 3 GiB (set) + arena_limit 64 GiB (default)", r.stderr)
        self.assertIn("> 2 GiB (memory_limit)", r.stderr)
        self.assertFalse(os.path.exists(sock), "a daemon that refused to start left its socket")
        with testlib.Daemon(self.root, "--memory-limit", "2GiB") as d:
            self.load(d, job="small")
            log = d.read_log()
        self.assertRegex(log, r"arena_limit not set: \d+ MiB instead of its default 64 GiB to fit "
                              r"2 GiB \(memory_limit\)")
        self.assertIn("load job=small", log)

    # --- the peer plane's configuration ------------------------------------------------

    def test_port_zero_and_unix_peer_addresses_that_cannot_work_are_refused(self):
        def run(*args):
            return subprocess.run([CKPTD, "--root", self.root, *args, "--print-config"],
                                  capture_output=True, text=True, timeout=30)
        # Port 0 is for this daemon's own listeners only.
        r = run("--peer-listen", "127.0.0.1:0", "--peers", "127.0.0.1:7071,127.0.0.1:0")
        self.assertEqual(r.returncode, 1)
        self.assertIn("peer '127.0.0.1:0' has port 0", r.stderr)
        r = run("--peer-listen", "127.0.0.1:0", "--peer-dns", "ckptd:7071")
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot be combined with 'peer_dns'", r.stderr)
        r = run("--peer-listen", "127.0.0.1:0", "--peers", "127.0.0.1:7071", "--port-file",
                "/tmp/p.json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("port_file: /tmp/p.json", r.stdout)
        # A Unix socket peer plane: local (no TLS needed), an absolute path, no peer TLS.
        r = run("--peer-listen", "unix:/tmp/x.peer", "--peers", "unix:/tmp/x.peer,unix:/tmp/y.peer")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run("--peer-listen", "unix:x.peer")
        self.assertEqual(r.returncode, 1)
        self.assertIn("must be unix:/absolute/path", r.stderr)
        r = run("--peer-listen", "unix:/tmp/x.peer", "--peer-tls-cert", "/a", "--peer-tls-key", "/b",
                "--peer-tls-ca", "/c")
        self.assertEqual(r.returncode, 1)
        self.assertIn("is a Unix socket: peer TLS", r.stderr)

    def test_port_file_reports_every_port_zero_listener(self):
        with testlib.Daemon(self.root, "--tcp", "127.0.0.1:0", "--insecure-tcp", "--peer-listen",
                            "127.0.0.1:0", "--metrics-address", "127.0.0.1:0") as d:
            ports = d.ports()
            self.assertEqual(set(ports), {"tcp", "peer", "peer_address", "metrics"})
            self.assertTrue(all(ports[k] > 0 for k in ("tcp", "peer", "metrics")), ports)
            log = d.read_log()
            self.assertIn(f"tcp service listening on 127.0.0.1:{ports['tcp']}", log)
            self.assertIn(f"peer service listening on 127.0.0.1:{ports['peer']}", log)
            self.assertIn(f"metrics on http://127.0.0.1:{ports['metrics']}/metrics", log)
            # The bound peer address is this node's identity (Status).
            self.assertIn(f"this daemon is 127.0.0.1:{ports['peer']}",
                          ckptctl("status", "--daemon", d.socket).stdout)
            self.assertEqual(grpc_health(f"127.0.0.1:{ports['peer']}"), "SERVING")
            port_file = d.port_file
        self.assertFalse(os.path.exists(port_file), "removed at exit")

    def test_a_second_daemon_on_the_same_ports_is_refused_not_sharing_them(self):
        # gRPC listens with SO_REUSEPORT, with which a second process of the
        # same uid could bind the same port and take part of the connections:
        # a second daemon given the first's peer or client TCP port must fail
        # to start, naming the port, and the first keep serving.
        with testlib.Daemon(self.root, "--tcp", "127.0.0.1:0", "--insecure-tcp", "--peer-listen",
                            "127.0.0.1:0") as d:
            ports = d.ports()
            sock = os.path.join(tempfile.mkdtemp(prefix="ckptd-second-"), "s.sock")
            for args, want in (
                    (("--peer-listen", f"127.0.0.1:{ports['peer']}"),
                     f"cannot listen for peers on 127.0.0.1:{ports['peer']}: Address already in use"),
                    (("--tcp", f"127.0.0.1:{ports['tcp']}", "--insecure-tcp"),
                     f"cannot start the gRPC server on 127.0.0.1:{ports['tcp']}")):
                r = subprocess.run([CKPTD, "--root", self.root, "--socket", sock, *args],
                                   capture_output=True, text=True, timeout=30)
                self.assertEqual(r.returncode, 1, r.stderr[-2000:])
                self.assertIn(want, r.stderr)
            self.assertEqual(grpc_health(f"127.0.0.1:{ports['peer']}"), "SERVING")
            ckptctl("status", "--daemon", d.socket)

    def test_peer_plane_needs_mutual_tls_off_loopback(self):
        def run(*args):
            return subprocess.run([CKPTD, "--root", self.root, *args, "--print-config"],
                                  capture_output=True, text=True, timeout=30)
        r = run("--peer-listen", "10.0.0.1:7071")
        self.assertEqual(r.returncode, 1)
        for word in ("is not a loopback address", "peer_tls_cert", "peer_insecure: true"):
            self.assertIn(word, r.stderr)
        r = run("--peer-listen", "10.0.0.1:7071", "--peer-insecure")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("peer_insecure: true", r.stdout)
        for loopback in ("127.0.0.1:7071", "127.1.2.3:7071", "localhost:7071", "[::1]:7071"):
            r = run("--peer-listen", loopback)
            self.assertEqual(r.returncode, 0, f"{loopback}: {r.stderr}")
        r = run("--peer-listen", "10.0.0.1:7071", "--peer-tls-cert", "/nonexistent.crt")
        self.assertEqual(r.returncode, 1)
        self.assertIn("needs all of 'peer_tls_cert', 'peer_tls_key' and 'peer_tls_ca'", r.stderr)
        r = run("--peer-listen", "127.0.0.1:7071", "--nccl-connect-timeout", "0s")
        self.assertEqual(r.returncode, 1)
        self.assertIn("'nccl_connect_timeout' must be positive", r.stderr)
        # --check-config reads the TLS files too.
        cfg = os.path.join(self.root, "tls.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots: [{self.root}]\npeer_listen: 10.0.0.1:7071\n"
                    "peer_tls_cert: /nonexistent/node.crt\npeer_tls_key: /nonexistent/node.key\n"
                    "peer_tls_ca: /nonexistent/ca.crt\n")
        r = subprocess.run([CKPTD, "--check-config", cfg], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("peer_tls_cert: cannot open /nonexistent/node.crt", r.stderr)
        # nccl_device: an ordinal; a bad one is named, a good one kept.
        for value, ok in (("-1", False), ("x", False), ("3", True)):
            with open(cfg, "w") as f:
                f.write(f"roots: [{self.root}]\nnccl_device: {value}\n")
            r = subprocess.run([CKPTD, "--config", cfg, "--print-config"], capture_output=True,
                               text=True, timeout=30)
            if ok:
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIn(f"nccl_device: {value}", r.stdout)
            else:
                self.assertEqual(r.returncode, 1, value)
                self.assertIn("nccl_device", r.stderr)
                self.assertIn("must be a CUDA device ordinal", r.stderr)

    # --- systemd readiness ------------------------------------------------------------

    def test_sd_notify_ready_and_stopping(self):
        tmp = tempfile.mkdtemp(prefix="ckptd-n-", dir="/tmp")
        notify = os.path.join(tmp, "notify")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(notify)
        sock.settimeout(20)
        env = dict(os.environ, NOTIFY_SOCKET=notify)
        api = os.path.join(tmp, "ckptd.sock")
        proc = subprocess.Popen([CKPTD, "--socket", api, "--root", self.root], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            msg = sock.recv(4096).decode()
            self.assertIn("READY=1", msg.split("\n"))
            self.assertIn(f"MAINPID={proc.pid}", msg.split("\n"))
            # Ready means serving: a client gets through at once.
            self.assertEqual(ckptctl("status", "--daemon", api).returncode, 0)
            proc.send_signal(signal.SIGTERM)
            msg = sock.recv(4096).decode()
            self.assertIn("STOPPING=1", msg.split("\n"))
            self.assertEqual(proc.wait(30), 0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            sock.close()
            shutil.rmtree(tmp, ignore_errors=True)

    def test_peer_port_health_not_serving_while_draining(self):
        cfg = os.path.join(self.root, "drain.yaml")
        with open(cfg, "w") as f:
            f.write(f"roots: [{self.root}]\ndrain_timeout: 6s\nbarrier_timeout: 60s\n")
        with testlib.Daemon(self.root, "--config", cfg, "--peer-listen", "127.0.0.1:0") as d:
            # The port file is written once every listener is up.
            port = d.ports()["peer"]
            self.assertEqual(grpc_health(f"127.0.0.1:{port}"), "SERVING")
            # Rank 0 of a 4-rank job waits at the barrier: a load in flight.
            waiter = subprocess.Popen(
                [CKPTCTL, "load", self.ckpt, "--layout", LAYOUT_TP4, "--out",
                 tempfile.mkdtemp(dir=self.out), "--daemon", d.socket, "--ranks", "0",
                 "--job-id", "draining"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_for("the waiting job", lambda: "draining" in ckptctl(
                    "status", "--daemon", d.socket).stdout, timeout=20)
                out = ckptctl("status", "--daemon", d.socket).stdout
                self.assertRegex(out, r"draining\s+waiting for ranks\s+1/4 \(world 4\)\s+1-3\s")
                d.proc.send_signal(signal.SIGTERM)
                wait_for("the peer port to stop serving",
                         lambda: grpc_health(f"127.0.0.1:{port}") != "SERVING", timeout=5)
            finally:
                waiter.kill()
                waiter.wait()

    # --- ckptctl status -----------------------------------------------------------------

    def test_status_is_a_short_table(self):
        with testlib.Daemon(self.root) as d:
            self.load(d)
            out = ckptctl("status", "--daemon", d.socket).stdout
            js = json.loads(ckptctl("status", "--daemon", d.socket, "--json").stdout)
        lines = out.splitlines()
        self.assertLessEqual(len(lines), 20, out)
        self.assertRegex(lines[0], r"^ckptd \S+ .*, up \d+s, roots: ")
        self.assertRegex(out, r"\n  memory +resident \d+\.\d MiB +cache \d+\.\d KiB of 4\.0 GiB \(0%\)")
        self.assertRegex(out, r"\n  cache +hits 0, misses \d+ +evictions 0 +hit rate 0%")
        self.assertRegex(out, r"\n  loads +4 started, 4 ok, 0 failed +read \d+\.\d KiB from storage")
        self.assertIn("\njobs: 0 (none waiting or running)\n", out)
        self.assertIn("\npeers: none (single node)\n", out)
        self.assertRegex(out, r"cached files: 2\n  BYTES +RANGES +FILE\n")
        self.assertGreater(js["resident_bytes"], 1 << 20)


def grpc_health(target):
    """grpc.health.v1.Health/Check for the server as a whole ("" service), by
    hand: the request is empty, the answer is field 1 (status) as a varint."""
    import grpc
    try:
        with grpc.insecure_channel(target) as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check",
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
            raw = check(b"", timeout=2)
    except grpc.RpcError as e:
        return f"error {e.code().name}"
    status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
    return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status)


if __name__ == "__main__":
    testlib.main("daemon_ops_test")
