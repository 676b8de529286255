"""PyTorch Distributed Checkpoint (DCP) integration: a StorageReader backed by ckptd.

    import torch.distributed.checkpoint as dcp          # torch 1.13: torch.distributed._shard.checkpoint
    from ckptd.dcp import DaemonStorageReader
    dcp.load_state_dict(state_dict, storage_reader=DaemonStorageReader("/data/ckpt/step1000"))

A training script keeps its DCP `load_state_dict` call (plain tensors, ShardedTensors,
a process group or `no_dist=True`) and swaps only the reader. DCP still plans; the node's
ckptd does the reads: every rank's read items become the targets of one ckptd job, so
each byte is read once per node, restarts are served from the daemon's cache, and any
format ckptd knows can be loaded (its own, PyTorch DCP, Paddle, HuggingFace safetensors).

How DCP's steps map onto ckptd (see docs/torch.md):
- read_metadata: the daemon's Inspect of the checkpoint, as a DCP Metadata with one
  chunk per tensor covering the whole tensor (ckptd reshards from whatever shards the
  checkpoint really holds, so DCP's planner need not know them). For a DCP checkpoint,
  its non-tensor (bytes) entries are added from its own `.metadata`.
- prepare_local_plan: checks every read item ckptd will serve, so a request ckptd
  cannot serve fails on every rank before any rank waits at the daemon.
- prepare_global_plan (coordinator): names the job (one id for all ranks), numbers the
  ranks that read tensors, and groups them by node (host and daemon socket).
- read_data: one `ckptd.load_state_dict` call per rank with the read items as targets,
  delivered straight into the tensors DCP resolves (through a staging copy only for a
  non-contiguous destination).

Bytes entries (non-tensor values DCP stored with torch.save, such as an optimizer's
step count) are small and have no ckptd counterpart: they are read by the rank itself
from the checkpoint's files, as DCP's FileSystemReader reads them. Whatever else DCP
asks that ckptd cannot serve is a CkptdError naming the tensor, never a silent fallback.
"""
import dataclasses
import enum
import io
import os
import pickle
import secrets
import socket as _socket
import stat
import uuid

import torch

from . import _dcp_compat
from . import client as _client
from ._tensors import ShardedTensor, torch_dtype
from .errors import CkptdError

try:  # torch >= 2.0
    from torch.distributed.checkpoint import metadata as _md
    from torch.distributed.checkpoint import planner as _pl
    from torch.distributed.checkpoint import storage as _st
except ImportError:  # torch 1.13
    _dcp_compat.install()
    from torch.distributed._shard.checkpoint import metadata as _md
    from torch.distributed._shard.checkpoint import planner as _pl
    from torch.distributed._shard.checkpoint import storage as _st

try:
    from torch.distributed.checkpoint.metadata import TensorProperties as _TensorProperties
except ImportError:
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as _TensorProperties
try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:
    from torch.distributed._shard.checkpoint.filesystem import _StorageInfo

__all__ = ["DaemonStorageReader", "DaemonStorageWriter"]

def _enum_member(cls, name):
    """getattr(cls, name), only for a member of an Enum class (the unpickler allows
    only checkpoint metadata classes to reach here)."""
    if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise CkptdError("DATA_LOSS", f"the DCP metadata asks for attribute {name!r} of {cls!r}, "
                     "which is not an enum member")


def _node(socket):
    """Names the daemon a rank talks to: its host and socket."""
    return f"{_socket.gethostname()}:{socket}"


def _assign_job(plans, key):
    """The coordinator's part for a reader or writer: one ckptd job id for every rank,
    ckptd ranks numbered over the plans whose storage_data[key] is true (ranks with
    nothing to move stay out of the job), and node_ranks when the ranks talk to more
    than one daemon (a multi-node job) with a fresh job key, which DCP hands each rank
    over the job's process group with its plan: the daemons prove with it that their
    ranks belong to the job (docs/security.md, "Job keys")."""
    job_id = f"dcp-{uuid.uuid4().hex}"
    members = [i for i, p in enumerate(plans) if p.storage_data[key]]
    rank_of = {i: r for r, i in enumerate(members)}
    nodes = [plans[i].storage_data["node"] for i in members]
    job_key = secrets.token_hex(32) if len(set(nodes)) > 1 else None
    out = []
    for i, p in enumerate(plans):
        sd = {"job_id": job_id, "world_size": len(members), "rank": rank_of.get(i)}
        if i in rank_of and job_key is not None:
            node = p.storage_data["node"]
            sd["node_ranks"] = [r for r, n in enumerate(nodes) if n == node]
            sd["job_key"] = job_key
        out.append(dataclasses.replace(p, storage_data=sd))
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` with an exact allow-list, the one ckptd's own reader
    uses (core/format/foreign.cc): DCP's metadata classes by (module, name), torch.Size, torch's
    dtype / layout / memory-format constants, the layout lookup torch pickles layouts
    with, enum members, OrderedDict and pathlib paths. Nothing else resolves: no dotted
    names (protocol 4 would follow them to any attribute), no functions."""

    _DCP_MODULES = ("torch.distributed.checkpoint.metadata",
                    "torch.distributed._shard.checkpoint.metadata",
                    "torch.distributed.checkpoint.filesystem",
                    "torch.distributed._shard.checkpoint.filesystem",
                    "torch.distributed._shard.sharded_tensor.metadata")
    _DCP_NAMES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                  "ChunkStorageMetadata", "MetadataIndex", "TensorProperties",
                  "MEM_FORMAT_ENCODING", "StorageMeta", "_StorageInfo")
    _OTHERS = {("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}

    def find_class(self, module, name):
        if "." not in name:
            if (module, name) == ("builtins", "getattr"):
                return _enum_member  # how Python 3.11 pickles an enum member
            if (module, name) in self._OTHERS:
                return super().find_class(module, name)
            if module == "torch":
                obj = getattr(torch, name, None)
                if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout,
                                                         torch.memory_format)):
                    return obj
            elif module in self._DCP_MODULES and name in self._DCP_NAMES:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise CkptdError("DATA_LOSS", f"the DCP metadata refers to {module}.{name}, which is "
                         "not a checkpoint metadata class")


# What a bytes entry's torch.save pickle may name: torch.load runs exactly these, all
# harmless (tensors, storages, containers, numbers, dtypes, numpy scalars). torch 1.13's
# own weights_only=True cannot be used instead: it refuses every float.
_PLAIN_GLOBALS = {
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"), ("torch", "UntypedStorage"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "complex"), ("_codecs", "encode"),
    ("numpy.core.multiarray", "scalar"), ("numpy", "dtype"),
}


class _PlainPickleChecker(pickle.Unpickler):
    """Walks a pickle without building anything real: a global outside
    _PLAIN_GLOBALS (or torch's storage classes and dtypes) raises."""

    def find_class(self, module, name):
        ok = (module, name) in _PLAIN_GLOBALS or (
            module == "torch" and "." not in name and
            (name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise pickle.UnpicklingError(f"refers to {module}.{name}")
        return _inert

    def persistent_load(self, pid):
        return None


def _inert(*args, **kwargs):
    return None


def _check_plain_save(data):
    """Raises unless `data` (a torch.save archive) only holds plain values and tensors."""
    import zipfile
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkls = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise pickle.UnpicklingError("not a torch.save archive (no <name>/data.pkl)")
        _PlainPickleChecker(io.BytesIO(z.read(pkls[0]))).load()


# Largest DCP .metadata the client reads (the daemon has limits.max_metadata_bytes).
_MAX_METADATA_BYTES = 256 << 20


def _read_plain_file(dir_path, name, offset, length, what, limit, socket=None):
    """Bytes [offset, offset + length) of file `name` in `dir_path`: a plain name (no
    '/', not '.' or '..'), no symlink, a regular file (no FIFO to hang on), the range
    inside the file and at most `limit` bytes. In object storage (an s3:// path),
    whose credentials only the daemon holds, the daemon at `socket` reads it (one
    of the checkpoint's own files only)."""
    if "://" in dir_path:
        with _client.Client(socket) as c:
            try:
                return c.read_checkpoint_file(dir_path, name, offset or 0, length,
                                              limit=limit)
            except CkptdError as e:
                raise CkptdError(e.code, f"{what}: {e.message}") from None
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
        raise CkptdError("DATA_LOSS", f"{dir_path}: {what}: {name!r} is not a file name in "
                         "the checkpoint directory")
    path = os.path.join(dir_path, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CkptdError("NOT_FOUND", f"{path}: {what}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CkptdError("DATA_LOSS", f"{path}: {what}: not a regular file")
        if length is None:
            offset, length = 0, st.st_size
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise CkptdError("DATA_LOSS", f"{path}: {what}: bytes [{offset}, {offset + length}) "
                             f"are outside the file's {st.st_size}")
        if length > limit:
            raise CkptdError("RESOURCE_EXHAUSTED", f"{path}: {what}: {length} bytes, more than "
                             f"the {limit} allowed")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CkptdError("DATA_LOSS", f"{path}: {what}: read {len(data)} of {length} bytes "
                             "(the file shrank)")
        return data
    finally:
        os.close(fd)


class _DaemonStorage:
    """What DaemonStorageReader and DaemonStorageWriter share: where the checkpoint
    is, which daemon does the work, the deadlines, and ckptd's one-box-per-tensor rule."""

    def _setup(self, path, socket, timeout, barrier_timeout):
        self.path = _client._abs(path)
        self.socket = os.path.abspath(socket or _client.default_socket())
        self.timeout = timeout
        self.barrier_timeout = barrier_timeout
        self.last_report = None

    def _set_checkpoint_id(self, checkpoint_id):
        if checkpoint_id is not None:
            self.path = _client._abs(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False  # only used when DCP picks a storage itself: never pick this one

    @staticmethod
    def _one_box(seen, fqn, key, does):
        """Records `key` (what this rank holds of `fqn`), refusing a second one:
        ckptd moves one box per tensor per rank."""
        if fqn in seen and seen[fqn] != key:
            raise CkptdError(
                "INVALID_ARGUMENT",
                f"'{fqn}': this rank {does} more than one shard of it; ckptd moves one box "
                "per tensor per rank (use one local shard per tensor)")
        seen[fqn] = key


class DaemonStorageReader(_DaemonStorage, _st.StorageReader):
    """A DCP StorageReader whose reads the node's ckptd does.

    path: the checkpoint directory, inside one of the daemon's roots.
    socket: the daemon's Unix socket (default $CKPTD_SOCKET, else /run/ckptd/ckptd.sock).
    unique_id: checkpoint version (ckptd's own format); default the newest.
    timeout, barrier_timeout, verify, transport, aoa: as for ckptd.load_state_dict.
    allow_pickle: DCP loads a checkpoint's bytes entries (non-tensor values) with
      torch.load, full pickle. By default an entry whose pickle names anything but plain
      values, containers, tensors, dtypes and numpy scalars fails the load, naming it;
      True lets any pickle through, as DCP's own reader does (only for checkpoints you
      trust).

    After a load, `last_report` holds this rank's ckptd.LoadReport (None on ranks that
    read no tensor).
    """

    def __init__(self, path, socket=None, *, unique_id=None, timeout=600.0,
                 barrier_timeout=None, verify=True, transport="auto", aoa=None,
                 allow_pickle=False):
        super().__init__()
        self._setup(path, socket, timeout, barrier_timeout)
        self.allow_pickle = bool(allow_pickle)
        self.unique_id = unique_id
        self.verify = verify
        self.transport = transport
        self.aoa = aoa
        self._info = None      # ckptd.CheckpointInfo of the checkpoint read_metadata saw
        self._metadata = None  # the DCP Metadata read_metadata returned
        self._bytes = {}       # MetadataIndex -> storage info of a DCP bytes entry

    # --- DCP's StorageReader protocol (torch 1.13 and 2.x names) ------------------

    def reset(self, checkpoint_id=None):
        self._set_checkpoint_id(checkpoint_id)
        self._info = self._metadata = None
        self._bytes = {}

    def read_metadata(self):
        with _client.Client(self.socket) as c:
            info = c.inspect(self.path, unique_id=self.unique_id, timeout=min(self.timeout, 60.0))
        sd_md, storage = {}, {}
        for name, t in info.tensors.items():
            size = torch.Size(t.global_shape)
            props = _TensorProperties(dtype=torch_dtype(t.dtype_name, torch) or torch.get_default_dtype())
            sd_md[name] = _md.TensorStorageMetadata(
                properties=props, size=size,
                chunks=[_md.ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
        planner_data = None
        if info.format == "pytorch-dcp":
            own = self._dcp_metadata()
            planner_data = own.planner_data
            for fqn, md in own.state_dict_metadata.items():
                if isinstance(md, _md.BytesStorageMetadata) and fqn not in sd_md:
                    sd_md[fqn] = md
            for index, where in (own.storage_data or {}).items():
                if isinstance(sd_md.get(index.fqn), _md.BytesStorageMetadata):
                    storage[index] = where
        self._info, self._bytes = info, storage
        self._metadata = _md.Metadata(state_dict_metadata=sd_md, planner_data=planner_data)
        return self._metadata

    def init(self, metadata, is_coordinator):  # torch 1.13
        self._metadata = metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):  # torch >= 2.0
        self._metadata = metadata

    def prepare_local_plan(self, plan):
        seen = {}
        for item in plan.items:
            if item.type != _pl.LoadItemType.TENSOR:
                if item.storage_index not in self._bytes:
                    raise CkptdError("NOT_FOUND", f"{self.path}: '{item.storage_index.fqn}' is "
                                     "not a bytes entry of the checkpoint's DCP metadata")
                continue
            fqn = item.storage_index.fqn
            if fqn not in self._info.tensors:
                raise CkptdError("NOT_FOUND", f"{self.path}: the checkpoint has no tensor '{fqn}'")
            self._one_box(seen, fqn, item.dest_index, "holds")
        return dataclasses.replace(plan, storage_data={"node": _node(self.socket),
                                                       "tensors": bool(seen)})

    def prepare_global_plan(self, plans):
        return _assign_job(plans, "tensors")

    def read_data(self, plan, planner):
        sd = plan.storage_data
        state, pending = {}, []
        for item in plan.items:
            if item.type != _pl.LoadItemType.TENSOR:
                planner.load_bytes(item, io.BytesIO(self._read_bytes(item.storage_index)))
                continue
            fqn = item.storage_index.fqn
            lookup = getattr(planner, "lookup_tensor", None)  # DCP's default planners
            whole = lookup(item.dest_index) if lookup is not None else None
            if whole is not None and tuple(whole.shape) != tuple(item.lengths):
                # DCP would fill only the overlap and leave the rest as it was.
                raise CkptdError(
                    "INVALID_ARGUMENT",
                    f"'{fqn}': this rank's tensor of shape {tuple(whole.shape)} (at offset "
                    f"{tuple(item.dest_index.offset or ())}) does not fit the checkpoint's "
                    f"{tuple(self._info.tensors[fqn].global_shape)}")
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != tuple(item.lengths):
                raise CkptdError("INVALID_ARGUMENT", f"'{fqn}': the planner resolved a tensor "
                                 f"of shape {tuple(dest.shape)} for a read of {tuple(item.lengths)}")
            chunk = item.storage_index.offset or [0] * len(item.lengths)
            offset = [int(c) + int(s) for c, s in zip(chunk, item.storage_offsets)]
            buf = dest if dest.is_contiguous() else torch.empty(dest.shape, dtype=dest.dtype,
                                                                  device=dest.device)
            state[fqn] = ShardedTensor(buf, self._info.tensors[fqn].global_shape, offset,
                                       local_shape=tuple(item.lengths))
            pending.append((item, dest, buf))
        if sd["rank"] is not None:
            uid = self._info.unique_id if self._info.format == "ckptd" else None
            self.last_report = _client.load_state_dict(
                state, self.path, rank=sd["rank"], world_size=sd["world_size"],
                node_ranks=sd.get("node_ranks", []), job_id=sd["job_id"], unique_id=uid,
                socket=self.socket, timeout=self.timeout, strict=True,
                barrier_timeout=self.barrier_timeout, verify=self.verify,
                transport=self.transport, aoa=self.aoa, job_key=sd.get("job_key"))
        for item, dest, buf in pending:
            if buf is not dest:
                dest.copy_(buf)
            planner.commit_tensor(item, dest)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    # --- helpers ------------------------------------------------------------------

    def _dcp_metadata(self):
        """The checkpoint's own DCP Metadata (for its bytes entries), unpickled with
        only DCP's metadata classes allowed (DCP's own reader runs any pickle)."""
        path = os.path.join(self.path, ".metadata")
        raw = _read_plain_file(self.path, ".metadata", 0, None, "DCP metadata",
                               _MAX_METADATA_BYTES, self.socket)
        try:
            md = _MetadataUnpickler(io.BytesIO(raw)).load()
        except CkptdError as e:
            raise CkptdError(e.code, f"{path}: {e.message}") from None
        except Exception as e:  # a corrupt pickle raises nearly anything
            raise CkptdError("DATA_LOSS", f"{path}: cannot read the DCP metadata: "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(md, _md.Metadata):
            raise CkptdError("DATA_LOSS", f"{path}: holds a {type(md).__name__}, not a DCP Metadata")
        return md

    def _read_bytes(self, index):
        """A bytes entry's bytes, checked: DCP's planner torch.load()s them with full
        pickle, so unless allow_pickle their pickle may name only harmless globals
        (_PLAIN_GLOBALS: nothing in them can run code)."""
        where = self._bytes[index]
        what = f"bytes entry '{index.fqn}'"
        if getattr(where, "transform_descriptors", None):
            raise CkptdError("UNIMPLEMENTED", f"{self.path}: {what} is stored with transforms "
                             f"{where.transform_descriptors}")
        data = _read_plain_file(self.path, where.relative_path, int(where.offset),
                                int(where.length), what, _MAX_METADATA_BYTES, self.socket)
        if not self.allow_pickle:
            try:
                _check_plain_save(data)
            except Exception as e:  # noqa: BLE001 (a corrupt entry raises nearly anything)
                raise CkptdError(
                    "FAILED_PRECONDITION",
                    f"{self.path}: {what} holds objects other than plain values and tensors, "
                    "which loading would run as code; pass allow_pickle=True to "
                    f"DaemonStorageReader if you trust this checkpoint ({type(e).__name__}: "
                    f"{str(e)[:200]})") from None
        return data


class DaemonStorageWriter(_DaemonStorage, _st.StorageWriter):
    """A DCP StorageWriter whose writes the node's ckptd does.

    The checkpoint it produces is a PyTorch DCP checkpoint: DCP's own FileSystemReader
    reads it, and so does ckptd (DaemonStorageReader, ckptd.load_state_dict, ckptctl).
    Every rank's write items become the targets of one ckptd save job: the daemon
    writes each rank's data file (`__{rank}_0.distcp`, every tensor a torch.save
    archive; written to a temp name, fsynced, renamed, the directory fsynced) and says
    where each item went. The coordinator then hands the pickled DCP Metadata to the
    daemon, which reads the whole checkpoint back through it (every item located and
    parsed, every tensor covered) before writing `.metadata`, atomically and durably:
    the commit point. A save that fails or dies before that leaves no `.metadata`
    (with `overwrite`, the old one is removed first), so no half checkpoint is visible.

    path: the output directory (created), inside one of the daemon's roots.
    socket: the daemon's Unix socket (default $CKPTD_SOCKET, else /run/ckptd/ckptd.sock).
    overwrite: replace a checkpoint already in `path` (else ALREADY_EXISTS).
    timeout, barrier_timeout: as for ckptd.save_state_dict.

    Tensors must be on the CPU (a GPU tensor is copied to the host first). After a
    save, `last_report` holds this rank's ckptd.SaveReport.
    """

    def __init__(self, path, socket=None, *, overwrite=False, timeout=600.0,
                 barrier_timeout=None):
        super().__init__()
        self._setup(path, socket, timeout, barrier_timeout)
        self.overwrite = bool(overwrite)
        self._job_id = None

    def reset(self, checkpoint_id=None):
        self._set_checkpoint_id(checkpoint_id)

    def init(self, is_coordinator):  # torch 1.13
        pass

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):  # torch >= 2.0
        pass

    def storage_meta(self):  # torch >= 2.4 asks; nothing to add
        return None

    def prepare_local_plan(self, plan):
        seen = {}
        for item in plan.items:
            self._one_box(seen, item.index.fqn, item.index, "writes")
        return dataclasses.replace(plan, storage_data={"node": _node(self.socket),
                                                       "items": bool(seen)})

    def prepare_global_plan(self, plans):
        plans = _assign_job(plans, "items")
        self._job_id = plans[0].storage_data["job_id"]  # the coordinator commits it
        return plans

    def write_data(self, plan, planner):
        import numpy as np
        sd = plan.storage_data
        state, raw = {}, []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == _pl.WriteItemType.BYTE_IO:
                blob = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                state[fqn] = ShardedTensor(blob, (blob.size,), (0,))
                raw.append(fqn)
                continue
            t = data.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            td = item.tensor_data
            state[fqn] = ShardedTensor(t.contiguous(), tuple(td.size), tuple(td.chunk.offsets))
        results = []
        if sd["rank"] is not None:
            rank, world_size, node_ranks, job_id, job_key = _client._resolve_job(
                "save", sd["rank"], sd["world_size"], sd.get("node_ranks", []), sd["job_id"],
                sd.get("job_key"))
            with _client.Client(self.socket) as c:
                self.last_report = c._save(
                    state, self.path, rank=rank, world_size=world_size, node_ranks=node_ranks,
                    job_id=job_id, unique_id=0, timeout=self.timeout,
                    barrier_timeout=self.barrier_timeout, overwrite=self.overwrite,
                    async_save=False, job_key=job_key, fmt="pytorch-dcp", raw_keys=raw)
            where = {it.name: it for it in self.last_report.items}
            for item in plan.items:
                it = where.get(item.index.fqn)
                if it is None:
                    continue  # a replica another rank wrote (its result names the same index)
                results.append(_st.WriteResult(
                    index=item.index, size_in_bytes=it.length,
                    storage_data=_StorageInfo(it.file, it.offset, it.length)))
        fut = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        storage = {}
        for per_rank in results:
            for wr in per_rank:
                storage[wr.index] = wr.storage_data
        metadata.storage_data = storage
        _client.commit_dcp_metadata(self.path, pickle.dumps(metadata), self._job_id,
                                    overwrite=self.overwrite, socket=self.socket,
                                    timeout=min(self.timeout, 600.0))
