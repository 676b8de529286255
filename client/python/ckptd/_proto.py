"""Finds and imports the gRPC stubs generated from proto/ckpt.proto.

The stubs (ckpt_pb2.py, ckpt_pb2_grpc.py) are build outputs of
//client/python:ckpt_py_grpc, never checked in. They are looked for, in order:

1. the directory in $CKPTD_PROTO_DIR, if set;
2. next to the `ckptd` package (client/python/ in Bazel runfiles, or wherever
   the package and the two files were installed together);
3. inside the `ckptd` package directory;
4. bazel-bin/client/python of the source tree the package lives in (found by
   walking up from the package directory), then of the current directory.

The first directory holding both files wins. ckpt_pb2_grpc.py imports its
messages as the top-level module `ckpt_pb2`, so both are registered in
sys.modules under those names (without touching sys.path).
"""
import importlib.util
import os
import sys
import threading

from .errors import CkptdError

_FILES = ("ckpt_pb2.py", "ckpt_pb2_grpc.py")


def candidate_dirs():
    dirs = []
    env = os.environ.get("CKPTD_PROTO_DIR")
    if env:
        dirs.append(env)
    pkg = os.path.dirname(os.path.abspath(__file__))
    dirs.append(os.path.dirname(pkg))
    dirs.append(pkg)
    d = os.path.dirname(pkg)
    for _ in range(6):
        dirs.append(os.path.join(d, "bazel-bin", "client", "python"))
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    dirs.append(os.path.join(os.getcwd(), "bazel-bin", "client", "python"))
    return dirs


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _ours(mod):
    d = getattr(mod, "DESCRIPTOR", None)
    return d is not None and getattr(d, "package", None) == "ckptd.v1"


_lock = threading.Lock()
_loaded = None  # (ckpt_pb2, ckpt_pb2_grpc) once both are fully imported


def load_stubs():
    """Returns (ckpt_pb2, ckpt_pb2_grpc). Thread-safe: a module is registered in
    sys.modules before its body runs, so threads making their first calls at
    once must not see the other's half-imported stubs."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _find_stubs()
        return _loaded


def _find_stubs():
    pb2 = sys.modules.get("ckpt_pb2")
    grpc_mod = sys.modules.get("ckpt_pb2_grpc")
    if pb2 is not None and grpc_mod is not None and _ours(pb2):
        return pb2, grpc_mod
    tried = candidate_dirs()
    for d in tried:
        if all(os.path.isfile(os.path.join(d, f)) for f in _FILES):
            pb2 = sys.modules.get("ckpt_pb2")
            if pb2 is None or not _ours(pb2):
                pb2 = _load("ckpt_pb2", os.path.join(d, "ckpt_pb2.py"))
            grpc_mod = _load("ckpt_pb2_grpc", os.path.join(d, "ckpt_pb2_grpc.py"))
            return pb2, grpc_mod
    raise CkptdError(
        "FAILED_PRECONDITION",
        "the gRPC stubs ckpt_pb2.py / ckpt_pb2_grpc.py were not found; build them with "
        "`bazel build //client/python:ckpt_py_grpc` or set CKPTD_PROTO_DIR (looked in: "
        + ", ".join(tried) + ")")
