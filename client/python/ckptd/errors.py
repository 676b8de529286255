"""The ckptd client's exceptions.

Every error is a CkptdError (with .code, the gRPC status name, and .message).
Errors whose code has a builtin counterpart are also that builtin, so a script
catches them as it would any other I/O library's:

    try:
        ckptd.load_state_dict(sd, path)
    except FileNotFoundError:      # NotFoundError: no checkpoint, no version, missing keys
        ...
    except PermissionError:        # PermissionDeniedError
        ...
    except TimeoutError:           # DeadlineExceededError: a barrier or a call ran out of time
        ...
    except ValueError:             # InvalidArgumentError: a bad request (shape, dtype, key)
        ...
    except ckptd.CkptdError as e:  # everything else (e.code says what)
        ...

Each is picklable as itself (PyTorch DCP sends a rank's exception to the
others).
"""


class CkptdError(Exception):
    """An error from ckptd or from the client talking to it.

    Attributes:
      code: the gRPC status code name ("NOT_FOUND", "UNAVAILABLE", ...), also
        for errors found on the client side.
      message: the daemon's message (or the client's), without the code.
      grpc_code: the grpc.StatusCode when the error came back from the daemon
        over gRPC, else None.

    CkptdError(code, message) makes the subclass for `code` (NotFoundError for
    "NOT_FOUND", ...), so `except FileNotFoundError` catches it wherever it was
    raised.
    """

    # Whether the call failed because the daemon went away or is restarting
    # (not because of the request): the client retries such a call on a new
    # connection (Client(retry_timeout=...); docs/operations.md).
    restart = False

    def __new__(cls, code="UNKNOWN", message="", grpc_code=None):
        if cls is CkptdError:
            cls = _BY_CODE.get(str(code), CkptdError)
        return super().__new__(cls)

    def __init__(self, code, message, grpc_code=None):
        self.code = str(code)
        self.message = str(message)
        self.grpc_code = grpc_code
        super().__init__(f"{self.message} [{self.code}]")
        if isinstance(self, OSError):
            # OSError's own fields (errno, strerror) stay None: ckptd's errors
            # are not the operating system's; str() is ckptd's message.
            self.strerror = self.message

    def __str__(self):
        return f"{self.message} [{self.code}]"

    def __repr__(self):
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"

    def __reduce__(self):
        # Picklable as itself: PyTorch DCP sends a rank's exception to the others.
        return (CkptdError, (self.code, self.message, self.grpc_code))


class NotFoundError(CkptdError, FileNotFoundError):
    """NOT_FOUND: no such checkpoint, version, job or tensor (a strict load's missing keys)."""


class AlreadyExistsError(CkptdError, FileExistsError):
    """ALREADY_EXISTS: the version exists (save without overwrite)."""


class PermissionDeniedError(CkptdError, PermissionError):
    """PERMISSION_DENIED: outside the daemon's roots, or this uid may not read / save there."""


class DeadlineExceededError(CkptdError, TimeoutError):
    """DEADLINE_EXCEEDED: a barrier, a call or a wait ran out of time."""


class InvalidArgumentError(CkptdError, ValueError):
    """INVALID_ARGUMENT: the request is wrong (shapes, dtypes, boxes, names, sizes)."""


class ResourceExhaustedError(CkptdError):
    """RESOURCE_EXHAUSTED: over a limit of the daemon (request bytes, save_buffer, ranks).
    Not a MemoryError: this process is not out of memory."""


class UnavailableError(CkptdError, ConnectionError):
    """UNAVAILABLE: the daemon is not running or went away (retry once it is back)."""


class CancelledError(CkptdError):
    """CANCELLED: the call was cancelled (the client left, or cancel())."""


class DataLossError(CkptdError):
    """DATA_LOSS: bytes that fail their checksum, or a truncated or corrupt file."""


class FailedPreconditionError(CkptdError):
    """FAILED_PRECONDITION: the daemon cannot do it as configured (API level, peers, keys)."""


class AbortedError(CkptdError):
    """ABORTED: another writer holds the directory, or a multi-node job was aborted."""


class UnimplementedError(CkptdError, NotImplementedError):
    """UNIMPLEMENTED: the daemon does not offer this (too old, or built without it)."""


_BY_CODE = {
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "UNAUTHENTICATED": PermissionDeniedError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAVAILABLE": UnavailableError,
    "CANCELLED": CancelledError,
    "DATA_LOSS": DataLossError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "ABORTED": AbortedError,
    "UNIMPLEMENTED": UnimplementedError,
}


def daemon_gone(message):
    """UNAVAILABLE for a daemon that went away (a connection refused or broken):
    a call the client retries once the daemon is back."""
    err = CkptdError("UNAVAILABLE", message)
    err.restart = True
    return err


def _trailing(err):
    try:
        return dict(err.trailing_metadata() or ())
    except Exception:  # not a call (a bare RpcError)
        return {}


def from_rpc_error(err, what, target=None, timeout=None):
    """A CkptdError for a grpc.RpcError raised by call `what`."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    msg = details or name
    restart = False
    if name in ("UNAVAILABLE", "CANCELLED"):
        md = _trailing(err)
        if md.get("ckptd-status") == "daemon":
            # The daemon's answer: retried only when a restart ended the call.
            restart = md.get("ckptd-retry") == "restart"
        else:
            # gRPC's own: the daemon is not there (restarting, or gone), or a
            # daemon shutting down cancelled the call before its handler
            # answered (this client cancels no calls).
            restart = True
            if name == "UNAVAILABLE":
                msg = (f"{what}: daemon unavailable (is ckptd running"
                       f"{' at ' + target if target else ''}?): {msg}")
    elif name == "DEADLINE_EXCEEDED" and timeout is not None and msg in ("Deadline Exceeded", ""):
        msg = f"{what}: no answer from ckptd within {timeout:g} s (timeout=)"
    out = CkptdError(name, msg, code)
    out.restart = restart
    return out
