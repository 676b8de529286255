"""Shared memory for ckptd: memfd segments, and handing their fd to the daemon.

A segment is an anonymous memfd (os.memfd_create) mapped with mmap. Its fd
goes to the daemon over the daemon's fd socket ("<socket>.fd"), protocol of
server/fd_channel.h: one SOCK_SEQPACKET message carrying a 32-byte ASCII
token plus the fd as SCM_RIGHTS; the daemon answers "OK" or "ERR <reason>".
The request then names the token (ShmDestination.fd_token). Nothing is ever
created under /dev/shm, and the memory is freed when both sides close it.
"""
import mmap
import os
import secrets
import socket as _socket
import threading
import weakref

import numpy as np

from .errors import CkptdError

ALIGN = 64
TOKEN_LEN = 32


def align(n, a=ALIGN):
    return (n + a - 1) // a * a


def fd_socket_path(grpc_socket):
    return grpc_socket + ".fd"


class Segment:
    """A memfd of `size` bytes mapped read-write (MAP_SHARED)."""

    def __init__(self, size, name="ckptd"):
        self.size = max(int(size), 1)
        try:
            self.fd = os.memfd_create(name[:200], os.MFD_CLOEXEC)
        except OSError as e:
            raise CkptdError("RESOURCE_EXHAUSTED", f"memfd_create: {e.strerror}") from e
        try:
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        except OSError as e:
            os.close(self.fd)
            raise CkptdError("RESOURCE_EXHAUSTED",
                             f"shared memory of {size} bytes: {e.strerror}") from e
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.u8.ctypes.data

    def view(self, offset, nbytes):
        return self.u8[offset:offset + nbytes]

    def close(self):
        """Unmaps and closes; views into the segment must be gone by then."""
        if self.fd < 0:
            return
        self.u8 = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes with it
        os.close(self.fd)
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def send_fd(fd_socket, fd, timeout=10.0):
    """Hands `fd` to the daemon listening on `fd_socket`; returns the token."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        try:
            s.connect(fd_socket)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise CkptdError(
                "UNAVAILABLE",
                f"{fd_socket}: cannot connect to the daemon's fd socket (is ckptd running?): "
                f"{e.strerror}") from e
        except OSError as e:
            raise CkptdError("UNAVAILABLE", f"{fd_socket}: connect: {e}") from e
        token = secrets.token_hex(TOKEN_LEN // 2)
        try:
            _socket.send_fds(s, [token.encode("ascii")], [fd])
            reply = s.recv(256)
        except OSError as e:
            raise CkptdError("UNAVAILABLE", f"{fd_socket}: passing the shm fd: {e}") from e
        if not reply.startswith(b"OK"):
            raise CkptdError("UNAVAILABLE", f"{fd_socket}: daemon refused the fd: "
                             f"{reply.decode('ascii', 'replace') or 'no reply'}")
        return token
    finally:
        s.close()


_arenas = weakref.WeakSet()
_arenas_lock = threading.Lock()


class SharedArena:
    """Memory that ckptd can load into (and save from) without any copy.

    Arrays and tensors allocated here live in one memfd segment; when every
    tensor of a load_state_dict/save_state_dict call lives in the same arena
    (contiguous), the daemon reads/writes them in place. Elsewhere they are
    ordinary numpy arrays / torch CPU tensors.

        arena = ckptd.SharedArena(1 << 30)
        w = arena.empty((4096, 4096), "float32")          # numpy
        e = arena.empty_torch((1024, 512), torch.bfloat16)  # torch
    """

    def __init__(self, nbytes, name="ckptd-arena"):
        self._seg = Segment(nbytes, name)
        self._pos = 0
        self._lock = threading.Lock()
        with _arenas_lock:
            _arenas.add(self)

    @property
    def fd(self):
        return self._seg.fd

    @property
    def size(self):
        return self._seg.size

    @property
    def used(self):
        return self._pos

    def _alloc(self, nbytes):
        with self._lock:
            off = self._pos
            if off + nbytes > self._seg.size:
                raise CkptdError("RESOURCE_EXHAUSTED",
                                 f"SharedArena: {nbytes} bytes do not fit ({self._seg.size - off} "
                                 f"of {self._seg.size} left)")
            self._pos = align(off + nbytes)
            return off

    def empty(self, shape, dtype):
        """A numpy array of `shape` and `dtype` inside the arena (zero-filled)."""
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        off = self._alloc(n)
        return self._seg.u8[off:off + n].view(dt).reshape(shape)

    def empty_torch(self, shape, dtype):
        """A torch CPU tensor inside the arena (torch.bfloat16 included)."""
        import torch
        from ._tensors import torch_storage_numpy_dtype
        np_dt = torch_storage_numpy_dtype(dtype)
        arr = self.empty(shape, np_dt)
        t = torch.from_numpy(arr)
        return t.view(dtype) if t.dtype != dtype else t

    def offset_of(self, address, nbytes):
        """The arena offset of [address, address+nbytes), or None if outside."""
        base = self._seg.address
        if self._seg.fd >= 0 and base <= address and address + nbytes <= base + self._seg.size:
            return address - base
        return None

    def close(self):
        self._seg.close()


def find_arena(address, nbytes):
    with _arenas_lock:
        arenas = list(_arenas)
    for a in arenas:
        off = a.offset_of(address, nbytes)
        if off is not None:
            return a, off
    return None, None
