"""Make every rank start from rank 0's parameters and optimizer state."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..ddp.consistency import check_same_parameters
from ..ddp.step_counters import keep_step_counters_on_cpu_
from ..runtime.state import communicator, device

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0
) -> None:
    """Overwrite every rank's tensors with root's, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values everyone takes.

    Raises:
        ValueError: on every rank, when the ranks' names, shapes or dtypes differ.
    """
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    comm = communicator()
    if comm.size == 1:
        return
    _check_root(root_rank, comm.size)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor")
    check_same_parameters(comm, items, "broadcast_parameters")
    handles = [comm.broadcast_async_(tensor.data, root_rank) for _, tensor in items]
    for handle in handles:
        handle.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root's optimizer state (moments, step counts, hyper-parameters).

    Root's ``state_dict()`` is serialised with torch.save and loaded on every rank
    onto its own device.

    Args:
        optimizer: a torch optimizer or hpcddp.DistributedOptimizer.
        root_rank: the rank whose state everyone takes.
    """
    comm = communicator()
    if comm.size == 1:
        return
    _check_root(root_rank, comm.size)
    payload = None
    if comm.rank == root_rank:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        payload = buffer.getvalue()
    payload = comm.broadcast_object(payload, root_rank)
    if comm.rank != root_rank:
        state: dict[str, Any] = torch.load(io.BytesIO(payload), map_location=device(), weights_only=False)
        keep_step_counters_on_cpu_(state)
        optimizer.load_state_dict(state)


def _check_root(root_rank: int, size: int) -> None:
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be in [0, {size}), got {root_rank}")
