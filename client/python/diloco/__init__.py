"""diloco: the worker side of dilocod (README, "Writing a worker").

    worker = diloco.Worker("http://aggregator:8470", "worker-1")
    worker.pull(model)
    ... H inner steps ...
    result = worker.push(model, local_step=H, loss=loss.item())
    worker.wait(step + 1)
"""
from .encode import EncodedDelta, delta_metadata, encode_delta, plain_delta
from .errors import DeltaRefused, DiLoCoError, HostileAnswer, RecordRefused, ServerError
from .worker import PushResult, Worker, followed_local_steps

__all__ = ["Worker", "PushResult", "encode_delta", "plain_delta", "EncodedDelta", "delta_metadata",
           "followed_local_steps", "DiLoCoError", "HostileAnswer", "ServerError", "DeltaRefused", "RecordRefused"]
__version__ = "0.1.0"
