"""State dicts -> the tensors a rank loads or saves (names, dtypes, boxes, bytes)."""
import numpy as np

from .errors import CkptdError

# safetensors dtype name -> itemsize
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}

_NUMPY_TO_ST = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
}

_ALIASES = {
    "float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "float16": "F16",
    "half": "F16", "bfloat16": "BF16", "bf16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
    "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}

# How numpy holds the bytes of torch dtypes it has no dtype for (BF16, F8):
# an integer type of the same width that torch.from_numpy accepts.
_BITS = {1: np.uint8, 2: np.int16}


def dtype_name(d):
    """A safetensors dtype name from a name, numpy dtype or torch dtype."""
    if isinstance(d, str):
        if d.upper() in ITEMSIZE:
            return d.upper()
        if d.lower() in _ALIASES:
            return _ALIASES[d.lower()]
        raise CkptdError("INVALID_ARGUMENT", f"unknown dtype '{d}'")
    torch = _torch()
    if torch is not None and isinstance(d, torch.dtype):
        return _torch_name(d)
    try:
        return _NUMPY_TO_ST[np.dtype(d)]
    except (TypeError, KeyError):
        raise CkptdError("INVALID_ARGUMENT", f"dtype {d!r} has no checkpoint dtype") from None


# ckptd dtype names -> the torch dtypes' attribute names (only those a torch
# has are used: float8 and uint16-64 came in later versions).
_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def torch_dtype(name, torch=None):
    """The torch dtype of checkpoint dtype `name`, or None if this torch has none."""
    torch = torch or _torch()
    return getattr(torch, _TORCH_DTYPES.get(name, ""), None) if torch is not None else None


def dtype_of(name):
    """The dtype a checkpoint dtype name stands for: torch's when the program
    uses torch (imported it), else numpy's; None where that library has none
    (numpy has no bfloat16 or float8)."""
    if _torch() is not None:
        return torch_dtype(name)
    for np_dtype, st in _NUMPY_TO_ST.items():
        if st == name:
            return np_dtype
    return None


def _torch():
    import sys
    return sys.modules.get("torch")  # only if the caller already uses torch


def _torch_name(dt):
    torch = _torch()
    table = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
        torch.uint8: "U8", torch.bool: "BOOL",
    }
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                       ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
        if hasattr(torch, attr):
            table[getattr(torch, attr)] = name
    if dt not in table:
        raise CkptdError("INVALID_ARGUMENT", f"torch dtype {dt} has no checkpoint dtype")
    return table[dt]


def torch_storage_numpy_dtype(dt):
    """The numpy dtype that holds a torch dtype's bytes."""
    name = _torch_name(dt)
    if name in ("BF16", "F8_E4M3", "F8_E5M2"):
        return np.dtype(_BITS[ITEMSIZE[name]])
    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
            "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
            "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}[name]


def _is_torch_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


class ShardedTensor:
    """The part of a tensor one rank holds (Paddle's ShardedWeight).

    Args:
      local: numpy array or torch tensor holding this rank's part.
      global_shape: shape of the whole tensor.
      offset: global offset of this rank's box (default: all zeros).
      flat_range: optional (begin, end): the rank holds only that range of the
        row-major flattening of its box (ZeRO-style); `local` then holds
        end - begin elements (any shape, typically 1-D).
      local_shape: shape of the box; default `local.shape`, or for a flat
        range, the rest of the tensor from `offset` (the whole tensor when
        offset is zero).
      dtype: the dtype as stored in the checkpoint, when `local`'s own dtype
        cannot say it (e.g. a numpy uint16 array holding BF16 bits: "BF16").
        Default: local's dtype. Otherwise ckptd casts between the checkpoint's
        dtype and local's (floats, widening integers).
    """

    def __init__(self, local, global_shape, offset=None, flat_range=None, local_shape=None,
                 dtype=None):
        self.local = local
        self.global_shape = tuple(int(d) for d in global_shape)
        self.offset = (tuple(0 for _ in self.global_shape) if offset is None
                       else tuple(int(d) for d in offset))
        self.flat_range = None if flat_range is None else (int(flat_range[0]), int(flat_range[1]))
        if local_shape is not None:
            self.local_shape = tuple(int(d) for d in local_shape)
        elif self.flat_range is not None:
            self.local_shape = tuple(g - o for g, o in zip(self.global_shape, self.offset))
        else:
            self.local_shape = tuple(int(d) for d in local.shape)
        self.dtype = dtype

    def __repr__(self):
        fr = f", flat_range={self.flat_range}" if self.flat_range else ""
        return (f"ShardedTensor(global_shape={self.global_shape}, offset={self.offset}, "
                f"local_shape={self.local_shape}{fr})")


class Entry:
    """One tensor of a rank: what the daemon is told and where the bytes live."""

    __slots__ = ("key", "path", "dtype", "global_shape", "offset", "shape", "flat_range",
                 "array", "tensor", "nbytes", "count")

    def box_elements(self):
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def address(self):
        """(address, contiguous) of the bytes, for zero-copy placement."""
        if self.tensor is not None:
            t = self.tensor
            if t.device.type != "cpu":
                return None, False
            return t.data_ptr(), t.is_contiguous()
        a = self.array
        return a.__array_interface__["data"][0], a.flags.c_contiguous

    def staging_dtype(self):
        """numpy dtype whose items are this entry's elements, bit for bit."""
        if self.tensor is not None:
            return torch_storage_numpy_dtype(self.tensor.dtype)
        return self.array.dtype

    def fill_from(self, u8):
        """Copies the entry's bytes from the uint8 view `u8` into the tensor."""
        src = u8.view(self.staging_dtype()).reshape(self._local_shape())
        if self.tensor is not None:
            import torch
            s = torch.from_numpy(src)
            if s.dtype != self.tensor.dtype:
                s = s.view(self.tensor.dtype)
            with torch.no_grad():
                self.tensor.copy_(s)
        else:
            np.copyto(self.array, src, casting="no")

    def copy_to(self, u8):
        """Copies the tensor's bytes into the uint8 view `u8`."""
        dst = u8.view(self.staging_dtype()).reshape(self._local_shape())
        if self.tensor is not None:
            import torch
            d = torch.from_numpy(dst)
            if d.dtype != self.tensor.dtype:
                d = d.view(self.tensor.dtype)
            with torch.no_grad():
                d.copy_(self.tensor.detach())
        else:
            np.copyto(dst, self.array, casting="no")

    def _local_shape(self):
        if self.tensor is not None:
            return tuple(self.tensor.shape)
        return self.array.shape


def _leaf_entry(key, path, value):
    e = Entry()
    e.key, e.path = key, path
    sharded = isinstance(value, ShardedTensor)
    local = value.local if sharded else value
    e.array = e.tensor = None
    if _is_torch_tensor(local):
        e.tensor = local
        local_dtype = _torch_name(local.dtype)
        local_shape = tuple(local.shape)
    elif isinstance(local, np.ndarray):
        e.array = local
        local_dtype = dtype_name(local.dtype)
        local_shape = local.shape
    else:
        return None
    count = int(np.prod(local_shape, dtype=np.int64)) if local_shape else 1
    if sharded:
        e.global_shape = value.global_shape
        e.offset = value.offset
        e.shape = value.local_shape
        e.flat_range = value.flat_range
        e.dtype = dtype_name(value.dtype) if value.dtype is not None else local_dtype
        if value.dtype is not None and ITEMSIZE[e.dtype] != ITEMSIZE[local_dtype]:
            raise CkptdError("INVALID_ARGUMENT",
                             f"'{key}': dtype {e.dtype} does not fit the local {local_dtype} "
                             f"items (different sizes)")
        if len(e.offset) != len(e.global_shape) or len(e.shape) != len(e.global_shape):
            raise CkptdError("INVALID_ARGUMENT",
                             f"'{key}': global_shape {e.global_shape}, offset {e.offset} and "
                             f"local shape {e.shape} differ in rank")
        if e.flat_range is not None:
            b, end = e.flat_range
            if end - b != count:
                raise CkptdError("INVALID_ARGUMENT",
                                 f"'{key}': flat_range {e.flat_range} holds {end - b} elements "
                                 f"but the local tensor has {count}")
        elif tuple(e.shape) != tuple(local_shape):
            raise CkptdError("INVALID_ARGUMENT",
                             f"'{key}': local tensor of shape {tuple(local_shape)} for a box of "
                             f"shape {e.shape}")
    else:
        e.global_shape = tuple(int(d) for d in local_shape)
        e.offset = tuple(0 for _ in local_shape)
        e.shape = e.global_shape
        e.flat_range = None
        e.dtype = local_dtype
    e.count = count
    e.nbytes = count * ITEMSIZE[e.dtype]
    return e


def flatten(state_dict, sep="."):
    """(entries, skipped keys): tensors of a (nested) state dict, keys joined by sep.

    Dict keys are turned into strings (torch optimizer states use ints).
    Leaves that are neither numpy arrays, torch tensors nor ShardedTensors
    (ints, lists, param_groups, ...) are skipped and reported.
    """
    if not isinstance(state_dict, dict):
        raise CkptdError("INVALID_ARGUMENT",
                         f"state_dict must be a dict, not {type(state_dict).__name__}")
    entries, skipped = [], []
    _flatten_into(state_dict, (), sep, entries, skipped, set(), {id(state_dict)})
    return entries, skipped


# Dicts nested deeper than this are refused (a clear error, not Python's
# RecursionError); model and optimizer state dicts nest a handful deep.
_MAX_NESTING = 64


def _flatten_into(d, path, sep, entries, skipped, seen, walking):
    """flatten's walk. A module function, not a closure calling itself: such a
    closure is a reference cycle (function -> its cell -> function) holding
    `entries`, so the caller's tensors would outlive the load until the
    garbage collector ran (512 MiB per load kept in a process that loads
    into fresh tensors again and again). `walking`: ids of the dicts on the
    path, so that a dict containing itself is an error, not endless."""
    for k, v in d.items():
        p = path + (str(k),)
        key = sep.join(p)
        if isinstance(v, dict):
            if id(v) in walking:
                raise CkptdError("INVALID_ARGUMENT", f"'{key}' is a dict that contains it: "
                                 "the state dict refers back to itself")
            if len(p) >= _MAX_NESTING:
                raise CkptdError("INVALID_ARGUMENT", f"'{key}': the state dict nests dicts more "
                                 f"than {_MAX_NESTING} deep")
            walking.add(id(v))
            _flatten_into(v, p, sep, entries, skipped, seen, walking)
            walking.discard(id(v))
            continue
        e = _leaf_entry(key, p, v)
        if e is None:
            skipped.append(key)
            continue
        if key in seen:
            raise CkptdError("INVALID_ARGUMENT", f"key '{key}' appears twice after flattening")
        seen.add(key)
        entries.append(e)
