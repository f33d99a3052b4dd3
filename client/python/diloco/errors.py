"""The errors a worker sees.  Each says what the server (or the tree) did, in the server's own words
where it gave some."""


class DiLoCoError(Exception):
    """Base class of the package's errors."""


class HostileAnswer(DiLoCoError):
    """The server's answer is not what the protocol allows (a truncated or malformed global, a header over
    its cap, bytes that disagree with Content-Length, a file name that leaves its directory).  Nothing
    was installed into the model."""


class ServerError(DiLoCoError):
    """An answer the contract does not turn into a result: the HTTP status, the server's error code and
    message (README, "Uploads")."""

    def __init__(self, status, code, message, answer=None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.answer = status, code, message, answer


class DeltaRefused(ServerError):
    """422: the server judged the delta and refused it (outlier, norm_ratio, shape_mismatch, ...)."""
