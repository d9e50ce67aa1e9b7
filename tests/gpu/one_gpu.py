"""What the nccl rank tests and the GPU benchmark share on one GPU: a size-2 communicator, host syncs counted.

A DistributedOptimizer at world size 1 makes no buckets (it has nobody to reduce with), and
NCCL refuses two ranks on one GPU. ``claiming_two_ranks`` gives the bucket path a real
process group of one whose communicator claims two ranks: every kernel, event and copy of
that path runs as it would with more ranks; only the sums are of one rank, and the object
gathers (the parameter and bucket-layout checks, a mismatch's report) answer for the
missing rank with this rank's own object, as an agreeing rank would.

Used by ``tests/gpu/ranks/test_nccl_rank.py`` (on the ranks) and ``tests/gpu/bench_gpu.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from hpcddp.comm.torchdist import TorchDistCommunicator

__all__ = ["claiming_two_ranks", "host_syncs"]


def claiming_two_ranks(backend: str, device: torch.device) -> TorchDistCommunicator:
    """Return a new communicator over torch.distributed's default group of one that says it has two ranks.

    New for each optimizer: the second gradient channel made on one communicator makes every
    bucket agree (``hpcddp.comm.torchdist_channel``), which a count per step must not mix in.

    Args:
        backend: the default group's backend ("nccl"; "gloo" in the CPU rehearsal).
        device: where the communicator's tensors live.
    """
    comm = TorchDistCommunicator(backend, device)
    comm.size = 2
    # torch's all_gather_object takes an output list of the real group's size (one): the
    # claimed second rank answers with this rank's object.
    comm._gather_objects = lambda obj, **kwargs: [obj] * comm.size
    return comm


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
