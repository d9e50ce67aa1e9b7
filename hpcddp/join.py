"""Uneven inputs: ranks that run out of batches keep joining the others' reductions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .optimizer import DistributedOptimizer

__all__ = ["count_active_ranks", "join", "shadow_until_all_joined", "sync_from_last_joiner"]


@contextlib.contextmanager
def join(optimizer: DistributedOptimizer) -> Iterator[None]:
    """Let ranks with fewer batches finish the loop without hanging the others.

    Wrap the training loop on every rank::

        with hpcddp.join(optimizer):
            for x, y in loader:            # ranks may have different numbers of batches
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()

    Inside the block every gradient reduction also counts the ranks that still have
    data (one extra 1-element allreduce per step). A rank that leaves the loop
    early "shadows" the others: in each of their remaining steps it contributes
    zero gradients, receives the same reduced gradients and takes the same optimizer
    step, so every rank ends with the same parameters; at the end the parameters of
    a rank that trained longest are copied to all (as DDP's join does), which also
    covers what the loop does outside the optimizer (an LR scheduler, clipping).
    The block ends on all ranks once the last rank has left its loop.

    Only the optimizer's reductions are shadowed: other collectives inside the loop
    (an allreduce of the loss for logging) would wait forever on the ranks that
    left; do them after the block.

    Averaging rule: a step's gradient is the average over the ranks that still had
    a batch in that step (with ``op="sum"``, their sum). Training equals training on
    the union of the data where step t averages the t-th batch of every rank that
    has one. (DDP's Join divides by the full world size instead, which shrinks the
    last steps' gradients.)

    Args:
        optimizer: the DistributedOptimizer the loop steps.
    """
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"join needs an hpcddp.DistributedOptimizer, got {type(optimizer).__name__}")
    if not optimizer.buckets:  # a world of one: nobody to wait for
        yield
        return
    if optimizer._join_flag is not None:
        raise RuntimeError("hpcddp.join() is already active for this optimizer: do not nest it")
    optimizer.synchronize()
    count_active_ranks(optimizer)
    try:
        yield
        # Only a rank that left its loop normally shadows; an exception propagates
        # (and, with hpcddp's exception hook, ends the job).
        joined_at = optimizer._num_reductions
        shadow_until_all_joined(optimizer)
        sync_from_last_joiner(optimizer, joined_at)
    finally:
        optimizer._join_flag = None
        optimizer.active_ranks = optimizer._comm.size


def count_active_ranks(optimizer: DistributedOptimizer) -> None:
    """Make every reduction of ``optimizer`` also count the ranks that still have data.

    Collective in effect: every rank must turn it on before the same reduction.
    """
    if optimizer.buckets and optimizer._join_flag is None:
        optimizer._join_flag = torch.zeros(1, dtype=torch.float32, device=optimizer.buckets[0].buffer.device)


def shadow_until_all_joined(optimizer: DistributedOptimizer) -> None:
    """Join the other ranks' reductions with zero gradients until every rank has joined.

    Each shadowed reduction is followed by the same optimizer step the other ranks
    take, so parameters stay equal everywhere. Needs ``count_active_ranks`` on.
    """
    if not optimizer.buckets:
        return
    optimizer._joined = True
    try:
        while _shadow_step(optimizer):
            pass
    finally:
        optimizer._joined = False


def sync_from_last_joiner(optimizer: DistributedOptimizer, joined_at: int) -> int:
    """Copy the parameters of a rank that trained longest to every rank; return that rank.

    Shadowing ranks take the same optimizer steps, but not what the training loop
    does around them (an LR scheduler, clipping, a GradScaler); as DDP's join, end
    with the last joiner's parameters everywhere. Collective.

    Args:
        optimizer: the optimizer whose parameters to copy.
        joined_at: this rank's reduction count when its data ran out.
    """
    comm = optimizer._comm
    counts = comm.allgather_object(joined_at)
    source = max(range(len(counts)), key=lambda r: (counts[r], r))
    handles = [comm.broadcast_async_(param.detach(), source) for _, param in optimizer._named]
    for handle in handles:
        handle.wait()
    return source


def _shadow_step(optimizer: DistributedOptimizer) -> bool:
    """Take part in one reduction with zero gradients; return False once no rank has data."""
    optimizer.zero_grad(optimizer._set_to_none)
    optimizer._launch_all()
    optimizer.synchronize()
    if optimizer.active_ranks == 0:
        return False
    optimizer.step()
    return True
