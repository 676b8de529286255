"""The Python client as a distribution (client/python/pyproject.toml +
setup.py; docs/python-install.md): pip-installed into a fresh venv with
Debian's packages only and nothing downloaded (--no-index), then imported
from another directory with no PYTHONPATH, and a checkpoint loaded through a
real ckptd with it. Also `pip wheel`: the wheel carries the generated stubs
and the version of VERSION.

The build works on a copy of what it reads from the source tree
(client/python, proto/ckpt.proto, VERSION), laid out as in the tree."""
import json
import os
import shutil
import subprocess
import sysconfig
import unittest
import zipfile

import numpy as np

import testlib

from ckptd import _version  # the source tree's (PYTHONPATH): reads VERSION

PY = "/usr/bin/python3"
# The platform tag of a wheel with the native library (bdist_wheel's spelling).
PLATFORM = sysconfig.get_platform().replace("-", "_").replace(".", "_")
VERSION, API_LEVEL = _version.read_version_file(testlib.runfile("VERSION"))
EXAMPLE = testlib.runfile("examples/tiny-model")


def _missing_packaging():
    """The modules /usr/bin/python3 lacks to make a venv and build wheels."""
    r = subprocess.run([PY, "-c", "import importlib.util as u; print(' '.join(m for m in "
                        "('ensurepip', 'pip', 'setuptools', 'wheel') if u.find_spec(m) is None))"],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


MISSING = _missing_packaging()


def source_copy(dest):
    """client/python, proto/ckpt.proto and VERSION from the runfiles into
    dest/ (real files, same layout); returns dest/client/python."""
    pkg = os.path.join(dest, "client", "python")
    os.makedirs(os.path.join(pkg, "ckptd"))
    os.makedirs(os.path.join(dest, "proto"))
    for rel in ("VERSION", "proto/ckpt.proto", "client/python/pyproject.toml",
                "client/python/setup.py"):
        shutil.copy(testlib.runfile(rel), os.path.join(dest, rel))
    src = testlib.runfile("client/python/ckptd")
    for f in sorted(os.listdir(src)):
        if f.endswith((".py", ".c")) and not f.startswith("ckpt_pb2"):
            shutil.copy(os.path.join(src, f), os.path.join(pkg, "ckptd", f))
    return pkg


def clean_env(home):
    """The environment of pip and of the installed package: no PYTHONPATH,
    no stub directory, no pip configuration or wheel directories from the
    machine, no index (nothing may be downloaded)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "CKPTD_"))}
    env.update(HOME=home, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_NO_INPUT="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300, **kw)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-6000:]}")
    return r.stdout


# Runs in the venv, in an empty directory: imports the installed ckptd and
# loads the checkpoint at argv[2] through the daemon at argv[1] into zeroed
# arrays of the shapes in argv[3]; writes the arrays (argv[4]) and what it
# found out (stdout, JSON).
LOAD_SCRIPT = r"""
import json, os, sys
import numpy as np
import ckptd
from ckptd import _native, _proto
sock, ckpt, spec_file, out = sys.argv[1:5]
spec = json.load(open(spec_file))
sd = {}
for name, (dt, shape) in spec.items():
    if dt == "BF16":
        sd[name] = ckptd.ShardedTensor(np.zeros(shape, np.uint16), shape, dtype="BF16")
    else:
        sd[name] = np.zeros(shape, np.dtype(dt))
r = ckptd.load_state_dict(sd, ckpt, socket=sock)
np.savez(out, **{n: (t.local if isinstance(t, ckptd.ShardedTensor) else t) for n, t in sd.items()})
with ckptd.Client(sock) as c:
    st = c.status()
print(json.dumps({
    "version": ckptd.__version__,
    "package": ckptd.__file__,
    "stubs": [m.__file__ for m in _proto.load_stubs()],
    "native": _native.available(),
    "missing": r.missing_keys, "unexpected": r.unexpected_keys,
    "bytes_delivered": r.bytes_delivered,
    "daemon_version": st["version"], "daemon_api_level": st["api_level"],
    "sys_path_has_source": any("client/python" in p for p in sys.path),
}))
"""


@unittest.skipIf(MISSING, f"[needs: python3-venv] /usr/bin/python3 lacks {MISSING}: install "
                 "python3-venv, python3-pip, python3-setuptools and python3-wheel")
def _count_tests(path, cls):
    """The test methods of class `cls` in the Python source `path`."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return sum(1 for n in node.body
                       if isinstance(n, ast.FunctionDef) and n.name.startswith("test"))
    raise AssertionError(f"no class {cls} in {path}")


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = testlib.tmp_root()
        cls.home = os.path.join(cls.tmp, "home")
        os.makedirs(cls.home)
        cls.env = clean_env(cls.home)
        cls.pkg = source_copy(os.path.join(cls.tmp, "src"))
        cls.venv = os.path.join(cls.tmp, "venv")
        run([PY, "-m", "venv", "--system-site-packages", cls.venv], env=cls.env)
        cls.pip = os.path.join(cls.venv, "bin", "pip")
        cls.python = os.path.join(cls.venv, "bin", "python")
        cls.install_log = run([cls.pip, "install", "--no-build-isolation", "--no-index",
                               cls.pkg], env=cls.env, cwd=cls.tmp)

    def test_install_needs_no_download(self):
        # --no-index everywhere: a dependency not met by Debian's packages
        # would have failed the install. They come from the system site.
        self.assertIn("Successfully installed ckptd-" + VERSION, self.install_log)
        for dep in ("numpy", "grpcio", "protobuf"):
            self.assertRegex(self.install_log,
                             rf"Requirement already satisfied: {dep}\S* in /usr/lib/python3")
        out = run([self.pip, "show", "ckptd"], env=self.env, cwd=self.home)
        self.assertIn(f"Version: {VERSION}\n", out)
        self.assertIn("Requires: grpcio, numpy, protobuf", out)

    def test_installed_package_loads_through_a_real_daemon(self):
        root = testlib.tmp_root()
        ckpt = os.path.join(root, "tiny-model")
        shutil.copytree(EXAMPLE, ckpt)
        ref = testlib.read_safetensors(os.path.join(ckpt, "model.safetensors"))
        spec = os.path.join(self.tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({n: (dt if dt == "BF16" else a.dtype.name, list(a.shape))
                       for n, (dt, a) in ref.items()}, f)
        elsewhere = os.path.join(self.tmp, "elsewhere")
        os.makedirs(elsewhere, exist_ok=True)
        script = os.path.join(self.tmp, "load.py")
        with open(script, "w") as f:
            f.write(LOAD_SCRIPT)
        arrays = os.path.join(self.tmp, "loaded.npz")
        with testlib.Daemon(root) as d:
            out = run([self.python, script, d.socket, ckpt, spec, arrays], env=self.env,
                      cwd=elsewhere)
        info = json.loads(out.strip().splitlines()[-1])
        site = os.path.join(self.venv, "lib")
        self.assertEqual(info["version"], VERSION)
        self.assertTrue(info["package"].startswith(site), info["package"])
        pkg_dir = os.path.dirname(info["package"])
        self.assertEqual([os.path.dirname(s) for s in info["stubs"]], [pkg_dir, pkg_dir])
        # The native copy loop compiled at install (setup.py) and used from there.
        self.assertEqual(info["native"], os.path.join(pkg_dir, "_ckptd_native.so"))
        self.assertFalse(info["sys_path_has_source"])
        self.assertEqual(info["missing"], [])
        self.assertEqual(info["unexpected"], [])
        self.assertEqual(info["bytes_delivered"], sum(a.nbytes for _, a in ref.values()))
        self.assertEqual(info["daemon_version"], f"ckptd {VERSION} (api ckptd.v1)")
        self.assertEqual(info["daemon_api_level"], API_LEVEL)
        got = np.load(arrays)
        for name, (_, a) in ref.items():
            np.testing.assert_array_equal(got[name], a, err_msg=name)

    def test_client_suites_pass_against_the_installed_package(self):
        # The numpy and torch client suites, run by the venv's python with only the
        # test helpers on PYTHONPATH: every `import ckptd` in them (and in the rank
        # processes they spawn) is the installed package.
        here = os.path.dirname(os.path.abspath(__file__))
        top = os.path.dirname(os.path.dirname(here))  # the runfiles root (testlib.runfile)
        env = dict(self.env, PYTHONPATH=here, CKPTD_BIN=os.path.abspath(testlib.CKPTD),
                   CKPTCTL=os.path.abspath(testlib.CKPTCTL))
        env.pop("XML_OUTPUT_FILE", None)
        where = run([self.python, "-c", "import ckptd; print(ckptd.__file__)"], env=env, cwd=top)
        self.assertTrue(where.strip().startswith(os.path.join(self.venv, "lib")), where)
        out = run([self.python, "-m", "unittest", "-v", "numpy_client_test.NumpyClientTest",
                   "torch_client_test.TorchClientTest"], env=env, cwd=top)
        self.assertRegex(out, r"\nOK\n")
        self.assertNotRegex(out, r"\.\.\. skipped")
        # Every test of the two classes ran, counted in their sources.
        expected = sum(_count_tests(os.path.join(here, f"{mod}.py"), cls)
                       for mod, cls in (("numpy_client_test", "NumpyClientTest"),
                                        ("torch_client_test", "TorchClientTest")))
        self.assertGreater(expected, 20)
        self.assertRegex(out, rf"Ran {expected} tests")

    def test_wheel_carries_stubs_and_version(self):
        wheels = os.path.join(self.tmp, "wheels")
        run([self.pip, "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", wheels,
             self.pkg], env=self.env, cwd=self.tmp)
        # A platform wheel: it carries the native copy loop (no Python ABI).
        whl = os.path.join(wheels, f"ckptd-{VERSION}-py3-none-{PLATFORM}.whl")
        self.assertTrue(os.path.isfile(whl), os.listdir(wheels))
        with zipfile.ZipFile(whl) as z:
            names = set(z.namelist())
            version_py = z.read("ckptd/_version.py").decode()
        for f in ("ckptd/__init__.py", "ckptd/client.py", "ckptd/ckpt_pb2.py",
                  "ckptd/ckpt_pb2_grpc.py", "ckptd/_ckptd_native.so"):
            self.assertIn(f, names)
        self.assertIn(f"__version__ = {VERSION!r}", version_py)
        self.assertIn(f"API_LEVEL = {API_LEVEL!r}", version_py)

    def test_python_m_build_sdist_and_wheel_install_offline(self):
        """issue 37: `python3 -m build` (sdist, then the wheel built from the
        unpacked sdist, as pip does from PyPI) works on client/python alone: the
        sdist carries VERSION and proto/ckpt.proto. Each installs into a fresh
        venv with no index and imports from elsewhere with its stubs."""
        have = subprocess.run([PY, "-c", "import build"], capture_output=True).returncode == 0
        if not have:
            self.skipTest("python3-build is not installed (deploy/install-deps.sh) "
                          "[needs: python3-build]")
        dist = os.path.join(self.tmp, "dist")
        run([PY, "-m", "build", "--no-isolation", "--outdir", dist, self.pkg], env=self.env,
            cwd=self.tmp)
        sdist = os.path.join(dist, f"ckptd-{VERSION}.tar.gz")
        wheel = os.path.join(dist, f"ckptd-{VERSION}-py3-none-{PLATFORM}.whl")
        self.assertTrue(os.path.isfile(sdist), os.listdir(dist))
        self.assertTrue(os.path.isfile(wheel), os.listdir(dist))
        for what, artifact in (("sdist", sdist), ("wheel", wheel)):
            with self.subTest(what):
                venv = os.path.join(self.tmp, f"venv-{what}")
                run([PY, "-m", "venv", "--system-site-packages", venv], env=self.env)
                run([os.path.join(venv, "bin", "pip"), "install", "--no-build-isolation",
                     "--no-index", artifact], env=self.env, cwd=self.tmp)
                elsewhere = os.path.join(self.tmp, f"use-{what}")
                os.makedirs(elsewhere, exist_ok=True)
                out = run([os.path.join(venv, "bin", "python"), "-c",
                           "import ckptd, ckptd.ckpt_pb2 as p; "
                           "print(ckptd.__version__, ckptd._version.API_LEVEL, "
                           "'next_unique_id' in p.SaveRequest.DESCRIPTOR.fields_by_name, "
                           "ckptd.__file__, ckptd._native.available())"], env=self.env,
                          cwd=elsewhere)
                version, level, stubs, where, native = out.split()
                self.assertEqual((version, int(level), stubs), (VERSION, API_LEVEL, "True"))
                self.assertEqual(native, os.path.join(os.path.dirname(where),
                                                      "_ckptd_native.so"))
                self.assertTrue(where.startswith(venv), where)

    def test_missing_proto_is_a_clear_error(self):
        broken = os.path.join(self.tmp, "broken")
        pkg = source_copy(broken)
        os.remove(os.path.join(broken, "proto", "ckpt.proto"))
        r = subprocess.run([self.pip, "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                            "-w", os.path.join(self.tmp, "nowheel"), pkg], env=self.env,
                           cwd=self.tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(f"ckptd setup.py: error: {os.path.join(broken, 'proto', 'ckpt.proto')} "
                      "not found", r.stdout)


if __name__ == "__main__":
    testlib.main("install_test")
