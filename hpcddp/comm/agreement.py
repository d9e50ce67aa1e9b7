"""Metadata agreement: every rank describes the collective it is about to run, and they compare.

As Horovod's negotiation, but one small reduction instead of a coordinator: each rank
hashes its ``CollectiveCall`` (op, shape, dtype, root, reduce op, splits) and the
ranks reduce ``[hash, -hash, -error]`` with MIN, which yields the smallest and the
largest hash and whether any rank found its own arguments bad. Every rank gets the same
three numbers, so on disagreement all of them take the slow path together: gather the
calls, build one message, skip the collective and raise CollectiveMismatchError.
The communicator is then still in step on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .base import ranks_text
from .dtypes import dtype_name
from .names import COLLECTIVES, ROWS_MAY_DIFFER
from .reduction import ReduceOp

__all__ = [
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CollectiveCall",
    "JOINED",
    "JOINED_VECTOR",
    "agreement_vector",
    "all_joined",
    "disagrees",
    "mismatch_error",
    "mismatch_message",
    "continues_while_joined",
    "describe_call",
    "some_joined",
]


class CollectiveMismatchError(RuntimeError):
    """The ranks called the same collective with arguments that do not match.

    Raised on every rank alike; the collective was not run and the communicator
    stays usable.
    """


class CollectiveArgumentError(CollectiveMismatchError, ValueError):
    """A rank passed arguments the collective cannot take (splits that do not add up, ...).

    Raised on every rank alike, as CollectiveMismatchError; also a ValueError, as the
    same mistake raises when the check is off.
    """


class CollectiveCall(NamedTuple):
    """What one rank says about the collective it is about to run: the ranks compare these first."""

    op: str
    #: the shape that must agree (``names.ROWS_MAY_DIFFER``: without the first dimension;
    #: several tensors: the tuple of their shapes)
    shape: tuple | None = None
    dtype: str | None = None
    root: int | None = None
    reduce_op: str | None = None
    splits: tuple[int, ...] | None = None
    #: the optimizer's step, for its gradient buckets (a rank that skipped a backward
    #: pass but stepped is one step ahead, with buckets of the same shapes)
    step: int | None = None
    #: a problem this rank found with its own arguments (compared as "some rank has one")
    error: str | None = None
    #: the tensor's name (Horovod's ``name=``), or a gradient bucket's tag (which bucket of which
    #: DistributedOptimizer); compared
    name: str = ""

    def compared(self) -> tuple:
        # The name is compared: two optimizers' buckets of the same shapes reached in another order on
        # another rank, or Horovod collectives named "x" and "y" submitted in another order (Horovod
        # matches them by name; hpcddp runs them in the order submitted), would otherwise be summed together.
        return (self.op, self.shape, self.dtype, self.root, self.reduce_op, self.splits, self.step, self.name)


def describe_call(
    op: str,
    tensor: torch.Tensor | Sequence[torch.Tensor] | None = None,
    *,
    root: int | None = None,
    reduce_op: Any = None,
    splits: Sequence[int] | None = None,
    step: int | None = None,
    error: str | None = None,
    name: str = "",
) -> CollectiveCall:
    """Describe this rank's next collective for the agreement check.

    Args:
        op: the collective's name (``hpcddp.comm.names``).
        tensor: its tensor, or its tensors (compared as the tuple of their shapes), if any.
        root: the root rank, for rooted collectives.
        reduce_op: the reduction (a ReduceOp or its name).
        splits: splits that must be the same on every rank.
        step: the optimizer's step (gradient buckets only).
        error: what is wrong with this rank's own arguments, if anything.
        name: the tensor's name, for the message.
    """
    assert op in COLLECTIVES, f"{op!r} is not named in hpcddp.comm.names"
    shape = dtype = None
    if isinstance(tensor, torch.Tensor):
        shape = tuple(tensor.shape[1:]) if op in ROWS_MAY_DIFFER else tuple(tensor.shape)
        dtype = dtype_name(tensor.dtype)
    elif tensor:  # several tensors of one dtype
        shape = tuple(tuple(t.shape) for t in tensor) if len(tensor) > 1 else tuple(tensor[0].shape)
        dtype = dtype_name(tensor[0].dtype)
    reduce_name = getattr(reduce_op, "value", reduce_op)
    splits = None if splits is None else tuple(splits)
    return CollectiveCall(op, shape, dtype, root, reduce_name, splits, step, error, name)


def _fingerprint(call: CollectiveCall) -> int:
    digest = hashlib.blake2b(repr(call.compared()).encode(), digest_size=8).digest()
    # 62 bits: the negation below must stay within int64.
    return int.from_bytes(digest, "little") >> 2


# A joined rank (Horovod's join) takes part in every check with this vector: it never
# wins the MIN over a real hash, and its last two entries say "some/all ranks joined".
_ABOVE_ANY_HASH = 1 << 62
JOINED_VECTOR = (_ABOVE_ANY_HASH, _ABOVE_ANY_HASH, 0, 1, -1)
#: what a joined rank says when the ranks compare their calls
JOINED = CollectiveCall("join")


def agreement_vector(call: CollectiveCall) -> list[int]:
    """Return this rank's ``[hash, -hash, -error, joined, -joined]``, to be reduced with MIN across ranks."""
    fingerprint = _fingerprint(call)
    return [fingerprint, -fingerprint, -int(call.error is not None), 0, 0]


def disagrees(reduced: Sequence[int]) -> bool:
    """Return True when the MIN-reduced agreement vectors show a mismatch, a rank's error, or joined ranks."""
    return int(reduced[0]) != -int(reduced[1]) or int(reduced[2]) != 0 or int(reduced[4]) != 0


def some_joined(reduced: Sequence[int]) -> bool:
    """Return True when the reduced vectors show a rank that has joined (Horovod's join)."""
    return len(reduced) > 4 and int(reduced[4]) != 0


def all_joined(reduced: Sequence[int]) -> bool:
    """Return True when every rank has joined."""
    return len(reduced) > 4 and int(reduced[3]) == 1


def continues_while_joined(calls: Sequence[CollectiveCall]) -> bool:
    """Return True when the ranks that have not joined agree on a sum or average allreduce."""
    active = [c for c in calls if c.op != JOINED.op]
    return (
        bool(active)
        and len({c.compared() for c in active}) == 1
        and not any(c.error for c in active)
        and active[0].op == "allreduce"
        and active[0].reduce_op in (ReduceOp.SUM.value, ReduceOp.AVERAGE.value)
        # A step of gradient buckets moves on a communicator of its own (``hpcddp.comm.mpi.gradient_channel``) that a
        # rank waiting in join() does not take part in.
        and not _is_bucket(active[0])
    )


def mismatch_error(calls: Sequence[CollectiveCall]) -> CollectiveMismatchError:
    """Return the exception every rank raises for these gathered calls."""
    if any(s.error is not None for s in calls):
        return CollectiveArgumentError(mismatch_message(calls))
    return CollectiveMismatchError(mismatch_message(calls))


def mismatch_message(all_calls: Sequence[CollectiveCall]) -> str:
    """Return the one message every rank raises, from every rank's signature (in rank order).

    Args:
        all_calls: every rank's CollectiveCall, gathered.
    """
    joined = [r for r, s in enumerate(all_calls) if s.op == JOINED.op]
    calls = [s for s in all_calls if s.op != JOINED.op]
    if joined and calls and len({s.compared() for s in calls}) == 1 and not any(s.error for s in calls):
        if _is_bucket(calls[0]):
            return (
                f"the gradient reduction ({calls[0].name}) cannot run while {ranks_text(joined)} "
                f"{'has' if len(joined) == 1 else 'have'} joined with the communicator's join(): join with the "
                "optimizer instead (hpcddp.join(optimizer), or hvd.join() with hvd.DistributedOptimizer)"
            )
        return (
            f"{calls[0].op} cannot run while {ranks_text(joined)} {'has' if len(joined) == 1 else 'have'} joined "
            "(hvd.join): only sum and average allreduces continue until every rank joins"
        )
    first = calls[0]
    ranked = [(r, s) for r, s in enumerate(all_calls) if s.op != JOINED.op]
    errors = [(r, s.error) for r, s in ranked if s.error is not None]
    what = first.op + _named(calls)
    if errors:
        details = "; ".join(f"rank {r}: {error}" for r, error in errors)
        return f"{what} was not run: {details}"
    buckets = [r for r, s in ranked if _is_bucket(s)]
    others = [r for r, s in ranked if not _is_bucket(s)]
    if buckets and others:
        bucket, other = all_calls[buckets[0]], all_calls[others[0]]
        return (
            f"{ranks_text(buckets)} {'was' if len(buckets) == 1 else 'were'} reducing gradients ({bucket.name}: "
            f"{_describe(bucket)}) while {ranks_text(others)} called {_describe(other)}: {ranks_text(others)} skipped a "
            "backward pass or called step() without one, or ran out of data; every rank must run the same number "
            "of backward passes (wrap uneven data in hpcddp.join(optimizer))"
        )
    fields = ("op", "shape", "dtype", "root", "reduce_op", "splits", "step", "name")
    differences = []
    for index, field in enumerate(fields):
        groups: dict[Any, list[int]] = {}
        for r, call in ranked:
            groups.setdefault(call.compared()[index], []).append(r)
        if len(groups) > 1:
            label = {
                "shape": "shape" if first.op not in ROWS_MAY_DIFFER else "shape after the first dimension",
                "step": "optimizer step",
                "name": "gradient bucket" if _is_bucket(first) else "tensor name",
            }.get(field, field.replace("_", " "))
            if field == "name" and differences and _is_bucket(first):
                break  # a bucket's tag also differs whenever its step or shape does: that is said already
            shown = (lambda v: repr(v) if v else "no name") if field == "name" and not _is_bucket(first) else _show
            parts = "; ".join(f"{ranks_text(ranks)}: {shown(value)}" for value, ranks in groups.items())
            differences.append(f"{label} differs ({parts})")
    return f"{what}: the ranks disagree: {'; '.join(differences)}; {_cause(ranked)}"


def _named(calls: Sequence[CollectiveCall]) -> str:
    names = {s.name for s in calls if not _is_bucket(s)}
    return f" of tensor {next(iter(names))!r}" if len(names) == 1 and "" not in names else ""


def _is_bucket(call: CollectiveCall) -> bool:
    return call.step is not None


def _cause(ranked: list[tuple[int, CollectiveCall]]) -> str:
    steps = sorted({s.step for _, s in ranked if _is_bucket(s)})
    if len(steps) > 1:
        ahead = ranks_text([r for r, s in ranked if s.step == steps[-1]])
        behind = ranks_text([r for r, s in ranked if s.step == steps[0]])
        return (
            f"{ahead} took a step without reducing gradients (it skipped a backward pass, called step() without "
            f"one, or none of the optimizer's parameters got a gradient there), or {behind} reduced twice in one step (a second backward pass, or a step() left out); every "
            "rank must run the same backward passes and steps (wrap uneven data in hpcddp.join(optimizer))"
        )
    if len({s.name for _, s in ranked if _is_bucket(s)}) > 1:
        return (
            "the ranks reached their optimizers' buckets in another order (several DistributedOptimizers whose "
            "parts of the model run in a different order on different ranks); every rank must reduce the same "
            "buckets in the same order"
        )
    if len({s.name for _, s in ranked}) > 1 and len({s.compared()[:-1] for _, s in ranked}) == 1:
        return (
            "hpcddp runs a communicator's collectives in the order each rank submits them, where Horovod matches "
            "them by name: every rank must submit its named collectives in the same order, under the same names"
        )
    return "every rank must call the same collectives in the same order with matching arguments"


def _describe(call: CollectiveCall) -> str:
    """``allreduce of shape [98] float32``, or ``barrier``."""
    if call.shape is None:
        return call.op
    return f"{call.op} of shape {_show(call.shape)} {call.dtype}"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return str(list(value))
    return "none" if value is None else str(value)
