"""Build hooks of the `ckptd` Python distribution (metadata: pyproject.toml).

At build time (build_py) this writes into the built package ckptd/:

- the gRPC stubs ckpt_pb2.py and ckpt_pb2_grpc.py, generated from
  proto/ckpt.proto with protoc and grpc_python_plugin (Debian's
  protobuf-compiler and protobuf-compiler-grpc), or `python3 -m
  grpc_tools.protoc` where only grpcio-tools is installed;
- _version.py with the version and API level of VERSION;
- _ckptd_native.so, the client's copy loop (ckptd/_native.c, plain C loaded
  with ctypes), compiled with the system's C compiler ($CC, else cc). Where
  that fails the build goes on without it (a warning; the client then copies
  with numpy) and the wheel stays pure; with it the wheel is tagged
  py3-none-<platform> (the library uses no Python ABI).

Both files are read from $CKPTD_SOURCE_ROOT, else from _ckptd_source/ beside
this file (an unpacked sdist: the sdist command puts VERSION and
proto/ckpt.proto there), else from the ckptd source tree this directory sits
in (client/python/../../). Nothing is downloaded:

    python3 -m venv --system-site-packages v
    v/bin/pip install --no-build-isolation client/python

See docs/python-install.md.
"""
import importlib.util
import os
import shutil
import subprocess
import sys

import sysconfig

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = ("ckpt_pb2.py", "ckpt_pb2_grpc.py")


class BuildError(SystemExit):
    def __init__(self, msg):
        super().__init__(f"ckptd setup.py: error: {msg}")


# What an sdist carries of the source tree (the sdist command copies them).
SDIST_SOURCE = "_ckptd_source"
SOURCE_FILES = ("VERSION", os.path.join("proto", "ckpt.proto"))


def source_root():
    root = os.environ.get("CKPTD_SOURCE_ROOT")
    if not root:
        bundled = os.path.join(HERE, SDIST_SOURCE)
        root = bundled if os.path.isfile(os.path.join(bundled, "VERSION")) else \
            os.path.join(HERE, "..", "..")
    return os.path.abspath(root)


def source_file(rel):
    path = os.path.join(source_root(), rel)
    if not os.path.isfile(path):
        raise BuildError(
            f"{path} not found: build the package from client/python inside a ckptd source "
            "tree (it reads proto/ckpt.proto and VERSION there), or set CKPTD_SOURCE_ROOT to "
            "the top of one")
    return path


def read_version():
    """(version, api_level) of VERSION, parsed by ckptd/_version.py."""
    spec = importlib.util.spec_from_file_location(
        "_ckptd_version_parser", os.path.join(HERE, "ckptd", "_version.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = source_file("VERSION")
    try:
        return mod.read_version_file(path)
    except ValueError as e:
        raise BuildError(str(e)) from None


def _tool(name):
    return shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK)
                                  else None)


def protoc_command(proto_dir, out_dir):
    protoc, plugin = _tool("protoc"), _tool("grpc_python_plugin")
    args = [f"--proto_path={proto_dir}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}"]
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"] + args
    if importlib.util.find_spec("grpc_tools") is not None:
        return [sys.executable, "-m", "grpc_tools.protoc"] + args
    missing = " and ".join(n for n, p in (("protoc", protoc), ("grpc_python_plugin", plugin))
                           if not p)
    raise BuildError(
        f"{missing} not found (on PATH or in /usr/bin), and no grpc_tools module: the gRPC "
        "stubs cannot be generated. Install Debian's protobuf-compiler and "
        "protobuf-compiler-grpc (deploy/install-deps.sh)")


def generate_stubs(out_dir):
    proto = source_file(os.path.join("proto", "ckpt.proto"))
    os.makedirs(out_dir, exist_ok=True)
    cmd = protoc_command(os.path.dirname(proto), out_dir) + [proto]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stdout}")
    for f in STUBS:
        if not os.path.isfile(os.path.join(out_dir, f)):
            raise BuildError(f"{' '.join(cmd)} did not write {f}")
    return [os.path.join(out_dir, f) for f in STUBS]


def write_version(out_dir, version, api_level):
    path = os.path.join(out_dir, "_version.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write('"""Written by client/python/setup.py from VERSION when this package was '
                'built."""\n'
                f"__version__ = {version!r}\n"
                f"API_LEVEL = {api_level!r}\n")
    return path


NATIVE_SRC = os.path.join("ckptd", "_native.c")
NATIVE_LIB = "_ckptd_native.so"


def compile_native(out_dir):
    """Compiles ckptd/_native.c into out_dir; the library's path, or None
    (with a warning) when no C compiler builds it."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    out = os.path.join(out_dir, NATIVE_LIB)
    cmd = cc.split() + ["-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, NATIVE_SRC)]
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        r = None
        why = str(e)
    else:
        why = f"exit {r.returncode}:\n{r.stdout}"
    if r is None or r.returncode != 0 or not os.path.isfile(out):
        print(f"ckptd setup.py: warning: {' '.join(cmd)} failed ({why}); the client will "
              "copy cache views with numpy (slower)", file=sys.stderr)
        return None
    return out


class build_py(_build_py):
    """Copies the package, then generates the stubs and _version.py into it.
    An editable install (pip install -e) generates only the stubs, into the
    source package (git-ignored); its _version.py reads VERSION itself."""

    def run(self):
        super().run()
        self._generated = []
        if self.dry_run:
            return
        if getattr(self, "editable_mode", False):
            pkg = os.path.join(HERE, "ckptd")
            self._generated = generate_stubs(pkg) + [p for p in [compile_native(pkg)] if p]
            return
        out = os.path.join(self.build_lib, "ckptd")
        self._generated = generate_stubs(out) + [write_version(out, *read_version())]
        native = compile_native(out)
        if native:
            self._generated.append(native)
            self.distribution.has_native = True

    def get_outputs(self, include_bytecode=1):
        outs = super().get_outputs(include_bytecode)
        return outs + [f for f in getattr(self, "_generated", []) if f not in outs]


class sdist(_sdist):
    """An sdist that builds anywhere: VERSION and proto/ckpt.proto of the source
    tree go into it (_ckptd_source/), where build_py then finds them."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for rel in SOURCE_FILES:
            dst = os.path.join(base_dir, SDIST_SOURCE, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(source_file(rel), dst)


class NativeDistribution(Distribution):
    """Not pure once build_py compiled the native library (a platform wheel)."""
    has_native = False

    def has_ext_modules(self):
        return self.has_native


cmdclass = {"build_py": build_py, "sdist": sdist}
try:
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # no wheel package: sdists and installs only
    _bdist_wheel = None
if _bdist_wheel is not None:
    class bdist_wheel(_bdist_wheel):
        """py3-none-<platform> with the native library (plain C, no Python ABI),
        py3-none-any without it."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            if not self.distribution.has_native:
                return "py3", "none", "any"
            return "py3", "none", plat

        def run(self):
            self.run_command("build_py")  # has_native known before the tag
            self.root_is_pure = not self.distribution.has_native
            super().run()

    cmdclass["bdist_wheel"] = bdist_wheel

setup(version=read_version()[0], cmdclass=cmdclass, distclass=NativeDistribution)
