"""Checkpoints in object storage through the real daemon and tools (issue 36):
a Ceph S3 gateway (tests/s3/rgw.sh), ckptd serving an s3:// root, the Python
client saving and loading resharded, ckptctl offline and online, the
gateway's request counts, changes behind the daemon's back, and refusals."""
import json
import os
import re
import subprocess
import tempfile
import time
import unittest
import urllib.request
import uuid

import numpy as np

import ckptd
import rgwlib
from rgwlib import split
from testlib import CKPTCTL, Daemon, main, read_safetensors, run_ranks

BUCKET = rgwlib.start()


class S3DaemonTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.prefix = f"daemon-{uuid.uuid4().hex[:8]}"
        cls.root = f"s3://{BUCKET}/{cls.prefix}"
        cls.daemon = Daemon(cls.root, "--metrics-address", "127.0.0.1:0")
        cls.sock = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        rc = cls.daemon.stop()
        assert rc == 0, f"ckptd exited {rc}: {cls.daemon.read_log()[-2000:]}"

    def s3(self):
        return ckptd.status(socket=self.sock)["object_storage"]

    def save(self, path, full, job, version=None):
        def one(r):
            off, shp = split(full.shape, 0, 2, r)
            part = full[off[0]:off[0] + shp[0]].copy()
            return ckptd.save_state_dict({"w": ckptd.ShardedTensor(part, full.shape, off),
                                          "step": np.array([7], np.int64)},
                                         path, rank=r, world_size=2, job_id=job,
                                         unique_id=version, socket=self.sock)
        return run_ranks(2, one)

    def load_by_columns(self, path, shape, job, **kw):
        outs = {}

        def one(r):
            off, shp = split(shape, 1, 2, r)
            buf = np.zeros(shp, np.float32)
            rep = ckptd.load_state_dict({"w": ckptd.ShardedTensor(buf, shape, off)}, path,
                                        rank=r, world_size=2, job_id=job, socket=self.sock,
                                        strict=False, **kw)
            outs[r] = buf
            return rep
        reps = run_ranks(2, one)
        return np.concatenate([outs[0], outs[1]], axis=1), reps

    def test_save_then_load_resharded_and_a_second_job_reads_nothing(self):
        path = f"{self.root}/run-a"
        full = (np.arange(256 * 192, dtype=np.float32).reshape(256, 192) / 3).astype(np.float32)
        reps = self.save(path, full, "s3-save-a")
        self.assertEqual(reps[0].unique_id, 0)
        code, body = rgwlib.request("GET", f"{self.prefix}/run-a/0.metadata")
        self.assertEqual(code, 200, "the metadata object is where the save said")
        self.assertEqual(json.loads(body)["format"], "ckptd.checkpoint")
        got, _ = self.load_by_columns(path, full.shape, "s3-load-a1")
        np.testing.assert_array_equal(got, full)
        before = self.s3()
        got, _ = self.load_by_columns(path, full.shape, "s3-load-a2")
        np.testing.assert_array_equal(got, full)
        after = self.s3()
        self.assertEqual(after["gets"], before["gets"], "a warm load read from the gateway")
        # Only the listing that stamps the prefix and no object bytes.
        self.assertLess(after["bytes_in"] - before["bytes_in"], 16384)
        self.assertGreater(before["gets"], 0)
        self.assertEqual(after["retries"], 0)
        self.assertEqual(after["credentials"], "environment")

    def test_a_cold_job_lists_the_checkpoint_once_and_heads_each_object_once(self):
        """The gateway's requests for one cold job (after an evict): one LIST (the
        prefix's stamp, whose names, sizes and ETags the opens reuse: the checkpoint's
        and the load's opens of its objects make no HEAD), a GET per planned read plus
        the metadata object and each data object's 64 KiB head, and one HEAD per data
        object, the check once the load is done (GETs are pinned to the ETag: no HEAD
        after each), plus the directory's (is the path an object?)."""
        path = f"{self.root}/run-count"
        full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        self.save(path, full, "s3-save-count")
        objects = [f for f in ckptd.inspect(path, socket=self.sock).files]
        ckptd.evict(path, socket=self.sock)
        time.sleep(0.6)  # past the 0.5 s a listing (the inspect's) is reused
        before = self.s3()
        got, _ = self.load_by_columns(path, full.shape, "s3-load-count")
        after = self.s3()
        np.testing.assert_array_equal(got, full)
        used = {k: after[k] - before[k] for k in ("lists", "heads", "gets")}
        planned = re.findall(r"load job=s3-load-count .* reads=(\d+)", self.daemon.read_log())
        self.assertTrue(planned, "the daemon logged the job's planned reads")
        self.assertEqual(used["lists"], 1, used)
        # (An open later than 0.5 s after the listing, on a busy machine, makes
        # its own HEAD.)
        self.assertGreaterEqual(used["heads"], 1 + len(objects), used)
        self.assertLessEqual(used["heads"], 1 + 2 * len(objects), used)
        self.assertEqual(used["gets"], int(planned[-1]) + 1 + len(objects), used)

    def test_a_new_version_and_a_replaced_object_are_seen(self):
        path = f"{self.root}/run-b"
        full = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
        self.save(path, full, "s3-save-b0")
        got, _ = self.load_by_columns(path, full.shape, "s3-load-b0")
        np.testing.assert_array_equal(got, full)
        self.save(path, full * 2, "s3-save-b1")  # version 1
        got, _ = self.load_by_columns(path, full.shape, "s3-load-b1")
        np.testing.assert_array_equal(got, full * 2)
        got, _ = self.load_by_columns(path, full.shape, "s3-load-b2", unique_id=0)
        np.testing.assert_array_equal(got, full)
        # A data object of version 1 removed behind the daemon's back: the next
        # load fails naming it, never succeeds with stale bytes.
        info = ckptd.inspect(path, socket=self.sock)
        files = sorted(f for f in info.files if f.startswith("1_") or f.startswith("0_"))
        victim = [f for f in files if f.endswith("_1.safetensors")][0]
        code, _ = rgwlib.request("DELETE", f"{self.prefix}/run-b/{victim}")
        self.assertIn(code, (200, 204))
        with self.assertRaises(Exception) as e:
            self.load_by_columns(path, full.shape, "s3-load-b3")
        self.assertIn(victim, str(e.exception))

    def test_an_asynchronous_save_persists_to_the_store(self):
        path = f"{self.root}/run-async"
        full = np.arange(32 * 16, dtype=np.float32).reshape(32, 16) - 100

        def one(r):
            off, shp = split(full.shape, 0, 2, r)
            part = full[off[0]:off[0] + shp[0]].copy()
            fut = ckptd.save_state_dict({"w": ckptd.ShardedTensor(part, full.shape, off)}, path,
                                        rank=r, world_size=2, job_id="s3-async",
                                        socket=self.sock, async_save=True)
            part[:] = 0  # the caller may change its tensors at once
            return fut.result(timeout=60)
        reps = run_ranks(2, one)
        self.assertTrue(all(rep.persisted for rep in reps))
        code, _ = rgwlib.request("HEAD", f"{self.prefix}/run-async/0.metadata")
        self.assertEqual(code, 200)
        got, _ = self.load_by_columns(path, full.shape, "s3-async-load")
        np.testing.assert_array_equal(got, full)

    def test_paths_outside_the_root_or_malformed_are_refused(self):
        for path, kind in [(f"s3://{BUCKET}/elsewhere/x", PermissionError),
                           (f"s3://{BUCKET}/{self.prefix}-sibling/x", PermissionError),
                           (f"{self.root}/../elsewhere", ValueError)]:
            with self.assertRaises(kind, msg=path) as e:
                ckptd.inspect(path, socket=self.sock)
            self.assertIn("s3://", str(e.exception))

    def test_ckptctl_offline_and_through_the_daemon(self):
        env = dict(os.environ)
        src = os.path.abspath("examples/tiny-model")
        layout = os.path.abspath("examples/layout-tp4-dim0.json")
        dst = f"{self.root}/tiny"
        out = subprocess.run([CKPTCTL, "convert", src, "--out", dst], env=env,
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        out = subprocess.run([CKPTCTL, "inspect", dst, "--json"], env=env, capture_output=True,
                             text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(json.loads(out.stdout)["format"], "ckptd")
        tmp = self.daemon.dir
        local = subprocess.run([CKPTCTL, "load", src, "--layout", layout, "--out",
                                f"{tmp}/local"], capture_output=True, text=True)
        self.assertEqual(local.returncode, 0, local.stderr)
        online = subprocess.run([CKPTCTL, "load", dst, "--layout", layout, "--out",
                                 f"{tmp}/online", "--daemon", self.sock],
                                capture_output=True, text=True)
        self.assertEqual(online.returncode, 0, online.stderr)
        for r in range(4):
            a = read_safetensors(f"{tmp}/local/rank{r}.safetensors")
            b = read_safetensors(f"{tmp}/online/rank{r}.safetensors")
            self.assertEqual(set(a), set(b))
            for k in a:
                np.testing.assert_array_equal(a[k][1], b[k][1], err_msg=f"rank {r} {k}")
        st = subprocess.run([CKPTCTL, "status", "--daemon", self.sock], capture_output=True,
                            text=True)
        self.assertIn(os.environ["AWS_ENDPOINT_URL"], st.stdout)
        self.assertRegex(st.stdout, r"s3 .* \d+ GETs")

    def test_a_two_node_job_reads_each_byte_from_the_store_once(self):
        # Two more daemons on the same root, peers over Unix sockets; the job's
        # 4 ranks are spread over them by ckptctl (2 each, a fresh job key).
        src = os.path.abspath("examples/tiny-model")
        layout = os.path.abspath("examples/layout-tp4-dim0.json")
        dst = f"{self.root}/tiny-2node"
        out = subprocess.run([CKPTCTL, "convert", src, "--out", dst], capture_output=True,
                             text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        base = tempfile.mkdtemp(prefix="ckptd-2n-", dir="/tmp")
        peers = [f"unix:{base}/p{i}" for i in range(2)]
        nodes = [Daemon(self.root, "--peer-listen", peers[i], "--peers", ",".join(peers),
                        "--io-request-size", "16KiB") for i in range(2)]
        try:
            before = [ckptd.status(socket=n.socket)["object_storage"] for n in nodes]
            tmp = self.daemon.dir
            r = subprocess.run([CKPTCTL, "load", dst, "--layout", layout, "--out",
                                f"{tmp}/two-node", "--daemon", f"{nodes[0].socket},{nodes[1].socket}"],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr + nodes[0].read_log()[-2000:])
            local = subprocess.run([CKPTCTL, "load", src, "--layout", layout, "--out",
                                    f"{tmp}/two-node-local"], capture_output=True, text=True)
            self.assertEqual(local.returncode, 0, local.stderr)
            for rank in range(4):
                a = read_safetensors(f"{tmp}/two-node-local/rank{rank}.safetensors")
                b = read_safetensors(f"{tmp}/two-node/rank{rank}.safetensors")
                for k in a:
                    np.testing.assert_array_equal(a[k][1], b[k][1], err_msg=f"rank {rank} {k}")
            after = [ckptd.status(socket=n.socket)["object_storage"] for n in nodes]
            gets = [after[i]["gets"] - before[i]["gets"] for i in range(2)]
            data = [after[i]["bytes_in"] - before[i]["bytes_in"] for i in range(2)]
            total = os.path.getsize(os.path.join(src, "model.safetensors"))
            # Both nodes read (the balancer spread the GETs), and together they
            # read the checkpoint once, plus on each node the metadata object,
            # listings and the data object's first 64 KiB (its header).
            self.assertTrue(all(g > 0 for g in gets), gets)
            self.assertLess(sum(data), total + 2 * (65536 + 16384), data)
            self.assertGreater(min(data), 0.2 * total, data)
        finally:
            for n in nodes:
                n.stop()

    def test_a_root_with_its_own_credentials(self):
        # Bucket 2 belongs to the gateway's second user: the default
        # credentials (the first user's, from the environment) may not touch
        # it; the root's own profile, from a credentials file, may.
        bucket2 = os.environ["CKPTD_TEST_S3_BUCKET2"]
        base = tempfile.mkdtemp(prefix="ckptd-cred-", dir="/tmp")
        with open(f"{base}/credentials", "w") as f:
            f.write(f"[second]\naws_access_key_id = {os.environ['CKPTD_TEST_S3_ACCESS2']}\n"
                    f"aws_secret_access_key = {os.environ['CKPTD_TEST_S3_SECRET2']}\n")
        root2 = f"s3://{bucket2}/{self.prefix}"
        with open(f"{base}/ckptd.yaml", "w") as f:
            f.write(f"roots: [{self.root}, {root2}]\n"
                    f"s3: {{roots: [{{root: {root2}, profile: second}}]}}\n")
        full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = f"{base}/credentials"
        try:
            d = Daemon(self.root, "--config", f"{base}/ckptd.yaml", "--root", f"{self.root},{root2}")
            plain = Daemon(self.root, "--root", f"{self.root},{root2}")
        finally:
            del os.environ["AWS_SHARED_CREDENTIALS_FILE"]
        try:
            sd = {"w": ckptd.ShardedTensor(full, full.shape, (0, 0))}
            ckptd.save_state_dict(sd, f"{root2}/own", rank=0, world_size=1, job_id="own-save",
                                  socket=d.socket)
            out = np.zeros_like(full)
            ckptd.load_state_dict({"w": out}, f"{root2}/own", rank=0, world_size=1,
                                  job_id="own-load", socket=d.socket)
            np.testing.assert_array_equal(out, full)
            self.assertIn(f"credentials from {base}/credentials [second]", d.read_log())
            # The first root still uses the environment's keys on the same daemon.
            ckptd.save_state_dict(sd, f"{self.root}/own-default", rank=0, world_size=1,
                                  job_id="own-save-default", socket=d.socket)
            # Without the root's own profile: the gateway refuses, and the save
            # says so naming the object.
            with self.assertRaises(PermissionError) as e:
                ckptd.save_state_dict(sd, f"{root2}/refused", rank=0, world_size=1,
                                      job_id="refused-save", socket=plain.socket)
            self.assertIn(f"s3://{bucket2}/", str(e.exception))
            self.assertIn("403", str(e.exception))
        finally:
            d.stop()
            plain.stop()

    def test_bad_s3_settings_are_refused_naming_the_key(self):
        from testlib import CKPTD
        base = tempfile.mkdtemp(prefix="ckptd-cfg-", dir="/tmp")
        cases = {
            "s3: {colour: blue}": "s3.colour",
            "s3: {part_size: 1MiB}": "s3.part_size",
            "s3: {endpoint: 'ftp://x'}": "s3.endpoint",
            "s3: {max_attempts: 0}": "s3.max_attempts",
            "s3: {stall_timeout: 2h}": "s3.stall_timeout",
            "s3: {max_requests: -1}": "s3.max_requests",
            "s3: {max_requests: 5000}": "s3.max_requests",
            "s3: {roots: [{root: 's3://b/x', max_requests: 2}]}": "s3.roots.max_requests",
            "s3: {roots: [{root: 's3://nowhere/x', profile: p}]}": "names no configured root",
            "s3: {roots: [{root: '/data', profile: p}]}": "s3.roots.root",
            "s3: {roots: [{root: 's3://b/x', part_size: 8MiB}]}": "s3.roots.part_size",
            "roots: ['s3:///nobucket']": "names no bucket",
        }
        for i, (yaml, want) in enumerate(cases.items()):
            cfg = f"{base}/c{i}.yaml"
            with open(cfg, "w") as f:
                f.write(yaml + "\n" + ("" if yaml.startswith("roots") else "roots: ['s3://b/x']\n"))
            r = subprocess.run([CKPTD, "--check-config", cfg], capture_output=True, text=True)
            self.assertNotEqual(r.returncode, 0, yaml)
            self.assertIn(want, r.stderr, yaml)
        # What --print-config prints is a valid config that prints the same.
        cfg = f"{base}/ok.yaml"
        with open(cfg, "w") as f:
            f.write("roots: ['s3://b/x', 's3://c/y']\n"
                    "s3: {max_bandwidth: 100MiB, max_requests: 3,\n"
                    "     roots: [{root: 's3://c/y', profile: other}]}\n")
        once = subprocess.run([CKPTD, "--config", cfg, "--print-config"], capture_output=True,
                              text=True)
        self.assertEqual(once.returncode, 0, once.stderr)
        with open(f"{base}/printed.yaml", "w") as f:
            f.write(once.stdout)
        twice = subprocess.run([CKPTD, "--config", f"{base}/printed.yaml", "--print-config"],
                               capture_output=True, text=True)
        self.assertEqual(twice.returncode, 0, twice.stderr)
        self.assertEqual(once.stdout, twice.stdout)
        self.assertIn("profile: other", once.stdout)
        self.assertIn("max_requests: 3", once.stdout)

    def test_pytorch_dcp_saves_into_s3_and_loads_through_the_daemon_storage_classes(self):
        import torch
        from ckptd.dcp import DaemonStorageReader, DaemonStorageWriter  # installs the 1.13 patch
        import torch.distributed._shard.checkpoint as dcp
        path = f"{self.root}/dcp"
        sd = {"w": torch.arange(96, dtype=torch.float32).reshape(12, 8) / 5,
              "b": torch.arange(5, dtype=torch.int64),
              "extra": {"lr": 0.25, "note": "a bytes item"}}
        dcp.save_state_dict(sd, storage_writer=DaemonStorageWriter(path, socket=self.sock),
                            no_dist=True)
        code, _ = rgwlib.request("HEAD", f"{self.prefix}/dcp/.metadata")
        self.assertEqual(code, 200, "DCP's .metadata object is in the store")
        self.assertEqual(ckptd.inspect(path, socket=self.sock).format, "pytorch-dcp")
        # The daemon reads the DCP checkpoint from the store.
        out = {"w": torch.full((12, 8), float("nan")), "b": torch.full((5,), -1, dtype=torch.int64)}
        ckptd.load_state_dict(out, path, rank=0, world_size=1, job_id="dcp-s3-load",
                              socket=self.sock)
        self.assertTrue(torch.equal(out["w"], sd["w"]))
        self.assertTrue(torch.equal(out["b"], sd["b"]))
        # DaemonStorageReader: DCP's .metadata and the bytes item read through the
        # daemon (the client holds no credentials), tensors loaded by it.
        out = {"w": torch.full((12, 8), float("nan")), "b": torch.full((5,), -1, dtype=torch.int64),
               "extra": {}}
        dcp.load_state_dict(out, storage_reader=DaemonStorageReader(path, socket=self.sock),
                            no_dist=True)
        self.assertTrue(torch.equal(out["w"], sd["w"]))
        self.assertTrue(torch.equal(out["b"], sd["b"]))
        self.assertEqual(out["extra"], sd["extra"])

    def test_metrics_count_the_gateway_requests(self):
        port = self.daemon.ports()["metrics"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for op in ("HEAD", "GET", "LIST", "PUT", "DELETE"):
            self.assertIn(f'ckptd_s3_requests_total{{op="{op}"}}', text)
        self.assertIn('ckptd_s3_bytes_total{direction="in"}', text)
        self.assertIn("ckptd_s3_request_wait_seconds_total 0", text)  # max_requests unset: no wait


if __name__ == "__main__":
    main("s3_daemon_test")
