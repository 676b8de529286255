"""PyTorch Distributed Checkpoint (DCP) integration: a StorageReader backed by ckptd.

    import torch.distributed.checkpoint as dcp          # torch 1.13: torch.distributed._shard.checkpoint
    from ckptd.torch import DaemonStorageReader
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
import socket as _socket
import uuid

import torch

from . import _dcp_compat
from . import client as _client
from ._tensors import ShardedTensor
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

# ckptd dtype names -> torch dtypes (only those this torch has).
_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def _torch_dtype(name):
    return getattr(torch, _TORCH_DTYPES.get(name, ""), None)


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
    than one daemon (a multi-node job)."""
    job_id = f"dcp-{uuid.uuid4().hex}"
    members = [i for i, p in enumerate(plans) if p.storage_data[key]]
    rank_of = {i: r for r, i in enumerate(members)}
    nodes = [plans[i].storage_data["node"] for i in members]
    out = []
    for i, p in enumerate(plans):
        sd = {"job_id": job_id, "world_size": len(members), "rank": rank_of.get(i)}
        if i in rank_of and len(set(nodes)) > 1:
            node = p.storage_data["node"]
            sd["node_ranks"] = [r for r, n in enumerate(nodes) if n == node]
        out.append(dataclasses.replace(p, storage_data=sd))
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`: classes of torch.distributed's checkpoint modules,
    torch.Size, torch's dtype / layout / memory-format constants, the layout lookup
    torch pickles layouts with, enum members and OrderedDict only."""

    # Classes of torch.distributed.checkpoint.metadata / .filesystem and their
    # torch 1.13 places (torch.distributed._shard.checkpoint.*, and
    # sharded_tensor.metadata for TensorProperties), nothing else of torch.
    _MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
    _LEAVES = ("metadata", "filesystem")

    def find_class(self, module, name):
        if (module, name) in (("collections", "OrderedDict"), ("torch.serialization", "_get_layout")):
            return super().find_class(module, name)  # _get_layout: a layout by its name
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how Python 3.11 pickles an enum member
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout,
                                                     torch.memory_format)):
                return obj
        elif module.startswith(self._MODULES) and module.rsplit(".", 1)[1] in self._LEAVES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise CkptdError("DATA_LOSS", f"the DCP metadata refers to {module}.{name}, which is "
                         "not a checkpoint metadata class")


class DaemonStorageReader(_st.StorageReader):
    """A DCP StorageReader whose reads the node's ckptd does.

    path: the checkpoint directory, inside one of the daemon's roots.
    socket: the daemon's Unix socket (default $CKPTD_SOCKET, else /run/ckptd/ckptd.sock).
    unique_id: checkpoint version (ckptd's own format); default the newest.
    timeout, barrier_timeout, verify, transport, aoa: as for ckptd.load_state_dict.

    After a load, `last_report` holds this rank's ckptd.LoadReport (None on ranks that
    read no tensor).
    """

    def __init__(self, path, socket=None, *, unique_id=None, timeout=600.0,
                 barrier_timeout=None, verify=True, transport="auto", aoa=None):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.socket = os.path.abspath(socket or _client.default_socket())
        self.unique_id = unique_id
        self.timeout = timeout
        self.barrier_timeout = barrier_timeout
        self.verify = verify
        self.transport = transport
        self.aoa = aoa
        self.last_report = None
        self._info = None      # ckptd.CheckpointInfo of the checkpoint read_metadata saw
        self._metadata = None  # the DCP Metadata read_metadata returned
        self._bytes = {}       # MetadataIndex -> storage info of a DCP bytes entry

    # --- DCP's StorageReader protocol (torch 1.13 and 2.x names) ------------------

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self._info = self._metadata = None
        self._bytes = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False  # only used when DCP picks a reader itself: never pick this one

    def read_metadata(self):
        with _client.Client(self.socket) as c:
            info = c.inspect(self.path, unique_id=self.unique_id, timeout=min(self.timeout, 60.0))
        sd_md, storage = {}, {}
        for name, t in info.tensors.items():
            size = torch.Size(t.global_shape)
            props = _TensorProperties(dtype=_torch_dtype(t.dtype) or torch.get_default_dtype())
            sd_md[name] = _md.TensorStorageMetadata(
                properties=props, size=size,
                chunks=[_md.ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])
        planner_data = None
        if info.format == "pytorch-dcp":
            own = self._dcp_metadata(info)
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
            if fqn in seen and seen[fqn] != item.dest_index:
                raise CkptdError(
                    "INVALID_ARGUMENT",
                    f"'{fqn}': this rank holds more than one shard of it; ckptd loads one box "
                    "per tensor per rank (use one local shard per tensor)")
            seen[fqn] = item.dest_index
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
                transport=self.transport, aoa=self.aoa)
        for item, dest, buf in pending:
            if buf is not dest:
                dest.copy_(buf)
            planner.commit_tensor(item, dest)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    # --- helpers ------------------------------------------------------------------

    def _dcp_metadata(self, info):
        """The checkpoint's own DCP Metadata (for its bytes entries), unpickled with
        only DCP's metadata classes allowed (DCP's own reader runs any pickle)."""
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except CkptdError as e:
            raise CkptdError(e.code, f"{path}: {e.message}") from None
        except Exception as e:  # a corrupt pickle raises nearly anything
            raise CkptdError("DATA_LOSS", f"{path}: cannot read the DCP metadata: "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(md, _md.Metadata):
            raise CkptdError("DATA_LOSS", f"{path}: holds a {type(md).__name__}, not a DCP Metadata")
        return md

    def _read_bytes(self, index):
        where = self._bytes[index]
        if getattr(where, "transform_descriptors", None):
            raise CkptdError("UNIMPLEMENTED", f"'{index.fqn}': bytes entry stored with "
                             f"transforms {where.transform_descriptors}")
        path = os.path.join(self.path, where.relative_path)
        try:
            with open(path, "rb") as f:
                f.seek(where.offset)
                data = f.read(where.length)
        except OSError as e:
            raise CkptdError("NOT_FOUND", f"{path}: bytes entry '{index.fqn}': {e}") from None
        if len(data) != where.length:
            raise CkptdError("DATA_LOSS", f"{path}: bytes entry '{index.fqn}' is truncated "
                             f"({len(data)} of {where.length} bytes at offset {where.offset})")
        return data


class DaemonStorageWriter(_st.StorageWriter):
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
        self.path = os.path.abspath(os.fspath(path))
        self.socket = os.path.abspath(socket or _client.default_socket())
        self.overwrite = bool(overwrite)
        self.timeout = timeout
        self.barrier_timeout = barrier_timeout
        self.last_report = None

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False

    def init(self, is_coordinator):  # torch 1.13
        pass

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):  # torch >= 2.0
        pass

    def storage_meta(self):  # torch >= 2.4 asks; nothing to add
        return None

    def prepare_local_plan(self, plan):
        seen = {}
        for item in plan.items:
            fqn = item.index.fqn
            if fqn in seen:
                raise CkptdError(
                    "INVALID_ARGUMENT",
                    f"'{fqn}': this rank writes more than one item of it; ckptd saves one box "
                    "per tensor per rank (use one local shard per tensor)")
            seen[fqn] = item
        return dataclasses.replace(plan, storage_data={"node": _node(self.socket),
                                                       "items": bool(seen)})

    def prepare_global_plan(self, plans):
        return _assign_job(plans, "items")

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
            with _client.Client(self.socket) as c:
                self.last_report = c.save_state_dict(
                    state, self.path, rank=sd["rank"], world_size=sd["world_size"],
                    node_ranks=sd.get("node_ranks", []), job_id=sd["job_id"], unique_id=0,
                    timeout=self.timeout, barrier_timeout=self.barrier_timeout,
                    overwrite=self.overwrite, format="pytorch-dcp", raw_keys=raw)
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
        _client.commit_dcp_metadata(self.path, pickle.dumps(metadata), overwrite=self.overwrite,
                                    socket=self.socket, timeout=min(self.timeout, 600.0))
