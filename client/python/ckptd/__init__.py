"""ckptd: load and save distributed training checkpoints through the ckptd daemon.

    import ckptd
    report = ckptd.load_state_dict(model.state_dict(), "/data/ckpt/step1000")

See docs/python-client.md.
"""
from ._shm import SharedArena
from ._tensors import ShardedTensor, dtype_name
from .client import (CheckpointInfo, Client, LoadReport, SaveFuture, SaveReport, SavedItem,
                     ShardInfo,
                     TensorInfo, commit_dcp_metadata, default_socket, evict, find_ckptctl,
                     inspect, load_state_dict, merge, prefetch, release_staging,
                     save_state_dict, status)
from .errors import (AbortedError, AlreadyExistsError, CancelledError, CkptdError, DataLossError,
                     DeadlineExceededError, FailedPreconditionError, InvalidArgumentError,
                     NotFoundError, PermissionDeniedError, ResourceExhaustedError,
                     UnavailableError, UnimplementedError)
from ._version import __version__  # VERSION at the top of the source tree

__all__ = [
    "AbortedError", "AlreadyExistsError", "CancelledError", "DataLossError",
    "DeadlineExceededError", "FailedPreconditionError", "InvalidArgumentError", "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnavailableError", "UnimplementedError",
    "CheckpointInfo", "CkptdError", "Client", "LoadReport", "SaveFuture", "SaveReport",
    "SavedItem", "ShardInfo", "ShardedTensor", "SharedArena", "TensorInfo", "dtype_name",
    "evict", "inspect", "load_state_dict", "merge", "prefetch", "save_state_dict", "status",
]
# Also importable, not exported by `from ckptd import *` (helpers, not the API):
# commit_dcp_metadata (ckptd.dcp's commit), default_socket, find_ckptctl,
# release_staging.
