"""Checks deploy/Containerfile without a container engine (none here): its
stages use Debian bookworm and deploy/install-deps.sh, the runtime stage's
packages (install-deps.sh --runtime) provide every shared library the built
ckptd and ckptctl load (ldd + dpkg + apt-cache, all local), and the image
agrees with the DaemonSet (user, ports, config path)."""
import os
import re
import subprocess
import unittest

import yaml

import testlib

CONTAINERFILE = os.path.abspath("deploy/Containerfile")
INSTALL_DEPS = os.path.abspath(os.environ.get("INSTALL_DEPS", "deploy/install-deps.sh"))
DAEMONSET = os.path.abspath("deploy/k8s/daemonset.yaml")
BINARIES = [os.path.abspath(testlib.CKPTD), os.path.abspath(testlib.CKPTCTL)]


def sh(*args):
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout


def instructions():
    """(INSTRUCTION, argument) pairs, continuation lines joined."""
    with open(CONTAINERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def owners(libs):
    """lib -> the Debian package holding it (merged /usr: both spellings tried),
    with one dpkg -S call."""
    spellings = {}
    for lib in libs:
        real = os.path.realpath(lib)
        spellings[lib] = list(dict.fromkeys(
            [lib, real, "/usr" + lib, real.replace("/usr/lib/", "/lib/", 1)]))
    every = sorted({p for v in spellings.values() for p in v})
    r = subprocess.run(["dpkg", "-S", *every], capture_output=True, text=True)
    by_path = {}
    for line in r.stdout.splitlines():
        pkgs, _, path = line.partition(": ")
        by_path[path.strip()] = pkgs.split(",")[0].split(":")[0].strip()
    return {lib: next((by_path[p] for p in v if p in by_path), None)
            for lib, v in spellings.items()}


class ContainerfileTest(unittest.TestCase):
    def test_stages_use_bookworm_and_install_deps(self):
        ins = instructions()
        froms = [a for i, a in ins if i == "FROM"]
        self.assertEqual(len(froms), 2)
        for f in froms:
            self.assertRegex(f, r"^debian:bookworm(-slim)?\b")
        runs = " ".join(a for i, a in ins if i == "RUN")
        self.assertIn("deploy/install-deps.sh --build", runs)
        self.assertIn("install-deps.sh --runtime", runs)
        self.assertIn("bazel build //server:ckptd //client:ckptctl", runs)
        copies = [a for i, a in ins if i == "COPY"]
        self.assertIn("deploy/install-deps.sh /tmp/install-deps.sh", copies)
        self.assertEqual(dict(ins)["ENTRYPOINT"], '["/usr/bin/ckptd"]')
        self.assertEqual(dict(ins)["CMD"], '["--config", "/etc/ckptd/ckptd.yaml"]')
        self.assertIn("config/ckptd.yaml /out/etc/ckptd/ckptd.yaml", runs)

    def test_image_matches_daemonset(self):
        ins = dict(instructions())
        with open(DAEMONSET) as f:
            ds = yaml.safe_load(f)
        spec = ds["spec"]["template"]["spec"]
        uid = spec["securityContext"]["runAsUser"]
        self.assertEqual(ins["USER"], f"{uid}:{spec['securityContext']['runAsGroup']}")
        runs = " ".join(a for i, a in instructions() if i == "RUN")
        self.assertIn(f"--uid {uid}", runs)
        (c,) = [c for c in spec["containers"] if c["name"] == "ckptd"]
        exposed = {int(p) for p in ins["EXPOSE"].split()}
        self.assertEqual(exposed, {p["containerPort"] for p in c["ports"]})

    def test_runtime_packages_cover_the_binaries(self):
        runtime = sh("bash", INSTALL_DEPS, "--print", "--runtime").split()
        self.assertTrue(runtime)
        for p in runtime:  # names exist in this Debian release
            self.assertEqual(subprocess.run(["apt-cache", "show", p], capture_output=True).returncode,
                             0, f"{p} is not a Debian package here")
        # Everything apt installs with them (dependencies, recursively).
        tree = sh("apt-cache", "depends", "--recurse", "--important", *runtime)
        closure = {line.strip() for line in tree.splitlines() if not line.startswith(" ")}
        closure |= set(runtime)
        for binary in BINARIES:
            libs = re.findall(r"=> (\S+) \(", sh("ldd", binary))
            self.assertTrue(libs, binary)
            for lib, pkg in owners(libs).items():
                self.assertIsNotNone(pkg, f"{binary}: {lib} belongs to no package")
                self.assertTrue(pkg in closure,
                              f"{os.path.basename(binary)} loads {lib} from {pkg}, which "
                              f"install-deps.sh --runtime does not install")


class CudaContainerfileTest(unittest.TestCase):
    """deploy/Containerfile.cuda: the CPU image's stages plus the CUDA toolkit
    from NVIDIA's devel image; cudart static, NCCL named for dlopen."""

    def test_cuda_image(self):
        with open(CONTAINERFILE + ".cuda") as f:
            text = re.sub(r"\\\n", " ", f.read())
        lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]
        froms = [l.split()[1] for l in lines if l.upper().startswith("FROM ")]
        self.assertEqual(froms, ["${CUDA_IMAGE}", "debian:bookworm", "debian:bookworm-slim"])
        self.assertIn("bazel build --config=cuda //server:ckptd //client:ckptctl", text)
        self.assertIn("COPY --from=cuda /usr/local/cuda /usr/local/cuda", text)
        self.assertIn("install-deps.sh --runtime", text)
        self.assertIn("CKPTD_NCCL_LIBRARY=/usr/lib/ckptd/libnccl.so.2", text)
        self.assertIn("/out/usr/lib/ckptd/libnccl.so.2", text)
        self.assertIn("NVIDIA_DRIVER_CAPABILITIES=compute,utility", text)
        # Same user, entrypoint and config as the CPU image (and the DaemonSet).
        cpu = dict(instructions())
        for word in ("USER", "ENTRYPOINT", "CMD", "EXPOSE"):
            self.assertIn(f"{word} {cpu[word]}", lines)


if __name__ == "__main__":
    testlib.main("container_test")
