"""The one exception type of the ckptd client."""


class CkptdError(Exception):
    """An error from ckptd or from the client talking to it.

    Attributes:
      code: the gRPC status code name ("NOT_FOUND", "UNAVAILABLE", ...), also
        for errors found on the client side.
      message: the daemon's message (or the client's), without the code.
      grpc_code: the grpc.StatusCode when the error came back from the daemon
        over gRPC, else None.
    """

    def __init__(self, code, message, grpc_code=None):
        self.code = str(code)
        self.message = str(message)
        self.grpc_code = grpc_code
        super().__init__(f"{self.message} [{self.code}]")

    def __reduce__(self):
        # Picklable as itself: PyTorch DCP sends a rank's exception to the others.
        return (CkptdError, (self.code, self.message, self.grpc_code))


def from_rpc_error(err, what, target=None, timeout=None):
    """A CkptdError for a grpc.RpcError raised by call `what`."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = code.name if code is not None else "UNKNOWN"
    msg = details or name
    if name == "UNAVAILABLE":
        msg = f"{what}: daemon unavailable (is ckptd running{' at ' + target if target else ''}?): {msg}"
    elif name == "DEADLINE_EXCEEDED" and timeout is not None and msg in ("Deadline Exceeded", ""):
        msg = f"{what}: no answer from ckptd within {timeout:g} s (timeout=)"
    return CkptdError(name, msg, code)
