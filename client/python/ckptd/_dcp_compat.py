"""Makes torch 1.13's distributed checkpoint (DCP) importable under Python 3.11.

    from ckptd import _dcp_compat           # before importing torch.distributed._shard
    _dcp_compat.install()
    import torch.distributed._shard.checkpoint as dcp

Under Python 3.11, importing torch.distributed._shard fails on a dataclass field default
in sharded_tensor/metadata.py (`field(default=TensorProperties())`: a mutable default). A
meta-path finder rewrites that one line at import time: system files stay untouched and
nothing is written to __pycache__ for the patched module. Importing this module installs
the finder once (importing it again does nothing). Used by ckptd.dcp (only when
torch has no torch.distributed.checkpoint, i.e. before 2.0), and through
tests/foreign/torch13_dcp.py by tests/foreign/dcp_gen.py and bench/user_load_bench.py.
Standard library only: the test helpers load this file by path.
"""
import importlib.abc
import importlib.machinery
import sys

PATCHED = "torch.distributed._shard.sharded_tensor.metadata"


class _PatchLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        src = self.get_data(self.path).decode("utf-8")
        src = src.replace("field(default=TensorProperties())",
                          "field(default_factory=TensorProperties)")
        return compile(src, self.path, "exec", dont_inherit=True)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        spec.loader = _PatchLoader(fullname, spec.origin)
        return spec


def install():
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
