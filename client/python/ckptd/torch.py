"""Deprecated: the old name of ckptd.dcp (kept for one API level).

`from ckptd import torch` shadowed the real torch module in the importing
scope; import `ckptd.dcp` instead:

    from ckptd.dcp import DaemonStorageReader, DaemonStorageWriter
"""
import warnings

from .dcp import DaemonStorageReader, DaemonStorageWriter  # noqa: F401
from . import dcp as _dcp

warnings.warn("ckptd.torch is deprecated: import ckptd.dcp (DaemonStorageReader, "
              "DaemonStorageWriter) instead", DeprecationWarning, stacklevel=2)

__all__ = ["DaemonStorageReader", "DaemonStorageWriter"]


def __getattr__(name):
    # Anything else ckptd.dcp has (helpers a caller may have reached for).
    return getattr(_dcp, name)
