"""Check that every rank holds the same parameters before they are reduced or broadcast.

Different models on different ranks make bucket allreduces of different sizes,
which hang or silently mix unrelated numbers; one cheap collective at construction
turns that into an error naming the first differing parameter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Sequence

import torch

from ..comm.base import Communicator, ranks_text
from ..comm.dtypes import dtype_name

__all__ = ["check_same_layout", "check_same_parameters", "describe_difference", "next_optimizer_label"]

#: every parameter's (name, shape, dtype), in the order they are reduced: what the ranks compare
ParameterList = list[tuple[str, tuple[int, ...], str]]


def _parameter_list(named: Sequence[tuple[str, torch.Tensor]]) -> ParameterList:
    return [(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in named]


def _entry(item) -> str:
    name, shape, dtype = item
    return f"{name!r} {list(shape)} {dtype}"


def describe_difference(parameter_lists: Sequence[ParameterList], what: str) -> str | None:
    """Return the error text for the first parameter that differs across ranks, or None.

    Args:
        parameter_lists: every rank's ParameterList, in rank order.
        what: the caller named in the message, e.g. "DistributedOptimizer".
    """
    reference = parameter_lists[0]
    longest = max(len(s) for s in parameter_lists)
    for index in range(longest):
        entries = [s[index] if index < len(s) else None for s in parameter_lists]
        if all(e == entries[0] for e in entries):
            continue
        groups: dict = {}
        for rank, entry in enumerate(entries):
            groups.setdefault(entry, []).append(rank)
        parts = [
            f"{ranks_text(ranks)} {'has no such parameter' if e is None else 'have ' + _entry(e)}"
            for e, ranks in groups.items()
        ]
        counts = sorted({len(s) for s in parameter_lists})
        count_note = ""
        if len(counts) > 1:
            count_note = f" (parameter counts: {', '.join(f'rank {r}: {len(s)}' for r, s in enumerate(parameter_lists) if len(s) != len(reference))} vs {len(reference)} on rank 0)"
        differ = [r for r, e in enumerate(entries) if e != entries[0]]
        return (
            f"{what}: the ranks hold different parameters: parameter #{index} differs on "
            f"{ranks_text(differ)} from rank 0: {'; '.join(parts)}{count_note}; every rank must build "
            "the same model (same layers, order, shapes and dtypes) before wrapping it"
        )
    return None


def check_same_parameters(comm: Communicator, named: Sequence[tuple[str, torch.Tensor]], what: str) -> None:
    """Raise the same ValueError on every rank unless all ranks hold the same parameters.

    Costs one allgather of a 16-byte digest; only when digests differ is a second
    allgather of the full (name, shape, dtype) lists made, on every rank alike.

    Args:
        comm: the communicator spanning the ranks.
        named: (name, tensor) pairs in the order they will be reduced or broadcast.
        what: the caller named in the message.
    """
    if comm.size == 1:
        return
    everyones = _gather_if_different(comm, _parameter_list(named))
    message = None if everyones is None else describe_difference(everyones, what)
    if message is not None:
        raise ValueError(message)


def _gather_if_different(comm: Communicator, value) -> list | None:
    """Return every rank's ``value`` when they differ, else None: one allgather of a 16-byte digest of its repr."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=16).digest()
    if len(set(comm.allgather_object(digest))) == 1:
        return None
    return comm.allgather_object(value)


def check_same_layout(comm: Communicator, buckets: Sequence, compressor, what: str) -> None:
    """Raise the same ValueError on every rank unless all ranks built the same buckets and compression.

    The parameters are compared already (``check_same_parameters``); what else decides the
    messages of a step (the bucket size limits, the wire dtype, the compression and its
    settings) is compared here, once, because buckets on a ``GradientChannel`` are not
    compared one by one. Costs one allgather of a 16-byte digest; a second of the layouts
    when they differ.

    Args:
        comm: the communicator spanning the ranks.
        buckets: the buckets just built, in launch order.
        compressor: the compression settings (a frozen dataclass), or None.
        what: the caller named in the message.
    """
    layout = [
        (
            bucket.buffer.numel(),
            dtype_name(bucket.buffer.dtype),
            None if bucket.wire is None else dtype_name(bucket.wire.dtype),
        )
        for bucket in buckets
    ]
    layouts = _gather_if_different(comm, (tuple(layout), _settings(compressor)))
    if layouts is None:
        return
    groups: dict = {}
    for rank, entry in enumerate(layouts):
        groups.setdefault(entry, []).append(rank)
    parts = [
        f"{ranks_text(ranks)}: {len(entry[0])} buckets of {[size for size, _, _ in entry[0]]} elements"
        f" ({entry[0][0][2] or entry[0][0][1] if entry[0] else 'none'}), compression {entry[1]}"
        for entry, ranks in groups.items()
    ]
    raise ValueError(
        f"{what}: the ranks built different gradient buckets from the same parameters: {'; '.join(parts)}; "
        "pass the same bucket_cap_mb, first_bucket_mb and compression on every rank"
    )


def _settings(compressor) -> str:
    """Compression settings as the ranks compare them: a dataclass's fields (numbers as floats), else the class."""
    if compressor is None:
        return "none"
    name = type(compressor).__qualname__
    if not dataclasses.is_dataclass(compressor):
        return name  # its repr may hold an address, different on every rank
    fields = []
    for field in dataclasses.fields(compressor):
        value = getattr(compressor, field.name)
        fields.append(
            f"{field.name}={float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value!r}"
        )
    return f"{name}({', '.join(fields)})"


#: DistributedOptimizers made so far on each communicator
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def next_optimizer_label(comm) -> str:
    """Return what the buckets' tags of the next DistributedOptimizer on ``comm`` add ("" for the first).

    The ranks of ``comm`` make their optimizers in the same order (the constructor is
    collective), and the agreement compares a bucket's tag: two optimizers' buckets of the
    same shapes reached in another order on one rank raise instead of being summed together.
    """
    number = _MADE.get(comm, 0) + 1
    _MADE[comm] = number
    return "" if number == 1 else f" of DistributedOptimizer #{number}"
