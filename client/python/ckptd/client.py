"""The ckptd client: connection, load/save of state dicts, admin calls."""
import concurrent.futures
import ctypes
import dataclasses
import itertools
import json
import os
import random
import re
import secrets
import shutil
import socket as _socket
import subprocess
import sys
import threading
import time

import numpy as np

from . import _cuda, _proto, _version
from . import _tensors, _views
from ._shm import Segment, align, find_arena, fd_socket_path, send_fd
from ._tensors import flatten
from .errors import CkptdError, daemon_gone, from_rpc_error

# gRPC and the generated stubs are imported with the package, not by the
# first Client(): a restarted job's load is on its critical path, its imports
# are not (they run with the training script's own, long before the load;
# about 30 ms on the dev VM). Where either is missing, Client() says why.
try:
    import grpc as _grpc  # noqa: F401
    _proto.load_stubs()
except Exception:  # noqa: BLE001 - reported by the first Client()
    pass

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


def default_socket():
    """$CKPTD_SOCKET, else /run/ckptd/ckptd.sock."""
    return os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET


# --- distributed environment --------------------------------------------------

def _env_int(name):
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise CkptdError("INVALID_ARGUMENT", f"${name}={v!r} is not an integer") from None


def resolve_ranks(rank=None, world_size=None, node_ranks=None):
    """(rank, world_size, node_ranks) from the arguments, else the environment.

    rank: RANK, else LOCAL_RANK, else 0. world_size: WORLD_SIZE, else 1.
    node_ranks (the ranks served by this node's daemon): when LOCAL_RANK and
    LOCAL_WORLD_SIZE are set and smaller than the world (several nodes), the
    contiguous block [rank - LOCAL_RANK, + LOCAL_WORLD_SIZE) as torchrun
    assigns them; else all ranks (empty list).
    """
    if rank is None:
        rank = _env_int("RANK")
        if rank is None:
            rank = _env_int("LOCAL_RANK")
        if rank is None:
            rank = 0
    if world_size is None:
        world_size = _env_int("WORLD_SIZE") or 1
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise CkptdError("INVALID_ARGUMENT", f"rank {rank} is outside world_size {world_size}")
    if node_ranks is None:
        local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
        node_ranks = []
        if local_rank is not None and local_world is not None and 0 < local_world < world_size:
            first = rank - local_rank
            node_ranks = list(range(max(first, 0), min(first + local_world, world_size)))
    return rank, world_size, [int(r) for r in node_ranks]


_dist_key = None  # the key agreed over torch.distributed's default group (resolve_job_key)
_dist_key_lock = threading.Lock()


def resolve_job_key(job_key, world_size, node_ranks):
    """The job's shared secret (LoadRequest.job_key) as bytes, or b"" for none.

    `job_key` as given (str or bytes, 16 to 64 bytes); else $CKPTD_JOB_KEY; else,
    for a job spanning several daemons (node_ranks fewer than the world) in a
    process where torch.distributed is initialised, one key rank 0 draws and
    broadcasts over the default process group (once per process: every rank of
    such a job calls this at the same point, as it calls load/save). The key goes
    to this node's daemon only; with it the daemons prove to each other that
    their ranks belong to the job (docs/security.md, "Job keys").
    """
    global _dist_key
    if not job_key:  # None, "" or b"": none given
        job_key = os.environ.get("CKPTD_JOB_KEY") or None
    if job_key is None and node_ranks and len(node_ranks) < world_size:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            with _dist_key_lock:
                if _dist_key is None:
                    box = [secrets.token_hex(32) if dist.get_rank() == 0 else None]
                    dist.broadcast_object_list(box, src=0)
                    _dist_key = box[0]
                job_key = _dist_key
    if job_key is None:
        return b""
    key = job_key.encode() if isinstance(job_key, str) else bytes(job_key)
    if not 16 <= len(key) <= 64:
        raise CkptdError("INVALID_ARGUMENT",
                         f"job_key must be 16 to 64 bytes, not {len(key)} (CKPTD_JOB_KEY)")
    return key


_counters = {}
_counters_lock = threading.Lock()

# Staging segments of save_state_dict, kept mapped between saves of this
# process: mapping a fresh segment (page tables for every page) costs as much
# as copying the state dict into it, and a training loop saves the same sizes
# again and again. Per (pid, socket, size) at most _KEEP_STAGING of them; one
# is reused once the save that used it is durable (its SaveFuture done, or a
# synchronous save returned). release_staging() closes them.
_KEEP_STAGING = 2
_staging_cache = {}  # (pid, socket, size) -> [[Segment, SaveFuture or None, in_use], ...]
_staging_lock = threading.Lock()


def _borrow_staging(client, size, name):
    """(segment, slot): a kept segment free for reuse, a new kept one, or (when
    _KEEP_STAGING are busy) a new one with slot None that the caller closes."""
    key = (os.getpid(), client.socket, size)
    with _staging_lock:
        slots = _staging_cache.setdefault(key, [])
        busy = [sl for sl in slots if not sl[2] and sl[1] is not None]
    for sl in busy:  # poll outside the lock (an RPC each)
        try:
            if sl[1].done():
                sl[1] = None
        except CkptdError:
            sl[1] = None  # the daemon forgot it (restarted): the bytes are not needed
    with _staging_lock:
        for sl in list(slots):
            if not sl[2] and sl[1] is None:
                if not _lease_alive(sl[0]):  # the daemon restarted: its arenas are gone
                    slots.remove(sl)
                    sl[0].close()
                    continue
                sl[2] = True
                return sl[0], sl
        keep = len(slots) < _KEEP_STAGING
    seg = client._staging(size, name)
    if not keep:
        return seg, None
    sl = [seg, None, True]
    with _staging_lock:
        slots.append(sl)
    return seg, sl


def _lease_alive(seg):
    """Whether a lent segment's lease connection is still open (a daemon that
    restarted closed it and no longer knows the arena); True for own memfds."""
    lease = getattr(seg, "_lease", None)
    if lease is None:
        return seg.fd >= 0
    try:
        return lease.recv(1, _socket.MSG_PEEK | _socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True  # nothing to read: open
    except OSError:
        return False


def _return_staging(sl, future, failed):
    with _staging_lock:
        for key, slots in list(_staging_cache.items()):
            if sl in slots:
                if failed:  # e.g. the daemon restarted and no longer knows the arena
                    slots.remove(sl)
                    sl[0].close()
                else:
                    sl[1], sl[2] = future, False
                return


def release_staging():
    """Closes the staging segments save_state_dict keeps between saves (those of
    saves still persisting stay with the daemon until they are durable)."""
    with _staging_lock:
        for slots in _staging_cache.values():
            for sl in slots:
                sl[0].close()
        _staging_cache.clear()


def base_job_id(world_size):
    """A job id every rank of the job derives alike from its environment.

    $CKPTD_JOB_ID; else torchrun's TORCHELASTIC_RUN_ID (unless "none") plus
    TORCHELASTIC_RESTART_COUNT; else SLURM_JOB_ID.SLURM_STEP_ID; else
    MASTER_ADDR:MASTER_PORT (plus the restart count). A single process
    (world_size 1) falls back to host and pid. None if nothing fits.
    """
    env = os.environ
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    suffix = f"-r{restart}" if restart else ""
    if env.get("CKPTD_JOB_ID"):
        return env["CKPTD_JOB_ID"]
    run = env.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return f"torchelastic-{run}{suffix}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}{suffix}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}{suffix}"
    if world_size == 1:
        return f"{_socket.gethostname()}-pid{os.getpid()}"
    return None


def resolve_job_id(job_id, kind, world_size):
    """`job_id` as given, else the base job id plus a per-process call count.

    Every rank makes the same sequence of load_state_dict / save_state_dict
    calls, so "<base>/load/<n>" names the n-th load alike on every rank and
    successive loads never join each other's job.
    """
    if job_id is not None:
        return str(job_id)
    base = base_job_id(world_size)
    if base is None:
        raise CkptdError(
            "INVALID_ARGUMENT",
            "cannot derive a job id that all ranks agree on: pass job_id=, or set CKPTD_JOB_ID "
            "(or run under torchrun / SLURM / with MASTER_ADDR and MASTER_PORT)")
    with _counters_lock:
        n = _counters.get((base, kind), 0)
        _counters[(base, kind)] = n + 1
    return f"{base}/{kind}/{n}"


# --- results ------------------------------------------------------------------

@dataclasses.dataclass
class LoadReport:
    """What a load_state_dict call did, for this rank."""
    job_id: str = ""
    retries: int = 0  # calls made again because the daemon went away or restarted
    missing_keys: list = dataclasses.field(default_factory=list)
    unexpected_keys: list = dataclasses.field(default_factory=list)
    renamed_keys: dict = dataclasses.field(default_factory=dict)
    skipped_keys: list = dataclasses.field(default_factory=list)  # non-tensor leaves
    bytes_read: int = 0            # from storage, whole job on this daemon
    bytes_from_cache: int = 0
    bytes_delivered: int = 0       # into this rank's tensors
    bytes_from_views: int = 0      # of them: copied here from the daemon's cache (cache_view)
    bytes_from_files: int = 0      # of them: read here from the checkpoint's files (cache_view)
    bytes_from_laid_out: int = 0   # of bytes_from_views: from the rank's laid-out copy (cache_view)
    job_bytes_delivered: int = 0
    checksums_verified: int = 0
    unique_id: int = 0
    format: str = ""
    local_fast_path: bool = False
    zero_copy: bool = False        # the daemon wrote the tensors themselves (no copy here)
    transport: str = ""            # the transport that carried the bytes (see load_state_dict)
    # key -> the transport that carried that tensor: with cuda_ipc, CPU
    # tensors, empty and non-contiguous ones go through "shm", and a tied
    # weight is "alias of KEY" (loaded once, through KEY)
    tensor_transports: dict = dataclasses.field(default_factory=dict)
    timings: dict = dataclasses.field(default_factory=dict)

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SavedItem:
    """Where a saved tensor went (format="pytorch-dcp"): bytes [offset, offset + length)
    of `file` in the checkpoint directory."""
    name: str
    file: str
    offset: int
    length: int


@dataclasses.dataclass
class SaveReport:
    job_id: str = ""
    retries: int = 0  # calls made again because the daemon went away or restarted
    unique_id: int = 0
    files: list = dataclasses.field(default_factory=list)  # data files holding this rank's shards
    items: list = dataclasses.field(default_factory=list)  # SavedItem, format="pytorch-dcp" only
    metadata_file: str = ""
    bytes_written: int = 0  # by the whole job
    skipped_keys: list = dataclasses.field(default_factory=list)
    zero_copy: bool = False
    timings: dict = dataclasses.field(default_factory=dict)
    # False in the report an async_save=True call returns (the daemon holds the
    # bytes, the version is not durable yet); True once it is (SaveFuture.result).
    persisted: bool = True
    stall_s: float = 0.0        # how long the call held the caller (async saves)
    buffer_wait_s: float = 0.0  # of which waiting for save_buffer room
    persist_s: float = 0.0      # the daemon's background write (files, fsyncs, metadata)
    bytes_staged: int = 0       # bytes the daemon held for the job
    # "cuda_ipc": the daemon copied this rank's CUDA tensors device -> host
    # itself (CPU tensors rode along in the same request); "shm": the client
    # copied every tensor into a shared-memory segment (or lent arena)
    transport: str = ""

    def as_dict(self):
        return dataclasses.asdict(self)


class SaveFuture(concurrent.futures.Future):
    """The outcome of save_state_dict(..., async_save=True): a
    concurrent.futures.Future, as DCP's async_save returns.

    The call returned once the daemon held a copy of this rank's bytes: the
    tensors may change from then on. The daemon writes the version in the
    background, even if this process exits; the version becomes visible only
    once it is durable. The future is done then: result() returns the
    SaveReport (files, bytes_written, persist_s) or raises the CkptdError that
    failed the save; add_done_callback() runs once it is done (on the waiting
    thread, or at once if already done). result(timeout) raises
    DeadlineExceededError (a TimeoutError, and so a
    concurrent.futures.TimeoutError) while it still persists.

    cancel() returns False: the future is running from the start, as the
    daemon persists a staged save whatever this process does. One thread per
    future waits on one connection to the daemon (AwaitSave, long waits), so
    polling opens nothing.

    `staged` is the report of the call itself (persisted False).
    """

    # How long one AwaitSave waits (the daemon caps it at max_barrier_timeout).
    _WAIT_S = 300.0

    def __init__(self, socket, report, rank):
        super().__init__()
        self._socket = socket
        self._rank = rank
        self.staged = report
        self.set_running_or_notify_cancel()  # cannot be cancelled: the daemon persists it
        threading.Thread(target=self._wait, daemon=True,
                         name=f"ckptd-await-{report.job_id}-{rank}").start()

    def _wait(self):
        try:
            with Client(self._socket) as c:
                while True:
                    req = c._pb2.AwaitSaveRequest(job_id=self.staged.job_id, rank=self._rank,
                                                 timeout_ms=int(self._WAIT_S * 1000))
                    try:
                        r = c._call("AwaitSave", req, self._WAIT_S + 30.0, retry=False)
                    except CkptdError as err:
                        if err.code == "DEADLINE_EXCEEDED":
                            continue  # still persisting
                        raise
                    break
        except BaseException as err:  # noqa: BLE001 - the future carries it
            self.set_exception(err)
            return
        rep = dataclasses.replace(self.staged)
        rep.files = list(r.files)
        rep.bytes_written = r.bytes_written
        rep.persisted = r.persisted
        rep.persist_s = r.persist_s
        rep.timings = {**rep.timings, "persist_s": r.persist_s,
                       "staged_to_durable_s": r.seconds}
        self.set_result(rep)

    def result(self, timeout=None):
        """The final SaveReport (persisted True). Raises the save's CkptdError, or
        DeadlineExceededError if it is still persisting after `timeout` s."""
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the save itself failed with a TimeoutError
            raise CkptdError("DEADLINE_EXCEEDED",
                             f"save job '{self.staged.job_id}' is still persisting after "
                             f"{timeout} s") from None

    def exception(self, timeout=None):
        """The CkptdError that failed the save, or None once it is durable; raises
        DeadlineExceededError if neither after `timeout` s."""
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise CkptdError("DEADLINE_EXCEEDED",
                             f"save job '{self.staged.job_id}' is still persisting after "
                             f"{timeout} s") from None


class _DtypeNamed:
    """`dtype` from the `dtype_name` field of a TensorInfo or ShardInfo."""

    @property
    def dtype(self):
        """torch's dtype when the program imported torch, else numpy's (None for
        BF16 and F8, which numpy lacks); dtype_name is the checkpoint's name."""
        return _tensors.dtype_of(self.dtype_name)


@dataclasses.dataclass
class ShardInfo(_DtypeNamed):
    file: str
    offset: tuple
    shape: tuple
    dtype_name: str  # the checkpoint's name: "BF16", "F32", ...
    flat_range: tuple  # or None
    replica_id: int
    data_offset: int
    nbytes: int


@dataclasses.dataclass
class TensorInfo(_DtypeNamed):
    name: str
    dtype_name: str  # the checkpoint's name: "BF16", "F32", ...
    global_shape: tuple
    bytes: int
    shards: list


@dataclasses.dataclass
class CheckpointInfo:
    path: str
    format: str
    unique_id: int
    versions: list
    tensors: dict  # name -> TensorInfo
    files: dict    # file -> bytes
    total_bytes: int


def _message_dict(msg):
    """A protobuf message as a dict of Python values: every field (defaults
    included), 64-bit integers as ints (protobuf's JSON form makes them strings),
    enums by name, nested messages and maps as dicts, repeated fields as lists."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value_field = f.message_type.fields_by_name["value"]
            out[f.name] = {k: (_message_dict(x) if value_field.message_type is not None else x)
                           for k, x in v.items()}
        elif f.label == f.LABEL_REPEATED:
            out[f.name] = [_field_value(f, x) for x in v]
        else:
            out[f.name] = _field_value(f, v)
    return out


def _field_value(f, v):
    if f.message_type is not None:
        return _message_dict(v)
    if f.enum_type is not None:
        return f.enum_type.values_by_number[v].name if v in f.enum_type.values_by_number else v
    return v


# --- the client -----------------------------------------------------------------

def client_api_level():
    """This client's API level (VERSION), or $CKPTD_TESTING_API_LEVEL: that
    variable is for tests of the version check only."""
    v = os.environ.get("CKPTD_TESTING_API_LEVEL", "")
    return int(v) if v.isdigit() and int(v) > 0 else _version.API_LEVEL


class _VersionCheckedStub:
    """A Client's gRPC stub: before its first RPC it asks the daemon its
    version once (the Version RPC) and refuses a daemon whose API level is
    below this client's with FAILED_PRECONDITION naming both. A daemon from
    before the Version RPC (UNIMPLEMENTED) counts as level 1. Any other error
    of that call is left to the RPC that follows, and the daemon is asked
    again before the next one."""

    def __init__(self, stub, pb2, grpc, target, timeout):
        self._stub, self._pb2, self._grpc = stub, pb2, grpc
        self._target, self._timeout = target, timeout
        self._lock = threading.Lock()
        self._daemon = None  # (description, api_level) once checked
        self._refused = None  # the mismatch message, once found

    def __getattr__(self, name):  # the RPC methods (Load, Status, ...)
        if self._daemon is None:
            self.check_version()
        return getattr(self._stub, name)

    def check_version(self):
        """(daemon description, its API level), or None when the daemon did
        not answer; raises CkptdError(FAILED_PRECONDITION) for an older daemon."""
        with self._lock:
            if self._refused is not None:
                raise CkptdError("FAILED_PRECONDITION", self._refused)
            if self._daemon is not None:
                return self._daemon
            try:
                r = self._stub.Version(self._pb2.VersionRequest(), timeout=self._timeout)
                daemon = (f"ckptd {r.release}" if r.release else r.version, r.api_level or 1)
            except self._grpc.RpcError as e:
                if e.code() != self._grpc.StatusCode.UNIMPLEMENTED:
                    return None
                daemon = ("a ckptd from before the Version RPC", 1)
            mine = client_api_level()
            if mine > daemon[1]:
                self._refused = (f"ckptd client {_version.__version__} (api {mine}) is newer than "
                                 f"the daemon at {self._target} ({daemon[0]}, api {daemon[1]}); "
                                 "upgrade the daemon")
                raise CkptdError("FAILED_PRECONDITION", self._refused)
            self._daemon = daemon
            return daemon


class Client:
    """A connection to one ckptd daemon.

    socket: the daemon's Unix socket (default $CKPTD_SOCKET, else
    /run/ckptd/ckptd.sock), or "host:port" with tcp=True (then only the
    stream transport can carry data). Fails fast with CkptdError(UNAVAILABLE)
    when no daemon listens there. connect_timeout bounds connecting to the
    Unix socket and handing over the shm fd. tls=(ca, cert, key), three PEM
    file paths, connects over TCP with mutual TLS (a daemon with tcp_tls_*).
    Before its first call the client asks the daemon its version, once: a
    daemon older than this client's API level is refused with
    CkptdError(FAILED_PRECONDITION) ("... upgrade the daemon").
    """

    def __init__(self, socket=None, *, tcp=False, connect_timeout=10.0, tls=None,
                 retry_timeout=None):
        import grpc
        self._grpc = grpc
        self._pb2, self._pb2_grpc = _proto.load_stubs()
        self.socket = socket or default_socket()
        self.tcp = tcp
        self.connect_timeout = connect_timeout
        self.retry_timeout = retry_budget(retry_timeout)
        self._tls = None
        if tls is not None:
            if not tcp:
                raise CkptdError("INVALID_ARGUMENT", "tls=(ca, cert, key) needs tcp=True")
            self._tls = tuple(open(p, "rb").read() for p in tls)
        if not tcp:
            self.socket = os.path.abspath(self.socket)
            try:
                _probe_unix(self.socket, connect_timeout)
            except CkptdError as err:
                if not (err.restart and self.retry_timeout > 0):
                    raise
                # The daemon may be restarting: the first call waits for it
                # (retry_timeout), as a call that finds it gone does.
        self._open()

    def _open(self):
        """The channel and the version-checked stub (again after a restart)."""
        grpc = self._grpc
        target = self.socket if self.tcp else "unix:" + self.socket
        # No channel_ready_future: it makes close() take 200 ms. Calls are made
        # without wait_for_ready, so a daemon that is gone fails them at once
        # with UNAVAILABLE.
        options = [
            ("grpc.max_receive_message_length", 256 << 20),
            ("grpc.max_send_message_length", 256 << 20),
        ]
        if self._tls is not None:
            ca, cert, key = self._tls
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                 certificate_chain=cert)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = _VersionCheckedStub(self._pb2_grpc.CkptdStub(self._channel), self._pb2,
                                         grpc, self.socket, self.connect_timeout or 10.0)

    def _reconnect(self):
        """A new connection for a call made again: gRPC's channel backs off its
        own reconnects (up to minutes), and a restarted daemon is a new one
        (its version is asked again)."""
        try:
            self._channel.close()
        except Exception:  # noqa: BLE001 - a channel already broken
            pass
        if not self.tcp:
            _probe_unix(self.socket, self.connect_timeout)  # fails fast while it is away
        self._open()

    def _retrying(self, timeout, attempt):
        """attempt(timeout left) until it succeeds or fails for another reason than
        the daemon being away or restarting (CkptdError.restart): then again on a
        new connection after a backoff with jitter (50 ms doubling to 2 s), for
        at most retry_timeout seconds and within `timeout`. Returns (result,
        retries)."""
        start = time.monotonic()
        end = None if timeout is None else start + timeout
        tries = 0
        while True:
            left = None if end is None else max(0.001, end - time.monotonic())
            try:
                if tries:
                    self._reconnect()
                return attempt(left), tries
            except CkptdError as err:
                if not err.restart:
                    raise
                spent = time.monotonic() - start
                room = self.retry_timeout - spent
                if end is not None:
                    room = min(room, end - time.monotonic())
                if room <= 0:
                    if self.retry_timeout <= 0:
                        raise
                    final = CkptdError(err.code, f"{err.message} (retried {tries} time(s) for "
                                       f"{spent:.1f} s: ckptd did not come back within "
                                       f"retry_timeout={self.retry_timeout:g} s)", err.grpc_code)
                    final.restart = True
                    raise final from None
                delay = min(2.0, 0.05 * (2 ** tries))
                time.sleep(min(room, random.uniform(delay / 2, delay)))
                tries += 1

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, what, request, timeout, retry=True):
        """Unary RPC `what`; made again after a restart unless retry=False."""
        def once(left):
            try:
                return getattr(self._stub, what)(request, timeout=left)
            except self._grpc.RpcError as e:
                raise from_rpc_error(e, what, self.socket, left) from None
        if not retry:
            return once(timeout)
        return self._retrying(timeout, once)[0]

    # -- admin --

    def inspect(self, path, *, unique_id=None, timeout=60.0):
        req = self._pb2.InspectRequest(path=_abs(path))
        if unique_id is not None:
            req.unique_id = int(unique_id)
        r = self._call("Inspect", req, timeout)
        tensors = {}
        for t in r.tensors:
            shards = [ShardInfo(s.file, tuple(s.offset), tuple(s.shape), s.dtype,
                                (s.flat_range.begin, s.flat_range.end)
                                if s.HasField("flat_range") else None,
                                s.replica_id, s.data_offset, s.nbytes) for s in t.shards]
            tensors[t.name] = TensorInfo(t.name, t.dtype, tuple(t.global_shape), t.bytes, shards)
        return CheckpointInfo(r.path, r.format, r.unique_id, list(r.versions), tensors,
                              dict(r.files), r.total_bytes)

    def read_checkpoint_file(self, path, file, offset=0, length=None, *, unique_id=None,
                             limit=256 << 20, timeout=60.0):
        """Bytes [offset, offset + length) of one of the checkpoint's own files (its
        metadata file or a data file its metadata names; to its end when length is
        None), read by the daemon: for files this process cannot open, as in object
        storage. At most `limit` bytes; asked for in pieces of 2 MiB."""
        piece, out, size, pos = 2 << 20, bytearray(), None, offset
        end = None if length is None else offset + length
        while True:
            n = piece if end is None else min(piece, end - pos)
            if n <= 0:
                break
            req = self._pb2.ReadCheckpointFileRequest(path=_abs(path), file=file, offset=pos,
                                                      length=n)
            if unique_id is not None:
                req.unique_id = int(unique_id)
            r = self._call("ReadCheckpointFile", req, timeout)
            if size is None:
                size = r.file_size
                if end is not None and end > size:
                    raise CkptdError("OUT_OF_RANGE", f"{path}/{file}: bytes [{offset}, {end}) "
                                     f"are outside the file's {size}")
                if (end if end is not None else size) - offset > limit:
                    raise CkptdError("RESOURCE_EXHAUSTED", f"{path}/{file}: "
                                     f"{(end or size) - offset} bytes, more than the {limit} "
                                     "allowed")
            elif r.file_size != size:
                raise CkptdError("ABORTED", f"{path}/{file}: the file changed while it was read")
            if len(r.data) != min(n, size - pos):
                raise CkptdError("DATA_LOSS", f"{path}/{file}: the daemon sent {len(r.data)} "
                                 f"bytes at {pos} of a {size}-byte file, asked for {n}")
            out += r.data
            pos += len(r.data)
            if pos >= size:
                break
        return bytes(out)

    def status(self, *, timeout=60.0):
        return _message_dict(self._call("Status", self._pb2.StatusRequest(), timeout))

    def prefetch(self, path, *, unique_id=None, tensors=(), timeout=600.0):
        req = self._pb2.PrefetchRequest(path=_abs(path), tensors=list(tensors))
        if unique_id is not None:
            req.unique_id = int(unique_id)
        return _message_dict(self._call("Prefetch", req, timeout))

    def evict(self, path, *, timeout=60.0):
        return _message_dict(self._call("Evict", self._pb2.EvictRequest(path=_abs(path)),
                                        timeout))

    # -- load / save --

    def _staging(self, size, name):
        """A segment for tensors outside any arena: borrowed from the daemon
        (kept mapped there across loads), or made here if it lends none."""
        try:
            return Segment(size, name, daemon=self.socket, timeout=self.connect_timeout)
        except CkptdError as err:
            if not _no_arena(err):
                raise
            return Segment(size, name)

    def _name_segment(self, shm, fd, size, token):
        """Fills ShmDestination: the arena's token, or a fresh fd token."""
        if token is not None:
            shm.arena_token = token
        else:
            shm.fd_token = send_fd(fd_socket_path(self.socket), fd, self.connect_timeout)
        shm.size = size

    def _targets(self, entries, offsets):
        out = []
        for e, off in zip(entries, offsets):
            t = self._pb2.Target(name=e.key, dtype=e.dtype, global_shape=list(e.global_shape),
                                offset=list(e.offset), shape=list(e.shape), dest_offset=off)
            if e.flat_range is not None:
                t.flat_range.begin, t.flat_range.end = e.flat_range
            out.append(t)
        return out

    def _device_targets(self, req, entries, dev, host):
        """Adds the targets of entries[i] for i in dev and host to a cuda_ipc request, in the
        entries' order: the dev ones inside their exported device allocations
        (req.cuda_ipc.buffers), the host ones marked dest_host at their offset in the host
        segment. Returns (the indices sent, {host index: offset}, the host segment's size)."""
        buffers, placements = _cuda.export([entries[i] for i in dev])
        host_offsets, size = _layout([entries[i] for i in host])
        where = {i: (False, b, off) for i, (b, off) in zip(dev, placements)}
        where.update({i: (True, 0, off) for i, off in zip(host, host_offsets)})
        sent = sorted(where)
        req.targets.extend(self._targets([entries[i] for i in sent], [where[i][2] for i in sent]))
        for t, i in zip(req.targets, sent):
            t.dest_host, t.dest_buffer = where[i][0], where[i][1]
        for b in buffers:
            req.cuda_ipc.buffers.add(**b)
        return sent, dict(zip(host, host_offsets)), size

    def load_state_dict(self, state_dict, path, *, rank=None, world_size=None, job_id=None,
                        unique_id=None, timeout=600.0, strict=True, node_ranks=None,
                        barrier_timeout=None, verify=True, transport="auto", progress=None,
                        aoa=None, job_key=None):
        """See ckptd.load_state_dict. Made again, the same job, when the daemon
        went away or restarted (retry_timeout)."""
        rank, world_size, node_ranks, job_id, job_key = _resolve_job(
            "load", rank, world_size, node_ranks, job_id, job_key)
        report, retries = self._retrying(timeout, lambda left: self._load_once(
            state_dict, path, rank=rank, world_size=world_size, job_id=job_id,
            unique_id=unique_id, timeout=left, strict=strict, node_ranks=node_ranks,
            barrier_timeout=barrier_timeout, verify=verify, transport=transport,
            progress=progress, aoa=aoa, job_key=job_key))
        report.retries = retries
        return report

    def _load_once(self, state_dict, path, *, rank, world_size, job_id, unique_id, timeout,
                   strict, node_ranks, barrier_timeout, verify, transport, progress, aoa,
                   job_key):
        t0 = time.perf_counter()
        entries, skipped = flatten(state_dict)
        if transport == "auto":
            # See "Transports" in docs/grpc-api.md: the first that applies; a
            # refusal before the job registered sends the same job id over shm.
            transport, first, refused = "shm", None, None
            if any(_cuda.is_cuda_entry(e) and e.nbytes for e in entries):
                # CPU leaves (an optimizer's step), aliases and empty tensors
                # ride along in the request's host segment (see _cuda.split).
                first, refused = "cuda_ipc", _cuda.fallback_ok
            elif (not self.tcp and self.socket not in _PROCESS_MEMORY_REFUSED
                  and _arena_placement(entries)[0] is None and _process_memory_fits(entries)):
                first, refused = "cache_view", _process_memory_refused
            if first is not None:
                try:
                    return self._load_once(
                        state_dict, path, rank=rank, world_size=world_size, job_id=job_id,
                        unique_id=unique_id, timeout=timeout, strict=strict,
                        node_ranks=node_ranks, barrier_timeout=barrier_timeout, verify=verify,
                        transport=first, progress=progress, aoa=aoa, job_key=job_key)
                except CkptdError as err:
                    if not refused(err):
                        raise
                    if first == "cache_view":  # another uid: remember it
                        _PROCESS_MEMORY_REFUSED.add(self.socket)
        for e in entries:
            if e.array is not None and not e.array.flags.writeable:
                raise CkptdError("INVALID_ARGUMENT", f"'{e.key}': the numpy array is read-only")
        req = self._pb2.LoadRequest(job_id=job_id, rank=rank, world_size=world_size,
                                   path=_abs(path), node_ranks=node_ranks, strict=bool(strict),
                                   skip_verify=not verify, job_key=job_key)
        if unique_id is not None:
            req.unique_id = int(unique_id)
        if aoa:
            req.aoa_config = aoa if isinstance(aoa, str) else "\n".join(aoa)
        if barrier_timeout is not None:
            req.barrier_timeout_ms = max(1, int(barrier_timeout * 1000))
        report = LoadReport(job_id=job_id, skipped_keys=skipped)
        alias_of = {}  # cuda_ipc: tied key -> the key it is loaded through
        seg = staging = None
        timings = {}
        copy_out = None  # (entry, offset) filled here from the segment after the load
        try:
            if transport == "shm":
                if self.tcp:
                    raise CkptdError("INVALID_ARGUMENT", "transport='shm' needs a Unix socket; "
                                     "use transport='stream' over TCP")
                arena, offsets = _arena_placement(entries)
                t1 = time.perf_counter()
                if arena is not None:
                    report.zero_copy = True
                    self._name_segment(req.shm, arena.fd, arena.size, arena.daemon_token)
                else:
                    offsets, size = _layout(entries)
                    seg = self._staging(size, f"ckptd-load-{rank}")
                    self._name_segment(req.shm, seg.fd, seg.size, seg.token)
                timings["client_send_fd_s"] = time.perf_counter() - t1
                req.targets.extend(self._targets(entries, offsets))
            elif transport in ("process_memory", "cache_view"):
                if self.tcp:
                    raise CkptdError("INVALID_ARGUMENT", f"transport='{transport}' needs the "
                                     "daemon of this node (its Unix socket)")
                offsets = []
                for e in entries:
                    addr, contiguous = e.address()
                    if addr is None or not contiguous:
                        raise CkptdError("INVALID_ARGUMENT", f"'{e.key}': transport='{transport}'"
                                         " needs contiguous CPU tensors or arrays")
                    offsets.append(addr)
                t1 = time.perf_counter()
                _populate(entries, offsets)
                timings["client_populate_s"] = time.perf_counter() - t1
                # The daemon reads this cookie from our memory before it
                # writes anything: proof that the connection's pid is us.
                cookie = os.urandom(16)
                cookie_buf = ctypes.create_string_buffer(cookie, len(cookie))
                req.process_memory.cookie = cookie
                req.process_memory.cookie_address = ctypes.addressof(cookie_buf)
                # cache_view: the bytes the daemon's cache holds are copied
                # here, from read-only views of its cache (_views.py).
                req.process_memory.views = transport == "cache_view"
                # ... and reads bytes its cache does not hold from the files.
                req.process_memory.file_views = transport == "cache_view"
                # ... in batches while the job runs (copies overlap its reads).
                req.process_memory.view_batches = transport == "cache_view"
                req.targets.extend(self._targets(entries, offsets))
                report.zero_copy = True  # the daemon writes the tensors themselves
            elif transport == "cuda_ipc":
                if self.tcp:
                    raise CkptdError("INVALID_ARGUMENT", "transport='cuda_ipc' needs the daemon of "
                                     "this node (its Unix socket)")
                dev, host, aliases = _cuda.split(entries)
                if not dev:
                    raise CkptdError("INVALID_ARGUMENT", "transport='cuda_ipc' needs contiguous "
                                     "torch CUDA tensors; this state dict has none with data")
                # An alias is not sent: it is loaded through its first key.
                sent, host_at, size = self._device_targets(req, entries, dev, host)
                if host:
                    t1 = time.perf_counter()
                    seg = self._staging(size, f"ckptd-load-{rank}")
                    self._name_segment(req.cuda_ipc.host, seg.fd, seg.size, seg.token)
                    timings["client_send_fd_s"] = time.perf_counter() - t1
                report.tensor_transports = {
                    entries[i].key: ("shm" if i in host_at else "cuda_ipc") for i in sent}
                for i, j in aliases.items():
                    report.tensor_transports[entries[i].key] = f"alias of {entries[j].key}"
                alias_of = {entries[i].key: entries[j].key for i, j in aliases.items()}
                copy_out = [(entries[i], off) for i, off in host_at.items()]
                entries = [entries[i] for i in sent]
                offsets = [t.dest_offset for t in req.targets]
                report.zero_copy = not host  # the daemon wrote every tensor itself
            elif transport == "stream":
                offsets, size = _layout(entries)
                staging = np.empty(max(size, 1), dtype=np.uint8)
                req.targets.extend(self._targets(entries, offsets))
                req.stream.SetInParent()
            else:
                raise CkptdError("INVALID_ARGUMENT", "transport must be 'auto', 'cache_view', "
                                 "'process_memory', 'shm', 'stream' or 'cuda_ipc', not "
                                 f"{transport!r}")
            timings["client_prepare_s"] = time.perf_counter() - t0

            t1 = time.perf_counter()
            result = None
            view_keys = set()  # of every batch of views (kept mapped for the next load)
            call = self._stub.Load(req, timeout=timeout)
            try:
                for ev in call:
                    kind = ev.WhichOneof("event")
                    if kind == "data":
                        c = ev.data
                        if c.target >= len(entries) or \
                                c.offset + len(c.data) > entries[c.target].nbytes:
                            call.cancel()
                            raise CkptdError("DATA_LOSS",
                                             "Load: the daemon streamed a chunk outside the tensors")
                        start = offsets[c.target] + c.offset
                        staging[start:start + len(c.data)] = np.frombuffer(c.data, np.uint8)
                        continue
                    if kind == "views":
                        if transport != "cache_view":  # offsets are not addresses then
                            call.cancel()
                            raise CkptdError("DATA_LOSS", "Load: the daemon sent cache views "
                                             "this load did not ask for")
                        t2 = time.perf_counter()
                        _views.copy_views(fd_socket_path(self.socket), ev.views,
                                          [(a, e.nbytes) for e, a in zip(entries, offsets)],
                                          self.connect_timeout)
                        view_keys.update(ev.views.view_keys)
                        timings["client_view_copy_s"] = (timings.get("client_view_copy_s", 0.0)
                                                         + time.perf_counter() - t2)
                        timings["client_view_batches"] = timings.get("client_view_batches", 0) + 1
                        continue
                    if kind == "result":
                        result = ev.result
                    if progress is not None:
                        progress(ev)
            except self._grpc.RpcError as e:
                # The daemon sends the result last, after every byte was
                # delivered, and then only ends the call: a connection lost
                # after it (ckptd exiting right after a drained job) loses
                # nothing.
                if result is None or e.code() != self._grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, "Load", self.socket, timeout) from None
            except BaseException:
                call.cancel()
                raise
            finally:
                if view_keys:
                    _views.keep(view_keys)
            if result is None:
                raise CkptdError("DATA_LOSS", "Load: the daemon ended the stream without a result")
            timings["client_rpc_s"] = time.perf_counter() - t1

            missing = set(result.missing_keys)
            t1 = time.perf_counter()
            if copy_out is None and not report.zero_copy:
                copy_out = list(zip(entries, offsets))
            if copy_out:
                buf = seg.u8 if seg is not None else staging
                for e, off in copy_out:
                    if e.key not in missing:
                        e.fill_from(buf[off:off + e.nbytes])
                del buf
            timings["client_copy_out_s"] = time.perf_counter() - t1
        finally:
            if seg is not None:
                seg.close()
        if transport == "cache_view":
            if result.bytes_from_views or result.bytes_from_files:
                report.zero_copy = False  # this process copied those bytes
            else:
                transport = "process_memory"  # nothing was cached (or an older daemon)
        report.transport = transport
        if not report.tensor_transports:
            report.tensor_transports = {e.key: transport for e in entries}
        report.missing_keys = list(result.missing_keys)
        report.missing_keys += [k for k, j in alias_of.items() if j in missing]
        report.unexpected_keys = list(result.unexpected_keys)
        report.renamed_keys = dict(result.renamed_keys)
        for f in ("bytes_read", "bytes_from_cache", "bytes_delivered", "job_bytes_delivered",
                  "checksums_verified", "unique_id", "format", "local_fast_path",
                  "bytes_from_views", "bytes_from_files", "bytes_from_laid_out"):
            setattr(report, f, getattr(result, f))
        tm = result.timings
        report.timings = {"list_s": tm.list_s, "plan_s": tm.plan_s, "read_s": tm.read_s,
                          "copy_s": tm.copy_s, "wait_s": tm.wait_s, "daemon_total_s": tm.total_s,
                          **timings, "total_s": time.perf_counter() - t0}
        return report

    def save_state_dict(self, state_dict, path, *, rank=None, world_size=None, unique_id=None,
                        job_id=None, timeout=600.0, node_ranks=None, barrier_timeout=None,
                        overwrite=False, async_save=False, job_key=None):
        """See ckptd.save_state_dict. Made again, the same job, when the daemon
        went away or restarted before it answered (retry_timeout): the tensors
        are still the caller's then. An asynchronous save's future is not
        retried: once staged, the bytes were the daemon's."""
        rank, world_size, node_ranks, job_id, job_key = _resolve_job(
            "save", rank, world_size, node_ranks, job_id, job_key)
        out, retries = self._retrying(timeout, lambda left: self._save(
            state_dict, path, rank=rank, world_size=world_size, unique_id=unique_id,
            job_id=job_id, timeout=left, node_ranks=node_ranks, barrier_timeout=barrier_timeout,
            overwrite=overwrite, async_save=async_save, job_key=job_key))
        (out.staged if isinstance(out, SaveFuture) else out).retries = retries
        return out

    def _save(self, state_dict, path, *, rank, world_size, unique_id, job_id, timeout,
              node_ranks, barrier_timeout, overwrite, async_save, job_key, fmt="",
              raw_keys=(), device_ok=True):
        """save_state_dict, and the data files of a PyTorch DCP save (fmt="pytorch-dcp",
        with raw_keys, the keys of whole 1-D uint8 arrays written as they are:
        ckptd.dcp.DaemonStorageWriter's, committed by commit_dcp_metadata).
        The job's names arrive resolved (_resolve_job). device_ok=False: CUDA
        tensors are copied here, not by the daemon."""
        t0 = time.perf_counter()
        if self.tcp:
            raise CkptdError("INVALID_ARGUMENT", "save_state_dict needs the daemon's Unix socket")
        entries, skipped = flatten(state_dict)
        path = _abs(path)
        # unique_id=None: the daemon picks the version (one more than the newest
        # there, visible or persisting; the same for every rank of the job; on
        # several daemons the largest any of them proposes). The response says.
        pick = unique_id is None and not fmt
        req = self._pb2.SaveRequest(job_id=job_id, rank=rank, world_size=world_size, path=path,
                                    unique_id=0 if pick or fmt else int(unique_id),
                                    next_unique_id=pick, node_ranks=node_ranks,
                                    overwrite=bool(overwrite), format=fmt,
                                    raw_targets=list(raw_keys), async_save=bool(async_save),
                                    job_key=job_key)
        if barrier_timeout is not None:
            req.barrier_timeout_ms = max(1, int(barrier_timeout * 1000))
        for e in entries:
            if len(e.path) > 1:
                req.flat_mapping[e.key].parts.extend(e.path)
        report = SaveReport(job_id=job_id, unique_id=-1 if pick or fmt else int(unique_id),
                            skipped_keys=skipped)
        timings = {}
        seg = slot = None
        future = None
        device = None
        try:
            arena, offsets = _arena_placement(entries)
            if (arena is None and device_ok and not fmt and self.socket not in _CUDA_SAVE_REFUSED
                    and any(_cuda.is_cuda_entry(e) and e.nbytes for e in entries)):
                device = _cuda.split(entries)
            if device is not None:
                # The daemon copies the CUDA tensors device -> host itself (at
                # the copy engines' speed, into its pinned memory); the other
                # entries, and a tied key's second name (the daemon refuses two
                # targets on one device range), come in the host segment.
                dev, host, aliases = device
                host = sorted(host + list(aliases))
                _, host_at, size = self._device_targets(req, entries, dev, host)
                if host:
                    seg, slot = _borrow_staging(self, size, f"ckptd-save-{rank}")
                    for i, off in host_at.items():
                        entries[i].copy_to(seg.u8[off:off + entries[i].nbytes])
                report.transport = "cuda_ipc"
                timings["client_prepare_s"] = time.perf_counter() - t0
                if seg is not None:
                    t1 = time.perf_counter()
                    self._name_segment(req.cuda_ipc.host, seg.fd, seg.size, seg.token)
                    timings["client_send_fd_s"] = time.perf_counter() - t1
            elif arena is not None:
                fd, size, token = arena.fd, arena.size, arena.daemon_token
                report.zero_copy = True
            else:
                offsets, size = _layout(entries)
                seg, slot = _borrow_staging(self, size, f"ckptd-save-{rank}")
                fd, size, token = seg.fd, seg.size, seg.token
                for e, off in zip(entries, offsets):
                    e.copy_to(seg.u8[off:off + e.nbytes])
                # This copy is the save's own: the daemon may keep it instead of
                # copying it (nothing here writes it again before the save is
                # durable: _borrow_staging reuses it only then).
                req.handed_over = bool(async_save)
            if device is None:
                report.transport = "shm"
                req.targets.extend(self._targets(entries, offsets))
                timings["client_prepare_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                self._name_segment(req.shm, fd, size, token)
                timings["client_send_fd_s"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            try:
                r = self._call("Save", req, timeout, retry=False)
            except CkptdError as err:
                if device is None or not _cuda.fallback_ok(err):
                    raise
                # This daemon cannot read device memory (built without CUDA, no
                # device, memory not exportable): the client copies instead.
                # Refused before the job registered, so the same job id is free.
                _CUDA_SAVE_REFUSED.add(self.socket)
                retry = True
            else:
                retry = False
            if retry:
                if slot is not None:
                    _return_staging(slot, None, failed=True)
                    slot = seg = None
                return self._save(
                    state_dict, path, rank=rank, world_size=world_size, unique_id=unique_id,
                    job_id=job_id, timeout=timeout, node_ranks=node_ranks,
                    barrier_timeout=barrier_timeout, overwrite=overwrite, async_save=async_save,
                    job_key=job_key, fmt=fmt, raw_keys=raw_keys, device_ok=False)
            timings["client_rpc_s"] = time.perf_counter() - t1
            if async_save:
                future = SaveFuture(self.socket, report, rank)
        except BaseException:
            if slot is not None:
                _return_staging(slot, None, failed=True)
                slot = seg = None
            raise
        finally:
            if slot is not None:
                _return_staging(slot, future, failed=False)
            elif seg is not None:
                seg.close()
        report.files = list(r.files)
        report.items = [SavedItem(i.name, i.file, i.offset, i.length) for i in r.items]
        report.metadata_file = r.metadata_file
        if pick:
            report.unique_id = r.unique_id
        report.bytes_written = r.bytes_written
        report.timings = {"daemon_s": r.seconds, **timings, "total_s": time.perf_counter() - t0}
        report.persisted = r.persisted
        report.buffer_wait_s = r.buffer_wait_s
        report.bytes_staged = r.bytes_staged
        report.stall_s = report.timings["total_s"]
        if future is not None:
            return future
        return report


    def commit_dcp_metadata(self, path, metadata, job_id, *, overwrite=False, timeout=600.0):
        """Commits a PyTorch DCP checkpoint whose data files the format="pytorch-dcp" save
        job `job_id` wrote into `path`: `metadata` is its pickled DCP Metadata, which the
        daemon checks against the files before writing it as `.metadata` (atomic,
        durable). FAILED_PRECONDITION if another save wrote there since."""
        req = self._pb2.SaveRequest(job_id=job_id, rank=0, world_size=1,
                                   path=_abs(path), format="pytorch-dcp",
                                   dcp_metadata=bytes(metadata), overwrite=bool(overwrite))
        return self._call("Save", req, timeout, retry=False).metadata_file


# How long a call made again after the daemon went away may take in all
# (Client(retry_timeout=...), else $CKPTD_RETRY_TIMEOUT, else this): a rolling
# update of the daemon takes its drain plus a few seconds of start-up.
DEFAULT_RETRY_TIMEOUT = 60.0


def retry_budget(value=None):
    """The retry budget in seconds: `value`, else $CKPTD_RETRY_TIMEOUT, else
    DEFAULT_RETRY_TIMEOUT; 0 turns retries off."""
    if value is None:
        env = os.environ.get("CKPTD_RETRY_TIMEOUT", "")
        if not env:
            return DEFAULT_RETRY_TIMEOUT
        value = env
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = -1.0
    if not out >= 0:
        raise CkptdError("INVALID_ARGUMENT", f"retry_timeout {value!r} is not a number of seconds "
                         ">= 0 (CKPTD_RETRY_TIMEOUT)")
    return out


def _resolve_job(kind, rank, world_size, node_ranks, job_id, job_key):
    """What a load or save call names its job by, resolved once for all its tries."""
    rank, world_size, node_ranks = resolve_ranks(rank, world_size, node_ranks)
    return (rank, world_size, node_ranks, resolve_job_id(job_id, kind, world_size),
            resolve_job_key(job_key, world_size, node_ranks))


def _abs(path):
    """A checkpoint path as the daemon gets it: absolute, or a URL (s3://bucket/prefix) as is."""
    path = os.fspath(path)
    if isinstance(path, str) and "://" in path:
        return path
    return os.path.abspath(path)


def _probe_unix(path, timeout=10.0):
    """Fails fast (no gRPC retries) when nothing listens on the Unix socket."""
    hint = ("is the daemon running? start it with `ckptd --socket PATH --root DIR`, or pass "
            "socket= / set CKPTD_SOCKET")
    if len(path.encode()) >= 108:
        raise CkptdError("INVALID_ARGUMENT",
                         f"{path}: socket path too long (Unix socket paths must be < 108 bytes)")
    try:
        os.stat(path)
    except PermissionError:
        raise _socket_permission_denied(path) from None
    except OSError:
        raise daemon_gone(f"no ckptd socket at {path} ({hint})") from None
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(path)
    except PermissionError:
        raise _socket_permission_denied(path) from None
    except OSError as e:
        raise daemon_gone(f"cannot connect to ckptd at {path}: {e.strerror or e} ({hint})") \
            from None
    finally:
        s.close()


def _socket_permission_denied(path):
    """PERMISSION_DENIED for a socket this process may not open, naming its owner,
    group and mode and the group to join (as the C++ client says it)."""
    try:
        st = os.stat(path)
    except OSError:
        return CkptdError("PERMISSION_DENIED",
                          f"cannot connect to ckptd at {path}: permission denied on a directory "
                          f"above the socket (uid {os.getuid()} may not search it); ask the admin "
                          "for access")
    import grp
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return CkptdError("PERMISSION_DENIED",
                      f"cannot connect to ckptd at {path}: permission denied (the socket is uid "
                      f"{st.st_uid}, group '{group}', mode {st.st_mode & 0o7777:04o}; this process "
                      f"is uid {os.getuid()}): join group '{group}' (`usermod -aG {group} USER`, "
                      "then log in again) or ask the admin (docs/security.md)")


def _layout(entries):
    """Offsets of the entries in a fresh segment (64-byte aligned), and its size."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos = align(pos + e.nbytes)
    return offsets, pos


def _no_arena(err):
    """Whether a refused arena request should fall back to a local memfd."""
    return err.code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")


_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = os.sysconf("SC_PAGE_SIZE")
_HUGE = 2 << 20  # x86-64's transparent huge page
# At most this many ranges get the huge-page advice per load: each splits its
# mapping (up to two more entries against the process's vm.max_map_count).
_MAX_HUGE_RANGES = 4096
_libc = None


def _populate(entries, addresses):
    """Faults the tensors' pages in (writable) before the daemon writes them.

    process_vm_writev into pages never touched faults them in one at a time
    under this process's mmap lock, with the daemon's I/O threads queueing
    on it (0.2-0.5 GB/s measured); one madvise(MADV_POPULATE_WRITE) maps them
    at first-touch speed. Only the runs of pages mincore says are not in
    memory are populated: a model's tensors usually are, and populating them
    again costs a page-table walk through every page (11 ms per 512 MiB
    against 0.5 ms for mincore on the dev VM). Contents are unchanged. Best
    effort: a kernel or mapping without it leaves the faults to the daemon's
    writes.

    Fresh memory (pages not there yet) inside a tensor is first advised to
    be backed by transparent huge pages (MADV_HUGEPAGE on its whole 2 MiB
    pages, never past the tensor's own bytes) where the kernel leaves THP to
    madvise: a fault then maps 2 MiB instead of 4 KiB, and populating a fresh
    tensor runs near memory bandwidth (9-11 GB/s against 0.4-3.5 GB/s for
    512 MiB on the dev VM). Only as many bytes are advised as half of the
    node's free memory in blocks of 2 MiB or more (/proc/buddyinfo): a huge
    page beyond that would be made by compaction, which with THP defrag
    "madvise" stalls the fault (0.07-1.3 s per 512 MiB measured on a
    fragmented node). CKPTD_HUGE_PAGES=0 leaves the advice out."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    huge_left, huge_bytes = 0, 0
    if os.environ.get("CKPTD_HUGE_PAGES", "1") != "0":
        huge_left, huge_bytes = _MAX_HUGE_RANGES, _huge_blocks_free() // 2
    for e, addr in zip(entries, addresses):
        if e.nbytes < _PAGE:
            continue
        start = addr - addr % _PAGE
        end = addr + e.nbytes
        for a, b in _absent_runs(start, end):
            ha = -(-max(a, addr) // _HUGE) * _HUGE  # never before the tensor's first byte
            hb = min(b, ha + huge_bytes) // _HUGE * _HUGE
            if huge_left and hb > ha:
                huge_left -= 1
                huge_bytes -= hb - ha
                _libc.madvise(ha, hb - ha, _MADV_HUGEPAGE)  # a hint: EINVAL (no THP) is fine
            if _libc.madvise(a, b - a, _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL (old kernel, special mapping): stop trying


def _huge_blocks_free():
    """Bytes of free memory in blocks of 2 MiB or more, every zone
    (/proc/buddyinfo: per zone, the free blocks of 4 KiB << order for orders
    0 to 10); 0 where it cannot be read."""
    total = 0
    try:
        with open("/proc/buddyinfo") as f:
            for line in f:
                counts = line.split()[4:]
                for order, n in enumerate(counts):
                    if _PAGE << order >= _HUGE:
                        total += int(n) * (_PAGE << order)
    except (OSError, ValueError):
        return 0
    return total


def _absent_runs(start, end):
    """The runs [a, b) of pages in [start, end) (page-aligned start) that are
    not in memory, by mincore; the whole range when mincore fails."""
    pages = (end - start + _PAGE - 1) // _PAGE
    vec = np.zeros(pages, np.uint8)
    if _libc.mincore(start, end - start, vec.ctypes.data) != 0:
        return [(start, end)]
    absent = np.flatnonzero(np.diff(np.concatenate(([1], vec & 1, [1]))))
    return [(start + int(a) * _PAGE, min(end, start + int(b) * _PAGE))
            for a, b in zip(absent[0::2], absent[1::2])]


# Daemons (by socket) that refused process_memory: this process uses shm there.
_PROCESS_MEMORY_REFUSED = set()
# Sockets of daemons that refused a device save (no CUDA there): later saves
# through them copy on the client side at once.
_CUDA_SAVE_REFUSED = set()


def _process_memory_fits(entries):
    """Whether every entry is contiguous CPU memory and no two overlap (tied
    weights sharing storage go over shm, where each gets its own copy)."""
    spans = []
    for e in entries:
        addr, contiguous = e.address()
        if addr is None or not contiguous:
            return False
        if e.nbytes:
            spans.append((addr, addr + e.nbytes))
    spans.sort()
    return all(spans[i][0] >= spans[i - 1][1] for i in range(1, len(spans)))


def _process_memory_refused(err):
    """Whether a process_memory failure means "not permitted here" (refused
    before the job registered), so transport="auto" may use shm."""
    return err.code == "FAILED_PRECONDITION" and "process_memory" in err.message


def _arena_placement(entries):
    """(arena, offsets) when every entry is contiguous in one SharedArena."""
    if not entries:
        return None, None
    arena, offsets = None, []
    for e in entries:
        addr, contiguous = e.address()
        if addr is None or not contiguous:
            return None, None
        a, off = find_arena(addr, e.nbytes)
        if a is None or (arena is not None and a is not arena):
            return None, None
        arena = a
        offsets.append(off)
    return arena, offsets


# --- module-level API -----------------------------------------------------------

def load_state_dict(state_dict, path, *, rank=None, world_size=None, job_id=None, unique_id=None,
                    socket=None, timeout=600.0, strict=True, node_ranks=None,
                    barrier_timeout=None, verify=True, transport="auto", progress=None,
                    aoa=None, job_key=None, retry_timeout=None):
    """Fills the tensors of `state_dict` in place from checkpoint `path`, through ckptd.

    state_dict: a dict (nested dicts are flattened with "."; int keys become
      strings) of numpy arrays, torch CPU tensors (whole tensors) or
      ShardedTensor (a rank's part of a tensor). Other leaves are skipped
      (report.skipped_keys).
    path: checkpoint directory (native ckptd or HuggingFace), inside one of
      the daemon's roots; relative paths are made absolute here.
    rank, world_size: default from RANK / WORLD_SIZE (LOCAL_RANK) in the
      environment. Every rank of the job calls load_state_dict; the daemon
      plans the job once and reads each byte range once.
    job_id: names the job on the daemon; the same on every rank. Default:
      derived from the environment (see base_job_id) plus a per-process count.
    unique_id: checkpoint version; default the newest.
    socket: the daemon's Unix socket; default $CKPTD_SOCKET or
      /run/ckptd/ckptd.sock.
    timeout: seconds for the whole call (waiting for the other ranks included).
    strict: (default True, as torch's Module.load_state_dict) a key of
      `state_dict` the checkpoint lacks fails the load with NotFoundError (a
      FileNotFoundError) naming the first few and how many, and nothing of
      this rank is reported as loaded. strict=False loads the rest and reports
      the absent keys in report.missing_keys, their tensors left untouched.
    aoa: tensor transformations applied while resharding (docs/aoa.md):
      the statements as one string or a list of lines; every rank passes the
      same.
    job_key: the job's shared secret (16 to 64 bytes, str or bytes; the same on
      every rank), sent to this node's daemon only: a job spanning several
      daemons needs one (docs/security.md, "Job keys"). Default
      $CKPTD_JOB_KEY, else (multi-node, torch.distributed initialised) one
      rank 0 draws and broadcasts once per process (resolve_job_key).
    retry_timeout: when the daemon is away or restarting (UNAVAILABLE: not
      running yet, a rolling update, a drain that ended the job), the call is
      made again, the same job, on a new connection, with backoff and jitter,
      for at most this many seconds (default $CKPTD_RETRY_TIMEOUT, else 60; 0:
      never) and within `timeout`; report.retries counts them.

    transport: how the bytes reach the tensors (report.transport says which
      did). "auto" (default) tries, in order:
      "cuda_ipc" when every tensor is a contiguous torch CUDA tensor: the
        daemon (built with CUDA) copies straight into their device memory;
      "shm" into a SharedArena when every tensor lies in one: filled in place;
      "cache_view" when every tensor is contiguous CPU memory and none
        overlaps another, on the daemon of this process's uid: bytes the
        daemon's data cache holds are copied by this process from read-only
        mappings of the cache (one copy, made in every rank at once); bytes
        it does not hold and has nothing to verify or convert in are read
        by this process from the checkpoint's files itself with pread
        (report.bytes_from_files; the daemon caches them afterwards); the
        rest the daemon writes as with "process_memory"; the report says
        "process_memory" when no byte came either way
        (report.bytes_from_views, report.bytes_from_files);
      "process_memory": the daemon writes the tensors themselves with
        process_vm_writev (one copy, no segment). The kernel allows it when
        the daemon runs as this process's uid (or has CAP_SYS_PTRACE);
      "shm": the daemon writes a memfd segment shared with this process and
        the values are copied from there into the tensors.
      "auto" moves on to "shm" when the daemon refuses cuda_ipc or
      cache_view (process_memory) before the load starts. "stream": the bytes come back in
      the gRPC stream (also over TCP).

    Returns a LoadReport. Raises CkptdError.
    """
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.load_state_dict(state_dict, path, rank=rank, world_size=world_size,
                                 job_id=job_id, unique_id=unique_id, timeout=timeout,
                                 strict=strict, node_ranks=node_ranks,
                                 barrier_timeout=barrier_timeout, verify=verify,
                                 transport=transport, progress=progress, aoa=aoa,
                                 job_key=job_key)


def commit_dcp_metadata(path, metadata, job_id, *, overwrite=False, socket=None, timeout=600.0):
    """See Client.commit_dcp_metadata (ckptd.dcp.DaemonStorageWriter's commit)."""
    with Client(socket) as c:
        return c.commit_dcp_metadata(path, metadata, job_id, overwrite=overwrite,
                                     timeout=timeout)


def save_state_dict(state_dict, path, *, rank=None, world_size=None, unique_id=None, job_id=None,
                    socket=None, timeout=600.0, node_ranks=None, barrier_timeout=None,
                    overwrite=False, async_save=False, job_key=None, retry_timeout=None):
    """Saves `state_dict` (as for load_state_dict) as version `unique_id` of `path`.

    Every rank of the job calls it with its own part; when all have, the
    daemon writes the native format once: one data file per rank, tensors held
    by several ranks (same box) written once, then {unique_id}.metadata.
    unique_id: default None, the daemon picks one more than the newest version
    in `path`, visible or still persisting (0 if none), the same for every rank
    (on several daemons the largest any node's directory asks for); the report
    (or the future's result) says which. An existing version is
    ALREADY_EXISTS unless `overwrite` (every rank must pass the same).
    Returns a SaveReport. Raises CkptdError.

    async_save=True (every rank must pass the same) returns a SaveFuture as soon
    as the daemon holds a copy of every rank's bytes: training may change the
    tensors from then on while the daemon writes the version in the background
    (report.stall_s: how long the call held this rank). The version becomes
    visible only once durable; SaveFuture.result() waits for that. Staged bytes
    count against the daemon's save_buffer; when it is full the call waits for
    earlier saves (report.buffer_wait_s). See docs/saving.md.
    job_key: as for load_state_dict (multi-node saves).
    retry_timeout: as for load_state_dict; a save is made again only until the
      daemon answered (for async_save, until it staged the bytes).
    """
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.save_state_dict(state_dict, path, rank=rank, world_size=world_size,
                                 unique_id=unique_id, job_id=job_id, timeout=timeout,
                                 node_ranks=node_ranks, barrier_timeout=barrier_timeout,
                                 overwrite=overwrite, async_save=async_save,
                                 job_key=job_key)


def inspect(path, *, unique_id=None, socket=None, timeout=60.0, retry_timeout=None):
    """Tensors, shards, files and versions of a checkpoint (CheckpointInfo), via the daemon."""
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.inspect(path, unique_id=unique_id, timeout=timeout)


def status(*, socket=None, timeout=60.0, retry_timeout=None):
    """The daemon's Status as a dict (jobs, cache, totals)."""
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.status(timeout=timeout)


def prefetch(path, *, unique_id=None, tensors=(), socket=None, timeout=600.0,
             retry_timeout=None):
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.prefetch(path, unique_id=unique_id, tensors=tensors, timeout=timeout)


def evict(path, *, socket=None, timeout=60.0, retry_timeout=None):
    with Client(socket, retry_timeout=retry_timeout) as c:
        return c.evict(path, timeout=timeout)


# --- merge (ckptctl) --------------------------------------------------------------

def find_ckptctl(ckptctl=None):
    """The ckptctl binary: argument, $CKPTCTL, PATH, else bazel-bin/client/ckptctl
    of the source tree holding this package (or of the current directory)."""
    cands = [ckptctl, os.environ.get("CKPTCTL"), shutil.which("ckptctl")]
    d = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _ in range(6):
        cands.append(os.path.join(d, "bazel-bin", "client", "ckptctl"))
        cands.append(os.path.join(d, "client", "ckptctl"))  # Bazel runfiles
        d = os.path.dirname(d)
    cands.append(os.path.join(os.getcwd(), "bazel-bin", "client", "ckptctl"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise CkptdError("FAILED_PRECONDITION",
                     "ckptctl not found: build it with `bazel build //client:ckptctl`, put it on "
                     "PATH, set $CKPTCTL or pass ckptctl=")


def merge(path, out, *, prefix=None, skip_postfix=(), shards=None, unique_id=None, threads=None,
          ckptctl=None, timeout=None):
    """Merges checkpoint `path` into HuggingFace safetensors files in `out`.

    Runs `ckptctl merge` (offline, in its own process; no daemon involved), so
    the result is exactly ckptctl's: model-{i:05d}-of-{N:05d}.safetensors plus
    model.safetensors.index.json. prefix keeps keys starting with it (and
    strips "prefix."), skip_postfix drops keys ending with any of the given
    suffixes, shards splits the keys over that many files. Returns ckptctl's
    JSON report as a dict ({"files", "total_size", "tensors"}).
    """
    argv = [find_ckptctl(ckptctl), "merge", _abs(path), "--out", _abs(out), "--json"]
    if prefix:
        argv += ["--prefix", prefix]
    if isinstance(skip_postfix, str):
        skip_postfix = [skip_postfix]
    if skip_postfix:
        argv += ["--skip_postfix", ",".join(skip_postfix)]
    if shards is not None:
        argv += ["--shards", str(int(shards))]
    if unique_id is not None:
        argv += ["--unique_id", str(int(unique_id))]
    if threads is not None:
        argv += ["--threads", str(int(threads))]
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CkptdError("DEADLINE_EXCEEDED", f"ckptctl merge took longer than {timeout} s") \
            from None
    if p.returncode != 0:
        err = p.stderr.strip().splitlines()
        line = err[-1] if err else f"ckptctl exited with {p.returncode}"
        m = re.search(r"\[([A-Z_]+)\]\s*$", line)
        code = m.group(1) if m else ("INVALID_ARGUMENT" if p.returncode == 2 else "UNKNOWN")
        msg = re.sub(r"^ckptctl: error: ", "", line)
        msg = re.sub(r"\s*\[[A-Z_]+\]\s*$", "", msg)
        raise CkptdError(code, msg)
    return json.loads(p.stdout)
