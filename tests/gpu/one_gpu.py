"""What the nccl rank tests and the GPU benchmark share on one GPU: a size-2 communicator, host syncs counted.

A DistributedOptimizer at world size 1 makes no buckets (it has nobody to reduce with), and
NCCL refuses two ranks on one GPU. ``claiming_two_ranks`` gives the bucket path a real
process group of one whose communicator claims two ranks: every kernel, event and copy of
that path runs as it would with more ranks; only the sums are of one rank, and the object
gathers (the parameter and bucket-layout checks, a mismatch's report) answer for the
missing rank with a copy of this rank's own object, as an agreeing rank would. What needs
the missing rank's data (an allgather of tensors, a root other than 0) raises
NotImplementedError naming the collective.

Used by ``tests/gpu/ranks/test_nccl_rank.py`` (on the ranks) and ``tests/gpu/bench_gpu.py``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hpcddp.comm import oplog
from hpcddp.comm.base import Handle
from hpcddp.comm.torchdist import TorchDistCommunicator

__all__ = ["claiming_two_ranks", "host_syncs"]


#: what a communicator claiming two ranks over a group of one cannot do honestly: a second
#: rank's data or a root other than 0 that no process holds
_NOT_FAKED = (
    "allgather_async", "gather_object", "reduce_async_", "gather_async", "scatter_async_",
    "reducescatter_async", "alltoall_async", "send_async", "recv_async_", "split",
)  # fmt: skip


class _ClaimingTwoRanks(TorchDistCommunicator):
    """A TorchDistCommunicator over the default group of one whose ``size`` says 2 (``claiming_two_ranks``)."""

    def __init__(self, backend: str, device: torch.device) -> None:
        super().__init__(backend, device)
        self.size = 2

    def _gather_objects(self, obj: Any, **kwargs) -> list[Any]:
        # torch's all_gather_object takes an output list of the real group's size (one): the
        # claimed second rank answers with this rank's object. Copies, as unpickled objects
        # from two ranks would be: a caller that changes one must not change the other.
        return [copy.deepcopy(obj) for _ in range(self.size)]

    def broadcast_async_(self, tensor: torch.Tensor, root: int, **kwargs) -> Handle:
        if root != 0:
            _refuse(f"broadcast_async_ from root {root}")
        return super().broadcast_async_(tensor, root, **kwargs)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        if root != 0:
            _refuse(f"broadcast_object from root {root}")
        return super().broadcast_object(obj, root)

    def close(self) -> None:
        # Only what this communicator holds: the default group is the job's (hpcddp.init's or
        # the benchmark's), and TorchDistCommunicator.close would destroy a group hpcddp made.
        oplog.unregister(self.log)
        self._running_works.clear()


def _refuse(name: str) -> None:
    raise NotImplementedError(
        f"{name} on a communicator that claims two ranks over a group of one (tests/gpu/one_gpu.py): "
        "only allreduce, barrier, root-0 broadcasts and the object gathers are faked; use a real 2-rank job"
    )


def _refusing(name: str) -> Callable[..., Any]:
    def refuse(self, *args, **kwargs):
        _refuse(name)

    refuse.__name__ = name
    return refuse


for _name in _NOT_FAKED:
    setattr(_ClaimingTwoRanks, _name, _refusing(_name))


def claiming_two_ranks(backend: str, device: torch.device) -> TorchDistCommunicator:
    """Return a new communicator over torch.distributed's default group of one that says it has two ranks.

    New for each optimizer: the second gradient channel made on one communicator makes every
    bucket agree (``hpcddp.comm.torchdist_channel``), which a count per step must not mix in.
    Close it after use (its ``close`` leaves the default group alone). A collective that
    would need the second rank's data raises NotImplementedError naming it.

    Args:
        backend: the default group's backend ("nccl"; "gloo" in the CPU rehearsal).
        device: where the communicator's tensors live.
    """
    return _ClaimingTwoRanks(backend, device)


def host_syncs(step: Callable[[], None], steps: int) -> list[list[str]]:
    """Run ``step`` ``steps`` times; for each, where every synchronizing CUDA call torch made came from.

    Counted by torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``: one warning
    per synchronizing CUDA call, such as a device-to-host copy (``.item()``, ``.tolist()``) or a
    stream or device synchronize); an event's synchronize is not one. Each call is named
    ``file:line``.

    Args:
        step: one training step (on a CUDA device).
        steps: how many steps to run, each counted apart.
    """
    per_step = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        per_step.append([f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)])
    return per_step
