"""torch CUDA tensors as ckptd destinations (LoadRequest.cuda_ipc).

The daemon (built with --config=cuda, on the same node) opens the exported
allocations once per job and copies every slice host -> device itself, so
the bytes never pass through this process. Each tensor's allocation is found
and exported with the CUDA driver API (libcuda.so.1 through ctypes:
cuMemGetAddressRange, cuIpcGetMemHandle), one handle per allocation: tensors
from torch's caching allocator share a few large blocks, so a rank exports
few handles (ideally one arena per device). Memory that cannot be exported
(expandable segments, cudaMallocAsync pools) raises CkptdError; with
transport="auto" the client then falls back to shared memory.
"""
import ctypes

from .errors import CkptdError

_driver = None


class _Driver:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CkptdError("FAILED_PRECONDITION",
                             f"cuda_ipc: the CUDA driver (libcuda.so.1) cannot be loaded: {e}") \
                from None
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, r, what):
        if r != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(r, ctypes.byref(name))
            n = name.value.decode() if name.value else str(r)
            raise CkptdError("FAILED_PRECONDITION", f"cuda_ipc: {what} failed: {n}")

    def address_range(self, ptr):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                      ctypes.c_uint64(ptr)),
                    "cuMemGetAddressRange (memory must come from cudaMalloc / torch's caching "
                    "allocator without expandable segments)")
        return base.value, size.value

    def ipc_handle(self, base):
        h = (ctypes.c_char * 64)()
        self._check(self.lib.cuIpcGetMemHandle(h, ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(h)

    def uuid(self, ordinal):
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)), "cuDeviceGet")
        u = (ctypes.c_char * 16)()
        fn = getattr(self.lib, "cuDeviceGetUuid_v2", None) or self.lib.cuDeviceGetUuid
        self._check(fn(u, dev), "cuDeviceGetUuid")
        return bytes(u)


def driver():
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def is_cuda_entry(e):
    t = e.tensor
    return t is not None and t.device.type == "cuda" and t.is_contiguous()


def split(entries):
    """How a cuda_ipc load carries each entry: (device, host, aliases).

    device: indices of the entries the daemon writes in device memory itself
    (contiguous, non-empty torch CUDA tensors); host: those that go through
    the request's host segment and are copied in here (CPU tensors and
    arrays such as an optimizer's `step`, non-contiguous or zero-element
    tensors, and a CUDA tensor that partly overlaps another one); aliases:
    {index: index} for an entry whose memory and box are exactly another's
    (tied weights), loaded once through the first.
    """
    device, host, aliases = [], [], {}
    first = {}
    for i, e in enumerate(entries):
        if not is_cuda_entry(e) or e.nbytes == 0:
            host.append(i)
            continue
        t = e.tensor
        key = (t.device, t.data_ptr(), e.nbytes, e.dtype, tuple(e.global_shape),
               tuple(e.offset), tuple(e.shape), e.flat_range)
        if key in first:
            aliases[i] = first[key]
            continue
        first[key] = i
        device.append(i)
    # Partial overlaps (views of one storage): the later ones via the host.
    spans = sorted((str(entries[i].tensor.device), entries[i].tensor.data_ptr(),
                    entries[i].tensor.data_ptr() + entries[i].nbytes, i) for i in device)
    overlapping = set()
    end = {}
    for dev, b, e_, i in spans:
        if b < end.get(dev, 0):
            overlapping.add(i)
        end[dev] = max(end.get(dev, 0), e_)
    if overlapping:
        device = [i for i in device if i not in overlapping]
        host = sorted(host + list(overlapping))
    return device, host, aliases


def export(entries):
    """(buffers, placements): one dict per exported allocation (ipc_handle,
    device, size, device_uuid) and per entry (buffer index, byte offset)."""
    import torch
    drv = driver()
    buffers, index, placements = [], {}, []
    synced = set()
    for e in entries:
        t = e.tensor
        dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(dev):
            if dev not in synced:  # the daemon must not race pending kernels
                torch.cuda.synchronize(dev)
                synced.add(dev)
            ptr = t.data_ptr()
            base, size = drv.address_range(ptr)
            if ptr - base + e.nbytes > size:
                raise CkptdError("INVALID_ARGUMENT", f"'{e.key}': tensor runs past its allocation")
            key = (dev, base)
            if key not in index:
                index[key] = len(buffers)
                buffers.append({"ipc_handle": drv.ipc_handle(base), "device": dev, "size": size,
                                "device_uuid": drv.uuid(dev)})
            placements.append((index[key], ptr - base))
    return buffers, placements


def fallback_ok(err):
    """Whether a cuda_ipc failure means "this path is unavailable here" (the
    daemon or client lacks CUDA, no device, memory not exportable), so a
    transport="auto" load may retry through shared memory."""
    if err.code not in ("UNIMPLEMENTED", "FAILED_PRECONDITION", "INVALID_ARGUMENT"):
        return False
    m = err.message.lower()
    return "cuda" in m
