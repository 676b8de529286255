"""The client's native copy loop (_native.c), loaded with ctypes.

Looked for as _ckptd_native.so in the package directory (an installed
package: setup.py compiles it; Bazel runfiles), then in ckptd/ under
$CKPTD_PROTO_DIR and bazel-bin/client/python of the source tree the package
lives in or of the current directory (PYTHONPATH=client/python after `bazel
build //client/python:ckptd`). Where it is missing, cannot be loaded or
CKPTD_NATIVE=0 is set, the client copies with numpy: the same bytes, slower
(copy_runs returns False).
"""
import ctypes
import os
import threading

import numpy as np

from . import _proto

_NAME = "_ckptd_native.so"
_lock = threading.Lock()
_lib = None  # the loaded library, False once looked for in vain
_where = None


def _candidates():
    """The package directory, then ckptd/ beside every place the stubs are
    looked for (_proto.candidate_dirs: $CKPTD_PROTO_DIR, bazel-bin/client/python)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    return [pkg] + [os.path.join(d, "ckptd") for d in _proto.candidate_dirs()]


def _load():
    global _lib, _where
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            _lib = False
            if os.environ.get("CKPTD_NATIVE", "1") != "0":
                for d in _candidates():
                    path = os.path.join(d, _NAME)
                    if not os.path.isfile(path):
                        continue
                    try:
                        lib = ctypes.CDLL(path)
                    except OSError:
                        continue
                    lib.ckptd_copy_runs.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
                    lib.ckptd_copy_runs.restype = ctypes.c_uint64
                    lib.ckptd_pread_runs.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_uint64]
                    lib.ckptd_pread_runs.restype = ctypes.c_int64
                    lib.ckptd_map_runs.argtypes = [ctypes.c_int, ctypes.c_void_p,
                                                   ctypes.c_uint64]
                    lib.ckptd_map_runs.restype = ctypes.c_int64
                    _lib, _where = lib, path
                    break
        return _lib


def available():
    """The library's path when the native copy is used, else None."""
    return _where if _load() else None


# One row per run: dst, src, length, count, dst_stride, src_stride (addresses
# in this process), as struct ckptd_run in _native.c.
RUN_FIELDS = 6


def _checked(runs):
    runs = np.ascontiguousarray(runs, dtype=np.uint64)
    if runs.ndim != 2 or runs.shape[1] != RUN_FIELDS:
        raise ValueError(f"runs of shape {runs.shape}, not (n, {RUN_FIELDS})")
    return runs


def pread_runs(fd, runs):
    """Reads `runs` (as copy_runs, src = the file offset of piece 0) from file
    `fd` with pread, GIL released. None when the native library is not
    available (the caller reads with os.preadv); else 0, or -errno (-ENODATA:
    the file ended before a piece did)."""
    lib = _load()
    if not lib:
        return None
    runs = _checked(runs)
    return int(lib.ckptd_pread_runs(fd, runs.ctypes.data, len(runs))) if len(runs) else 0


def map_runs(fd, runs):
    """Copies `runs` (as pread_runs) out of a mapping of file `fd` where its
    page cache maps whole 2 MiB pages (ckptd_map_runs in _native.c), GIL
    released. None when the native library is not available or
    CKPTD_MAP_FILES=0; 1 when the mapping would not beat pread (nothing
    copied); else 0, or -errno (-ENODATA: the file ended under the mapping)."""
    lib = _load()
    if not lib or os.environ.get("CKPTD_MAP_FILES", "1") == "0":
        return None
    runs = _checked(runs)
    return int(lib.ckptd_map_runs(fd, runs.ctypes.data, len(runs))) if len(runs) else 0


def copy_runs(runs):
    """Copies `runs`, a uint64 array of shape (n, 6), checked by the caller
    (every piece inside its source mapping and its destination). The GIL is
    released meanwhile. False when the native library is not available (the
    caller copies with numpy)."""
    lib = _load()
    if not lib:
        return False
    runs = _checked(runs)
    if len(runs):
        lib.ckptd_copy_runs(runs.ctypes.data, len(runs))
    return True
