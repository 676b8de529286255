"""Cache views: a load's cached bytes copied by the client itself.

With process_memory and views (transport "cache_view"), the daemon does not
write the bytes its data cache holds: it sends their places (CacheViews in
proto/ckpt.proto: views, each a block of the cache, and copies, each `count`
runs of `length` bytes) and the client takes the views' read-only memfds on
the fd socket ("VIEWS <token>"), maps them, copies every run into its
tensors (_native.c's loop, else numpy), and closes that connection, which
tells the daemon it is done.

Mappings are kept from one load to the next (keyed by the view's key,
CacheViews.view_keys: random and never reused, so a block the next load uses
again is not mapped again: a new mapping costs a page-table entry per 4 KiB on
first touch), but only the latest load's: the daemon seals its blocks against
writes (F_SEAL_FUTURE_WRITE, so no holder of a view can change cached bytes),
which also stops it punching a freed block's pages out, so a mapping of a block
no load uses any more would keep that memory. They cost address space and one
descriptor each (Python's mmap keeps a duplicate of the fd).
"""
import bisect
import ctypes
import mmap
import os
import threading

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _native
from ._shm import MAX_VIEW_FDS, take_views
from .errors import CkptdError

_lock = threading.Lock()
_maps = {}  # view key -> (mmap, uint8 array)


def _mapping(key, fd, size):
    st = os.fstat(fd)
    if st.st_size < size:
        raise CkptdError("DATA_LOSS", f"a cache view holds {st.st_size} bytes, not {size}")
    with _lock:
        hit = _maps.get(key)
        if hit is not None and len(hit[1]) >= size:
            return hit[1]
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    a = np.frombuffer(m, np.uint8)
    with _lock:
        _maps[key] = (m, a)
    return a


def _keep(keys):
    """Drops the mappings of every view but `keys` (the load just done's); each
    is unmapped once no array refers to it (a copy in another thread holds its
    own)."""
    keep = set(keys)
    with _lock:
        for key in [k for k in _maps if k not in keep]:
            del _maps[key]


def mapped_views():
    """How many cache views this process keeps mapped (for tests)."""
    with _lock:
        return len(_maps)


def _copy_numpy(plan, order, srcs):
    """copy_views' copies made with numpy (no native library)."""
    dsts = {}
    for c, t, rel in plan:
        dst = dsts.get(t)
        if dst is None:
            a, nb = order[t]
            dst = dsts[t] = np.ctypeslib.as_array((ctypes.c_uint8 * nb).from_address(a))
        src = srcs[c.view]
        if c.count == 1:
            np.copyto(dst[rel:rel + c.length], src[c.offset:c.offset + c.length])
        else:
            np.copyto(as_strided(dst[rel:], (c.count, c.length), (c.dst_stride, 1)),
                      as_strided(src[c.offset:], (c.count, c.length), (c.src_stride, 1),
                                 writeable=False))


def copy_views(fd_socket, views, targets, timeout=10.0):
    """Copies `views` (a CacheViews message) into `targets`, the rank's
    tensors as (address, nbytes). Every copy is checked to lie inside its
    view and inside one target before anything is copied."""
    n = len(views.view_bytes)
    if not 0 < n <= MAX_VIEW_FDS or len(views.view_keys) != n:
        raise CkptdError("DATA_LOSS", f"the daemon sent {n} cache views "
                         f"({len(views.view_keys)} keys)")
    order = sorted((a, nb) for a, nb in targets if nb > 0)
    starts = [a for a, _ in order]
    plan = []
    for c in views.copies:
        count, length = c.count, c.length
        if c.view >= n or count < 1 or length < 1:
            raise CkptdError("DATA_LOSS", f"malformed cache view copy: {c}")
        if c.offset + (count - 1) * c.src_stride + length > views.view_bytes[c.view]:
            raise CkptdError("DATA_LOSS", f"a cache view copy reads past its view: {c}")
        t = bisect.bisect_right(starts, c.address) - 1
        rel = c.address - order[t][0] if t >= 0 else -1
        if rel < 0 or rel + (count - 1) * c.dst_stride + length > order[t][1] or \
                (count > 1 and c.dst_stride < length):
            raise CkptdError("DATA_LOSS", f"a cache view copy writes outside the tensors: {c}")
        plan.append((c, t, rel))
    sock, fds = take_views(fd_socket, views.token, n, timeout)
    try:
        try:
            srcs = [_mapping(key, fd, size)
                    for key, fd, size in zip(views.view_keys, fds, views.view_bytes)]
        finally:
            for fd in fds:
                os.close(fd)
        if not _native.copy_runs(np.array(
                [(order[t][0] + rel, srcs[c.view].ctypes.data + c.offset, c.length, c.count,
                  c.dst_stride, c.src_stride) for c, t, rel in plan],
                dtype=np.uint64).reshape(-1, _native.RUN_FIELDS)):
            _copy_numpy(plan, order, srcs)
    finally:
        sock.close()  # done: the daemon lets go of the views
        _keep(views.view_keys)
