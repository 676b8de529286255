"""Shared memory for ckptd: memfd segments, and handing their fd to the daemon.

A segment is an anonymous memfd (os.memfd_create) mapped with mmap, sealed
with F_SEAL_SHRINK | F_SEAL_GROW once sized (the daemon accepts only memfds
that cannot shrink under its mapping). Its fd goes to the daemon over the
daemon's fd socket ("<socket>.fd"), protocol of proto/fd_socket.h: one
SOCK_SEQPACKET message carrying a 32-character lowercase hex token plus the
fd as SCM_RIGHTS; the daemon answers "OK" or "ERR <CODE>: <reason>". The
request then names the token (ShmDestination.fd_token); only this uid may.
Nothing is ever created under /dev/shm, and the memory is freed when both
sides close it.

A segment can also be borrowed from the daemon ("ALLOC <bytes>" on the same
socket; the reply "OK <token> <bytes>" carries the memfd): the daemon keeps
it mapped, so loads into it skip the daemon's per-load mmap and page-table
set-up, and hands it to the next client of the same size when this one closes
the connection (the lease). Requests then name ShmDestination.arena_token.
"""
import fcntl
import mmap
import os
import re
import secrets
import socket as _socket
import threading
import weakref

import numpy as np

from .errors import CkptdError, daemon_gone

ALIGN = 64
TOKEN_LEN = 32
MAX_ARENA_BYTES = 1 << 46  # kMaxArenaBytes
# A grant, parsed as strictly as proto/fd_socket.h's ParseFdReply: a token of
# lowercase hex, a canonical decimal size (no sign, space or leading zero).
_GRANT = re.compile(rb"OK ([0-9a-f]{32}) ([1-9][0-9]{0,19})")


def align(n, a=ALIGN):
    return (n + a - 1) // a * a


def fd_socket_path(grpc_socket):
    return grpc_socket + ".fd"


_CODES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
          "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
          "UNAUTHENTICATED")


def parse_refusal(reply):
    """(code, message) of a daemon's "ERR <CODE>: <message>" reply (a bare
    "ERR <message>" from older daemons is UNAVAILABLE)."""
    text = reply.decode("ascii", "replace") if isinstance(reply, bytes) else reply
    if not text:
        return "UNAVAILABLE", "no reply"
    if text.startswith("ERR "):
        text = text[4:]
    code, sep, rest = text.partition(": ")
    if sep and code in _CODES:
        return code, rest
    return "UNAVAILABLE", text


def _queued_refusal(s):
    """After a failed send: the refusal the daemon sent before closing, if any."""
    try:
        s.setblocking(False)
        try:
            reply = s.recv(512)
        except ConnectionResetError:
            reply = s.recv(512)
    except OSError:
        return None
    return parse_refusal(reply) if reply.startswith(b"ERR") else None


MAX_VIEW_FDS = 200
_VIEWS = re.compile(rb"OK VIEWS ([1-9][0-9]{0,2})")


def take_views(fd_socket, token, count, timeout=10.0):
    """The read-only memfds of a load's cache views ("VIEWS <token>"; see
    CacheViews in proto/ckpt.proto): (socket, fds). Keep the socket open
    while copying; closing it tells the daemon the copies are done."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(fd_socket)
        s.send(f"VIEWS {token}".encode("ascii"))
        msg, fds = _recv_reply(s, True, MAX_VIEW_FDS)
    except OSError as e:
        s.close()
        raise daemon_gone(f"{fd_socket}: taking the load's cache views: {e}") from e
    m = _VIEWS.fullmatch(msg)
    if m is None or int(m.group(1)) != count or len(fds) != count:
        for fd in fds:
            os.close(fd)
        s.close()
        code, why = (parse_refusal(msg) if msg.startswith(b"ERR")
                     else ("DATA_LOSS", f"expected {count} views, got "
                           f"{msg.decode('ascii', 'replace')!r} with {len(fds)} fd(s)"))
        raise CkptdError(code, f"{fd_socket}: taking the load's cache views: {why}")
    return s, fds


def _recv_reply(s, with_fd, max_fds=1):
    """The daemon's reply (and its fds). A daemon that refuses a connection
    before reading the request leaves it unread, so the first receive fails
    with ECONNRESET although the reply is queued: the second gets it."""
    for attempt in (0, 1):
        try:
            if with_fd:
                msg, fds, _, _ = _socket.recv_fds(s, 512, max_fds)
                return msg, fds
            return s.recv(512), []
        except ConnectionResetError:
            if attempt:
                raise
            s.setblocking(False)


def seal(fd):
    """Seals a sized memfd (made with MFD_ALLOW_SEALING) as the daemon requires."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)


def request_arena(fd_socket, size, timeout=10.0):
    """Borrows an arena from the daemon: (fd, lease socket, token, size)."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(fd_socket)
        try:
            s.send(f"ALLOC {int(size)}".encode("ascii"))
        except OSError as e:
            refusal = _queued_refusal(s)
            if refusal is None:
                raise
            raise CkptdError("RESOURCE_EXHAUSTED", f"{fd_socket}: the daemon did not lend an "
                             f"arena of {size} bytes: {refusal[1]}") from e
        msg, fds = _recv_reply(s, True)
    except OSError as e:
        s.close()
        raise daemon_gone(f"{fd_socket}: borrowing an arena: {e}") from e
    except CkptdError:
        s.close()
        raise
    grant = _GRANT.fullmatch(msg)
    granted = int(grant.group(2)) if grant else 0
    if grant is None or len(fds) != 1 or not size <= granted <= MAX_ARENA_BYTES:
        for fd in fds:
            os.close(fd)
        s.close()
        code = "RESOURCE_EXHAUSTED" if msg.startswith(b"ERR") else "UNAVAILABLE"
        raise CkptdError(code, f"{fd_socket}: the daemon did not lend an arena of {size} bytes: "
                         f"{msg.decode('ascii', 'replace') or 'no reply'}")
    s.settimeout(None)  # blocking again (also after _recv_reply's second try)
    return fds[0], s, grant.group(1).decode("ascii"), granted


class Segment:
    """A memfd of `size` bytes mapped read-write (MAP_SHARED): made here, or
    borrowed from the daemon listening on the gRPC socket `daemon`."""

    def __init__(self, size, name="ckptd", daemon=None, timeout=10.0):
        self.size = max(int(size), 1)
        self.token = None
        self._lease = None
        if daemon is not None:
            self.fd, self._lease, self.token, self.size = request_arena(
                fd_socket_path(daemon), self.size, timeout)
        else:
            try:
                self.fd = os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as e:
                raise CkptdError("RESOURCE_EXHAUSTED", f"memfd_create: {e.strerror}") from e
        try:
            if daemon is None:
                os.ftruncate(self.fd, self.size)
                seal(self.fd)  # the daemon's arenas come sealed
            # The daemon's arena already has its pages: map them all now.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if daemon else 0)
            self.mm = mmap.mmap(self.fd, self.size, flags=flags)
        except OSError as e:
            os.close(self.fd)
            if self._lease is not None:
                self._lease.close()
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
        if self._lease is not None:
            self._lease.close()  # the daemon may lend the arena again
            self._lease = None

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
            raise daemon_gone(
                f"{fd_socket}: cannot connect to the daemon's fd socket (is ckptd running?): "
                f"{e.strerror}") from e
        except OSError as e:
            raise daemon_gone(f"{fd_socket}: connect: {e}") from e
        token = secrets.token_hex(TOKEN_LEN // 2)
        try:
            _socket.send_fds(s, [token.encode("ascii")], [fd])
            reply, _ = _recv_reply(s, False)
        except OSError as e:
            refusal = _queued_refusal(s)
            if refusal is not None:
                raise CkptdError(refusal[0],
                                 f"{fd_socket}: daemon refused the fd: {refusal[1]}") from e
            raise daemon_gone(f"{fd_socket}: passing the shm fd: {e}") from e
        if not reply.startswith(b"OK"):
            code, message = parse_refusal(reply)
            raise CkptdError(code, f"{fd_socket}: daemon refused the fd: {message}")
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

    With `daemon=` (the daemon's socket path, e.g. ckptd.default_socket())
    the memory is borrowed from that daemon, which keeps it mapped: loads
    into it are faster still, and a restarted process asking for the same
    size gets a recycled arena. Its bytes start as the last user left them
    (like malloc); loads overwrite every target byte.
    """

    def __init__(self, nbytes, name="ckptd-arena", daemon=None):
        self._seg = Segment(nbytes, name, daemon=daemon)
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
    def daemon_token(self):
        """The token of an arena borrowed from the daemon (None otherwise)."""
        return self._seg.token

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
