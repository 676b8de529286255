"""Cache views: a load's cached bytes copied by the client itself.

With process_memory and views (transport "cache_view"), the daemon does not
write the bytes its data cache holds: it sends their places (CacheViews in
proto/ckpt.proto: views, each a block of the cache, and copies, each `count`
runs of `length` bytes) and the client takes the views' read-only memfds on
the fd socket ("VIEWS <token>"), maps them, copies every run into its
tensors (_native.c's loop, else numpy), and closes that connection, which
tells the daemon it is done. Views marked as files (CacheViews.view_is_file:
bytes the cache did not hold, file_views) are checkpoint files opened
read-only: their runs are read with pread, or, from each 2 MiB block the page
cache holds in one 2 MiB folio (probed block by block: one page fault), copied
out of a mapping made for that copy only (_native.c; a file truncated under it
raises SIGBUS, which the copy catches: the load fails, not the process);
a short read fails the load too.

Mappings are kept from one load to the next (keyed by the view's key,
CacheViews.view_keys: random and never reused, so a block the next load uses
again is not mapped again: a new mapping costs a page-table entry per 4 KiB on
first touch), but only the latest load's: the daemon seals its blocks against
writes (F_SEAL_FUTURE_WRITE, so no holder of a view can change cached bytes),
which also stops it punching a freed block's pages out, so a mapping of a block
no load uses any more would keep that memory. They cost address space only.
A mapping of 2 MiB or more starts on a 2 MiB boundary, so that a block the
daemon collapsed into huge pages (cache_huge_pages) maps one page-table entry
per 2 MiB: a new process's first copy out of it runs at memcpy speed instead
of faulting every 4 KiB.
"""
import bisect
import ctypes
import errno
import mmap
import os
import stat
import threading

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _native
from ._shm import MAX_VIEW_FDS, take_views
from .errors import CkptdError

_lock = threading.Lock()
_maps = {}  # view key -> read-only uint8 array over a _Mapping

_HUGE = 2 << 20
_PAGE = mmap.PAGESIZE
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """`size` bytes of `fd` mapped shared and read-only, from a 2 MiB boundary
    when 2 MiB or more (address space for size + 2 MiB taken, the file mapped
    over its aligned part, the rest given back); unmapped when collected."""

    def __init__(self, fd, size):
        self.addr, self.length = 0, (size + _PAGE - 1) // _PAGE * _PAGE
        span = self.length + (_HUGE if size >= _HUGE else 0)
        base = _libc.mmap(None, span, 0,  # PROT_NONE
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise CkptdError("RESOURCE_EXHAUSTED",
                             f"mapping a cache view of {size} bytes: {os.strerror(err)}")
        at = (base + _HUGE - 1) & ~(_HUGE - 1) if size >= _HUGE else base
        got = _libc.mmap(at, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            _libc.munmap(base, span)
            raise CkptdError("RESOURCE_EXHAUSTED",
                             f"mapping a cache view of {size} bytes: {os.strerror(err)}")
        if at > base:
            _libc.munmap(base, at - base)
        if base + span > at + self.length:
            _libc.munmap(at + self.length, base + span - (at + self.length))
        self.addr = at

    def __del__(self):
        if self.addr and _libc is not None:  # None: the interpreter is exiting
            _libc.munmap(self.addr, self.length)
            self.addr = 0


def _mapping(key, fd, size):
    st = os.fstat(fd)
    if st.st_size < size:
        raise CkptdError("DATA_LOSS", f"a cache view holds {st.st_size} bytes, not {size}")
    with _lock:
        hit = _maps.get(key)
        if hit is not None and len(hit) >= size:
            return hit
    m = _Mapping(fd, size)
    buf = (ctypes.c_uint8 * size).from_address(m.addr)
    buf.mapping = m  # unmapped once no array refers to the buffer
    a = np.frombuffer(buf, np.uint8)
    a.flags.writeable = False
    with _lock:
        _maps[key] = a
    return a


def keep(keys):
    """Drops the mappings of every view but `keys` (the load just done's); each
    is unmapped once no array refers to it (a copy in another thread holds its
    own). File views (key 0) are never mapped."""
    keep = set(keys) - {0}
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


def _check_file(fd, size):
    """A file view's descriptor: a regular file of at least `size` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CkptdError("DATA_LOSS", "a file view is not a regular file")
    if st.st_size < size:
        raise CkptdError("ABORTED", f"a checkpoint file holds {st.st_size} bytes, not {size} "
                         "as when the load began: it changed during the load")


def _read_file(fd, runs):
    """Reads `runs` (dst, file offset, length, count, dst_stride, src_stride)
    of a file view: copied out of a mapping of the file where its page cache
    maps whole 2 MiB pages (the native loop decides), else with pread (the
    native loop, else os.preadv)."""
    table = np.array(runs, dtype=np.uint64).reshape(-1, _native.RUN_FIELDS)
    got = _native.map_runs(fd, table)
    if got is None or got == 1:
        got = _native.pread_runs(fd, table)
    if got is None:
        got = 0
        for dst, off, length, count, dstride, sstride in runs:
            for i in range(count):
                buf = (ctypes.c_uint8 * length).from_address(dst + i * dstride)
                at, view = off + i * sstride, memoryview(buf).cast("B")
                while len(view):
                    k = os.preadv(fd, [view], at)
                    if k == 0:
                        got = -errno.ENODATA
                        break
                    at, view = at + k, view[k:]
    if got == -errno.ENODATA:
        raise CkptdError("ABORTED", "a checkpoint file ended before the bytes this load reads "
                         "from it: it changed during the load")
    if got < 0:
        raise CkptdError("DATA_LOSS", f"reading a checkpoint file: {os.strerror(-got)}")


def copy_views(fd_socket, views, targets, timeout=10.0):
    """Copies `views` (a CacheViews message: the load's, or one batch of them)
    into `targets`, the rank's tensors as (address, nbytes). Every copy is
    checked to lie inside its view and inside one target before anything is
    copied. The caller calls keep() with every batch's keys once the load is
    done."""
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
    is_file = list(views.view_is_file) or [False] * n
    if len(is_file) != n:
        raise CkptdError("DATA_LOSS", f"the daemon sent {n} cache views but {len(is_file)} "
                         "file marks")
    sock, fds = take_views(fd_socket, views.token, n, timeout)
    try:
        try:
            srcs = [None if f else _mapping(key, fd, size)
                    for key, fd, size, f in zip(views.view_keys, fds, views.view_bytes, is_file)]
            for fd, size, f in zip(fds, views.view_bytes, is_file):
                if f:
                    _check_file(fd, size)
            runs = [(order[t][0] + rel, c.offset if is_file[c.view]
                     else srcs[c.view].ctypes.data + c.offset, c.length, c.count,
                     c.dst_stride, c.src_stride) for c, t, rel in plan]
            cached, by_file = [], {}
            for i, (c, _, _) in enumerate(plan):
                if is_file[c.view]:
                    by_file.setdefault(c.view, []).append(runs[i])
                else:
                    cached.append(i)
            if not _native.copy_runs(np.array([runs[i] for i in cached], dtype=np.uint64)
                                     .reshape(-1, _native.RUN_FIELDS)):
                _copy_numpy([plan[i] for i in cached], order, srcs)
            for v, file_runs in by_file.items():
                _read_file(fds[v], file_runs)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        sock.close()  # done: the daemon lets go of the views
