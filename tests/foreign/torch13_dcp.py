"""Makes Debian's torch 1.13 distributed checkpoint (DCP) importable under Python 3.11.

    import torch13_dcp                      # before importing torch.distributed._shard
    import torch.distributed._shard.checkpoint as dcp

The patch lives in the Python client (client/python/ckptd/_dcp_compat.py, which
ckptd.dcp uses); this loads that file by path, so a test helper needs neither
the package's dependencies nor PYTHONPATH.
"""
import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.path.join(_HERE, "..", "..", "client", "python", "ckptd", "_dcp_compat.py")
_spec = importlib.util.spec_from_file_location("_ckptd_dcp_compat", _PATH)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_mod.install()
