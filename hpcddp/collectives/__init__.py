"""hpcddp's own collectives for training scripts, all through the job's communicator.

- ``tensors``: ``hpcddp.allreduce`` & co., their async forms and the object collectives;
- ``parameters``: ``broadcast_parameters`` and ``broadcast_optimizer_state``;
- ``averaging``: ``PeriodicModelAverager`` (local SGD);
- ``async_averaging``: ``AsyncModelAverager`` (averaging in the background, no rank waits).
"""

from . import tensors as _tensors
from .tensors import *  # noqa: F403 - hpcddp.collectives.allreduce & co., as before the layout change

__all__ = _tensors.__all__
