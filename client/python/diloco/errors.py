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


class RecordRefused(DiLoCoError):
    """Worker(..., public_key=) refused a global: its step's signed record (global/rounds/<s>.json) is
    missing, or its signature is not the key's, or it does not chain to the last record this worker
    verified, or the global's bytes do not hash to the record's outputs, or its step is below one already
    verified (a rollback) or below min_step.  `reason` says which ("missing", "signature", "record",
    "chain", "output", "rollback"), `step` the step refused.  Nothing was installed into the model."""

    def __init__(self, reason, step, message):
        super().__init__(f"step {step}: {reason}: {message}")
        self.reason, self.step = reason, step
