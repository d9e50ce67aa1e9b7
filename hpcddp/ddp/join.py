"""Uneven inputs: ranks that run out of batches keep joining the others' reductions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .optimizer import DistributedOptimizer
from .reducer import Reducer, StepStoppedError

__all__ = ["join", "shadow_until_all_joined", "sync_from_last_joiner"]


@contextlib.contextmanager
def join(optimizer: DistributedOptimizer) -> Iterator[None]:
    """Let ranks with fewer batches finish the loop without hanging the others.

    Wrap the training loop on every rank::

        with hpcddp.join(optimizer):
            for x, y in loader:            # ranks may have different numbers of batches
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()

    Every gradient reduction counts the ranks that still have data (a number in
    the last bucket, no extra collective). A rank that leaves the loop
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
    if optimizer.reproducible:
        raise ValueError(
            "hpcddp.join() is not needed with reproducible=True: a rank with fewer micro-batches runs fewer "
            "backward passes and calls step() like the others; drop the join() block"
        )
    reducer = optimizer.reducer
    if not reducer.buckets:  # a world of one: nobody to wait for
        yield
        return
    if reducer.divide_by_active:
        raise RuntimeError("hpcddp.join() is already active for this optimizer: do not nest it")
    optimizer.synchronize()
    reducer.divide_by_active = True
    try:
        yield
        # Only a rank that left its loop normally shadows; an exception propagates
        # (and, with hpcddp's exception hook, ends the job).
        joined_at = reducer.num_reductions
        shadow_until_all_joined(optimizer)
        sync_from_last_joiner(reducer, joined_at)
    finally:
        reducer.divide_by_active = False
        reducer.active_ranks = reducer.comm.size


def shadow_until_all_joined(optimizer: DistributedOptimizer) -> None:
    """Join the other ranks' reductions with zero gradients until every rank has joined.

    Each shadowed reduction is followed by the same optimizer step the other ranks
    take, so parameters stay equal everywhere. Every reduction counts the ranks
    that still have data (in the last bucket), so no extra collective is needed.
    """
    reducer = optimizer.reducer
    if not reducer.buckets:
        return
    reducer.has_data = False
    try:
        while True:
            optimizer.zero_grad(reducer.set_to_none)
            try:
                reducer.synchronize(force=True)
            except StepStoppedError:
                continue  # a rank with data stopped part-way and runs its batch again: shadow that too
            if reducer.active_ranks == 0:
                break
            optimizer.step()
    finally:
        reducer.has_data = True


def sync_from_last_joiner(reducer: Reducer, joined_at: int) -> int:
    """Copy the parameters of a rank that trained longest to every rank; return that rank.

    Shadowing ranks take the same optimizer steps, but not what the training loop
    does around them (an LR scheduler, clipping, a GradScaler); as DDP's join, end
    with the last joiner's parameters everywhere. Collective.

    Args:
        reducer: the optimizer's reducer, whose parameters to copy.
        joined_at: this rank's reduction count when its data ran out.
    """
    comm = reducer.comm
    counts = comm.allgather_object(joined_at)
    source = max(range(len(counts)), key=lambda r: (counts[r], r))
    handles = [comm.broadcast_async_(param.detach(), source) for _, param in reducer.named]
    for handle in handles:
        handle.wait()
    return source
