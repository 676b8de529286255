"""Checks the Kubernetes manifests in deploy/k8s/ (no cluster here): they
parse, carry the fields Kubernetes requires and the ones ckptd relies on, and
the ckptd configuration inside them is accepted by the real daemon, alone
(`ckptd --check-config`) and together with the flags the pods pass
(`ckptd ... --print-config`)."""
import glob
import json
import os
import re
import subprocess
import tempfile
import unittest

import yaml

import testlib

K8S = os.path.abspath(os.environ.get("K8S_DIR", "deploy/k8s"))
CKPTD = os.path.abspath(testlib.CKPTD)

# Container fields Kubernetes knows (core/v1 Container): a misspelt key
# ("readinesProbe") would be silently dropped by a lenient client.
CONTAINER_KEYS = {
    "name", "image", "imagePullPolicy", "command", "args", "workingDir", "ports", "env",
    "envFrom", "resources", "volumeMounts", "volumeDevices", "livenessProbe", "readinessProbe",
    "startupProbe", "lifecycle", "securityContext", "restartPolicy", "stdin", "tty",
    "terminationMessagePath", "terminationMessagePolicy", "resizePolicy",
}
POD_SPEC_KEYS = {
    "containers", "initContainers", "volumes", "restartPolicy", "terminationGracePeriodSeconds",
    "securityContext", "nodeSelector", "tolerations", "affinity", "priorityClassName",
    "serviceAccountName", "hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace",
    "dnsPolicy", "imagePullSecrets", "runtimeClassName", "topologySpreadConstraints",
}


def load_docs(name):
    with open(os.path.join(K8S, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def all_docs():
    out = {}
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        for d in load_docs(os.path.basename(path)):
            out[(d["kind"], d.get("metadata", {}).get("name"))] = (os.path.basename(path), d)
    return out


def run_ckptd(*args):
    return subprocess.run([CKPTD, *args], capture_output=True, text=True, timeout=60)


def write_tmp(text, name="ckptd.yaml"):
    d = tempfile.mkdtemp(prefix="k8s-", dir=os.environ.get("TEST_TMPDIR"))
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(text)
    return p


def write_checkable(text):
    """write_tmp for --check-config, which requires the roots to exist: the
    node's volume /data/checkpoints moves beneath the temporary directory."""
    p = write_tmp(text)
    root = os.path.join(os.path.dirname(p), "data", "checkpoints")
    os.makedirs(root)
    with open(p, "w") as f:
        f.write(text.replace("/data/checkpoints", root))
    return p


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(text))
    assert m, text
    units = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
             "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12}
    return float(m.group(1)) * units[m.group(2)]


def parse_seconds(text):
    m = re.fullmatch(r"([0-9.]+)(ms|s|m|h)?", str(text))
    assert m, text
    return float(m.group(1)) * {None: 1, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def effective_config(config_text, container, pod_ip="10.1.2.3"):
    """The config the container's ckptd runs with: its args, with the
    ConfigMap written to a temporary file and $(POD_IP) filled in."""
    path = write_tmp(config_text)
    args = []
    for a in container.get("args", []):
        a = a.replace("$(POD_IP)", pod_ip)
        if a.startswith("--config="):
            a = "--config=" + path
        args.append(a)
    r = run_ckptd(*args, "--print-config")
    assert r.returncode == 0, f"ckptd {args} --print-config: {r.stderr}"
    return yaml.safe_load(r.stdout)


def mounts(container):
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


class ManifestsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docs = all_docs()

    def doc(self, kind, name):
        self.assertIn((kind, name), self.docs, f"no {kind} {name} in {K8S}")
        return self.docs[(kind, name)][1]

    def test_every_document_parses_with_required_fields(self):
        self.assertGreaterEqual(len(self.docs), 6)
        for (kind, name), (f, d) in self.docs.items():
            with self.subTest(file=f, kind=kind):
                self.assertTrue(d.get("apiVersion"), f)
                if kind != "Kustomization":
                    self.assertTrue(name, f"{f}: {kind} without metadata.name")
                    self.assertRegex(name, r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
                for c in self.containers(d):
                    self.assertLessEqual(set(c), CONTAINER_KEYS, f"{f}: unknown container keys")
                    self.assertTrue(c.get("name") and c.get("image"), f"{f}: container name/image")
                spec = self.pod_spec(d)
                if spec is not None:
                    self.assertLessEqual(set(spec), POD_SPEC_KEYS, f"{f}: unknown pod spec keys")
                    volumes = {v["name"] for v in spec.get("volumes", [])}
                    for c in self.containers(d):
                        for m in c.get("volumeMounts", []):
                            self.assertIn(m["name"], volumes, f"{f}: {c['name']} mounts {m['name']}")

    @staticmethod
    def pod_spec(d):
        if d["kind"] == "Pod":
            return d["spec"]
        if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            return d["spec"]["template"]["spec"]
        return None

    @classmethod
    def containers(cls, d):
        spec = cls.pod_spec(d)
        if spec is None:
            return []
        return spec.get("initContainers", []) + spec.get("containers", [])

    def test_kustomization_lists_existing_files(self):
        k = load_docs("kustomization.yaml")[0]
        for r in k["resources"]:
            self.assertTrue(os.path.exists(os.path.join(K8S, r)), r)
        self.assertNotIn("sidecar-pod.yaml", k["resources"])

    def test_configmap_config_passes_check_config(self):
        cm = self.doc("ConfigMap", "ckptd-config")
        path = write_checkable(cm["data"]["ckptd.yaml"])
        r = run_ckptd("--check-config", path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(": OK", r.stdout)
        # The check is not vacuous: a broken copy is refused, naming the key.
        bad = write_checkable(cm["data"]["ckptd.yaml"] + "log_format: xml\n")
        r = run_ckptd("--check-config", bad)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("log_format", r.stderr)

    def test_memory_budgets_fit_each_container_limit(self):
        """issue 21 "Operations": ckptd refuses to start when the budgets it was
        given exceed its memory limit. Each shipped config, checked against its
        own container's limit, passes with every budget as written (no default
        had to shrink); the DaemonSet's with arena_limit back at its old 64 GiB
        default set explicitly is refused naming it."""
        ds = self.doc("DaemonSet", "ckptd")
        (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "ckptd"]
        cm = self.doc("ConfigMap", "ckptd-config")["data"]["ckptd.yaml"]
        side = {d["kind"]: d for d in load_docs("sidecar-pod.yaml")}
        spec = side["Pod"]["spec"]
        (sc,) = [x for x in spec.get("initContainers", []) + spec["containers"]
                 if x["name"] == "ckptd"]
        for what, text, container in (("DaemonSet", cm, c),
                                      ("sidecar", side["ConfigMap"]["data"]["ckptd.yaml"], sc)):
            limit = int(parse_bytes(container["resources"]["limits"]["memory"]))
            path = write_checkable(text + f"memory_limit: {limit}\n")
            r = run_ckptd("--check-config", path)
            self.assertEqual(r.returncode, 0, f"{what}: {r.stderr}")
            self.assertNotIn("not set:", r.stdout, f"{what}: a budget had to shrink: {r.stdout}")
        big = write_checkable(cm.replace("arena_limit: 4GiB", "arena_limit: 64GiB") +
                              f"memory_limit: {int(parse_bytes(c['resources']['limits']['memory']))}\n")
        r = run_ckptd("--check-config", big)
        self.assertEqual(r.returncode, 1)
        self.assertIn("arena_limit 64 GiB (set)", r.stderr)
        self.assertIn("> 24 GiB (memory_limit)", r.stderr)

    def test_daemonset(self):
        ds = self.doc("DaemonSet", "ckptd")
        self.assertEqual(ds["apiVersion"], "apps/v1")
        tmpl = ds["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        self.assertLessEqual(ds["spec"]["selector"]["matchLabels"].items(), labels.items())
        spec = tmpl["spec"]
        (c,) = [c for c in spec["containers"] if c["name"] == "ckptd"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        m = mounts(c)

        # The config comes from the ConfigMap, mounted where --config points.
        cfg_arg = [a for a in c["args"] if a.startswith("--config=")]
        self.assertEqual(len(cfg_arg), 1)
        cfg_path = cfg_arg[0].split("=", 1)[1]
        cfg_mount = m[os.path.dirname(cfg_path)]
        self.assertEqual(volumes[cfg_mount["name"]]["configMap"]["name"], "ckptd-config")
        cm = self.doc("ConfigMap", "ckptd-config")
        self.assertIn(os.path.basename(cfg_path), cm["data"])
        self.assertEqual(cm["metadata"]["namespace"], ds["metadata"]["namespace"])

        # The effective configuration: ConfigMap + the pod's flags.
        eff = effective_config(cm["data"]["ckptd.yaml"], c)
        env = {e["name"]: e for e in c.get("env", [])}
        self.assertEqual(env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP")
        self.assertEqual(eff["peer_listen"], "10.1.2.3:7071")
        peer_port = int(eff["peer_listen"].rsplit(":", 1)[1])

        # hostPath volumes: the socket directory, /dev/shm and every root.
        def host_path_of(mount_path):
            self.assertIn(mount_path, m, f"nothing mounted at {mount_path}")
            v = volumes[m[mount_path]["name"]]
            self.assertIn("hostPath", v, f"{mount_path} is not a hostPath")
            return v["hostPath"]["path"]

        sock_dir = os.path.dirname(eff["socket"])
        self.assertEqual(host_path_of(sock_dir), sock_dir)
        self.assertEqual(host_path_of("/dev/shm"), "/dev/shm")
        for root in eff["roots"]:
            self.assertTrue(host_path_of(root))
        self.assertTrue(m[eff["roots"][0]].get("readOnly"), "roots are read-only by default")
        # Something gives ckptd's user the host socket directory.
        init = {i["name"]: i for i in spec.get("initContainers", [])}
        self.assertIn("chown", " ".join(init["socket-dir"]["command"]))
        self.assertIn(sock_dir, mounts(init["socket-dir"]))

        # Probes: `ckptctl status` on the daemon's socket. Not the peer port:
        # it demands a client certificate, which the kubelet cannot present.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        self.assertEqual(ports["peer"], peer_port)
        for probe in ("readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            self.assertEqual(command[:2], ["/usr/bin/ckptctl", "status"], probe)
            self.assertIn(eff["socket"], command, probe)

        # Metrics: on, on the port Prometheus is told to scrape.
        metrics_port = int(eff["metrics_address"].rsplit(":", 1)[1])
        self.assertEqual(ports["metrics"], metrics_port)
        ann = tmpl["metadata"]["annotations"]
        self.assertEqual(ann["prometheus.io/scrape"], "true")
        self.assertEqual(int(ann["prometheus.io/port"]), metrics_port)
        self.assertEqual(eff["log_format"], "json")

        # Resources: requests and a memory limit above the cache budget.
        res = c["resources"]
        self.assertIn("cpu", res["requests"])
        self.assertIn("memory", res["requests"])
        self.assertGreater(parse_bytes(res["limits"]["memory"]), eff["cache_budget"])
        self.assertGreaterEqual(parse_bytes(res["requests"]["memory"]), eff["cache_budget"])
        # SIGTERM drains loads for drain_timeout: the grace period must cover it.
        self.assertGreater(spec["terminationGracePeriodSeconds"],
                           parse_seconds(eff["drain_timeout"]))
        self.assertFalse(c["securityContext"]["allowPrivilegeEscalation"])

    def test_peer_tls_from_secret(self):
        ds = self.doc("DaemonSet", "ckptd")
        spec = ds["spec"]["template"]["spec"]
        (c,) = [c for c in spec["containers"] if c["name"] == "ckptd"]
        eff = effective_config(self.doc("ConfigMap", "ckptd-config")["data"]["ckptd.yaml"], c)
        # Mutual TLS on the peer plane, not the plaintext escape hatch.
        self.assertFalse(eff["peer_insecure"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        secrets = set()
        for key, item in (("peer_tls_cert", "tls.crt"), ("peer_tls_key", "tls.key"),
                          ("peer_tls_ca", "ca.crt")):
            path = eff[key]
            self.assertTrue(path, key)
            self.assertEqual(os.path.basename(path), item, key)
            # The file comes from a Secret volume mounted whole (a subPath
            # mount would never see a renewed certificate).
            m = mounts(c).get(os.path.dirname(path))
            self.assertTrue(m, f"{key}: nothing mounted at {os.path.dirname(path)}")
            self.assertNotIn("subPath", m)
            self.assertTrue(m.get("readOnly"))
            secrets.add(volumes[m["name"]]["secret"]["secretName"])
        self.assertEqual(len(secrets), 1)
        (secret,) = secrets
        # The cert-manager example issues that Secret for the peer_dns name,
        # for server and client use; it stays out of the kustomization.
        if os.path.exists(os.path.join(K8S, "peer-certificate.yaml")):
            cert = self.doc("Certificate", secret)
            self.assertEqual(cert["apiVersion"], "cert-manager.io/v1")
            self.assertEqual(cert["metadata"]["namespace"], ds["metadata"]["namespace"])
            self.assertEqual(cert["spec"]["secretName"], secret)
            self.assertIn(eff["peer_dns"].rsplit(":", 1)[0], cert["spec"]["dnsNames"])
            self.assertLessEqual({"server auth", "client auth"}, set(cert["spec"]["usages"]))
            issuer = cert["spec"]["issuerRef"]
            self.doc(issuer.get("kind", "Issuer"), issuer["name"])
            k = load_docs("kustomization.yaml")[0]
            self.assertNotIn("peer-certificate.yaml", k["resources"])

    def test_headless_service_matches_peer_dns(self):
        ds = self.doc("DaemonSet", "ckptd")
        svc = self.doc("Service", "ckptd-peers")
        self.assertEqual(svc["spec"]["clusterIP"], "None")
        self.assertFalse(svc["spec"].get("publishNotReadyAddresses", False))
        labels = ds["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(svc["spec"]["selector"].items(), labels.items())
        (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "ckptd"]
        eff = effective_config(self.doc("ConfigMap", "ckptd-config")["data"]["ckptd.yaml"], c)
        host, port = eff["peer_dns"].rsplit(":", 1)
        self.assertEqual(host.split(".")[:2],
                         [svc["metadata"]["name"], svc["metadata"]["namespace"]])
        svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
        self.assertEqual(svc_ports["peer"]["port"], int(port))
        container_ports = {p["name"] for p in c["ports"]}
        for p in svc_ports.values():
            self.assertIn(p["targetPort"], container_ports)

    def test_gpu_overlay_patches_the_daemonset(self):
        """deploy/k8s/gpu: the base plus the CUDA image and the node's GPUs seen
        through the NVIDIA runtime, without claiming any nvidia.com/gpu."""
        gpu = os.path.join(K8S, "gpu")
        with open(os.path.join(gpu, "kustomization.yaml")) as f:
            k = yaml.safe_load(f)
        self.assertEqual(k["resources"], ["../"])
        for p in k["patches"]:
            self.assertTrue(os.path.exists(os.path.join(gpu, p["path"])), p["path"])
        base = self.doc("DaemonSet", "ckptd")
        (img,) = k["images"]
        self.assertEqual(base["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0],
                         img["name"])
        self.assertTrue(img["newTag"].endswith("-cuda"))
        with open(os.path.join(gpu, "daemonset-gpu.yaml")) as f:
            patch = yaml.safe_load(f)
        self.assertEqual((patch["kind"], patch["metadata"]["name"], patch["metadata"]["namespace"]),
                         ("DaemonSet", base["metadata"]["name"], base["metadata"]["namespace"]))
        spec = patch["spec"]["template"]["spec"]
        self.assertEqual(spec["runtimeClassName"], "nvidia")
        self.assertIs(spec["hostIPC"], True)  # CUDA IPC needs one IPC namespace
        (c,) = spec["containers"]
        self.assertIn(c["name"], [x["name"] for x in base["spec"]["template"]["spec"]["containers"]])
        env = {e["name"]: e["value"] for e in c["env"]}
        self.assertEqual(env["NVIDIA_VISIBLE_DEVICES"], "all")
        self.assertIn("compute", env["NVIDIA_DRIVER_CAPABILITIES"])
        self.assertNotIn("nvidia.com/gpu", json.dumps(c.get("resources", {})))

    def test_sidecar_pod_shares_socket_and_shm(self):
        docs = {d["kind"]: d for d in load_docs("sidecar-pod.yaml")}
        pod, cm = docs["Pod"], docs["ConfigMap"]
        path = write_checkable(cm["data"]["ckptd.yaml"])
        r = run_ckptd("--check-config", path)
        self.assertEqual(r.returncode, 0, r.stderr)
        spec = pod["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        all_containers = spec.get("initContainers", []) + spec["containers"]
        (ckptd,) = [c for c in all_containers if c["name"] == "ckptd"]
        trainers = [c for c in spec["containers"] if c["name"] != "ckptd"]
        self.assertTrue(trainers)
        # process_memory (docs/grpc-api.md, "Transports"): one PID namespace, one uid.
        self.assertIs(spec.get("shareProcessNamespace"), True)
        pod_uid = spec.get("securityContext", {}).get("runAsUser")
        uids = {c.get("securityContext", {}).get("runAsUser", pod_uid) for c in [ckptd] + trainers}
        self.assertEqual(len(uids), 1, uids)
        self.assertIsNotNone(pod_uid)
        if ckptd in spec.get("initContainers", []):
            self.assertEqual(ckptd.get("restartPolicy"), "Always", "native sidecar")
        eff = effective_config(cm["data"]["ckptd.yaml"], ckptd)
        sock_dir = os.path.dirname(eff["socket"])
        for t in trainers:
            for where in (sock_dir, "/dev/shm"):
                a, b = mounts(ckptd).get(where), mounts(t).get(where)
                self.assertTrue(a and b, f"{where} not mounted in both containers")
                self.assertEqual(a["name"], b["name"])
                self.assertIn("emptyDir", volumes[a["name"]])
            self.assertEqual(volumes[mounts(t)["/dev/shm"]["name"]]["emptyDir"].get("medium"),
                             "Memory")
            for root in eff["roots"]:
                self.assertEqual(mounts(t)[root]["name"], mounts(ckptd)[root]["name"])
            env = {e["name"]: e.get("value") for e in t.get("env", [])}
            self.assertEqual(env["CKPTD_SOCKET"], eff["socket"])
        # The probe asks the daemon itself over the socket.
        probe = ckptd["startupProbe"]["exec"]["command"]
        self.assertEqual(probe[:2], ["/usr/bin/ckptctl", "status"])
        self.assertIn(eff["socket"], probe)
        self.assertGreater(parse_bytes(ckptd["resources"]["limits"]["memory"]),
                           eff["cache_budget"])
        self.assertGreater(spec["terminationGracePeriodSeconds"],
                           parse_seconds(eff["drain_timeout"]))


if __name__ == "__main__":
    testlib.main("k8s_manifests_test")
