"""Horovod's object collectives, barrier, and parameter and optimizer-state broadcasts, per process set."""

from __future__ import annotations

import io
from typing import Any

import torch

from ..ddp.step_counters import keep_step_counters_on_cpu_
from ..runtime.state import device
from .process_sets import communicator_of, global_process_set, set_rank
from .vector_ops import broadcast_async_

__all__ = ["allgather_object", "barrier", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set has reached the barrier.

    As Horovod's, it does not wait for this rank's collectives still in flight.
    """
    comm = communicator_of(process_set)
    wait_here = getattr(comm, "barrier_now", comm.barrier)
    wait_here()


def broadcast_object(obj=None, root_rank=0, name=None, process_set=global_process_set) -> Any:
    """Return root's picklable ``obj`` on every rank of the set."""
    comm = communicator_of(process_set)
    return comm.broadcast_object(obj, set_rank(process_set, root_rank))


def allgather_object(obj, name=None, process_set=global_process_set) -> list[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return communicator_of(process_set).allgather_object(obj)


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """Overwrite every rank's parameters with root's, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of tensors.
        root_rank: the rank whose values everyone takes.
        process_set: the ranks that take part.
    """
    items = list(params.items()) if isinstance(params, dict) else list(params)
    tensors = [item[1] if isinstance(item, tuple) else item for item in items]
    handles = [broadcast_async_(t, root_rank, process_set=process_set) for t in tensors if torch.is_tensor(t)]
    for handle in handles:
        handle.wait()


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set) -> None:
    """Give every rank of the set root's optimizer state and options (lr, betas, ...), keeping their types.

    Args:
        optimizer: a torch optimizer or a DistributedOptimizer.
        root_rank: the rank whose state everyone takes.
        model: accepted for Horovod's signature.
        process_set: the ranks that take part.
    """
    comm = communicator_of(process_set)
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    if comm.size == 1:
        return
    payload = None
    if comm.rank == set_rank(process_set, root_rank):
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        payload = buffer.getvalue()
    payload = broadcast_object(payload, root_rank, process_set=process_set)
    if comm.rank != set_rank(process_set, root_rank):
        state = keep_step_counters_on_cpu_(torch.load(io.BytesIO(payload), map_location=device(), weights_only=False))
        optimizer.load_state_dict(state)


def _create_state(optimizer) -> None:
    """Give an optimizer that never stepped its state (momenta, ...), as Horovod does before broadcasting it.

    One step on zero gradients creates the state; the parameters are put back, so
    weight decay does not move them. Parameters that need a gradient keep the zero
    gradient, as after Horovod's call.
    """
    inner = getattr(optimizer, "_optimizer", optimizer)
    params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    inner.step()
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
