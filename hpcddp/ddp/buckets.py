"""Bucket assignment (DDP's rule) and the flat buffers gradients live in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "Bucket",
    "adopt_grad",
    "assign_buckets",
    "build_buckets",
    "drop_unused_grads",
    "grad_view",
    "has_dense_strides",
    "write_used_flags",
]

MB = 1024 * 1024
#: gradient elements of a bucket that ControlNumbers.before_send reads when it does not scale the whole bucket
PROBE_SIZE = 1024


def assign_buckets(tensors: Sequence[torch.Tensor], bucket_cap_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Group tensors into buckets the way DDP does; return lists of tensor indices.

    Tensors are taken in reverse order (gradients become ready roughly from the
    last layer to the first), kept apart by (device, dtype), and a bucket closes as
    soon as it holds at least its limit: ``first_bucket_bytes`` for the first bucket
    of each kind, ``bucket_cap_bytes`` after that. Buckets are returned in the order
    they close, each listing its tensors in reverse registration order.

    Args:
        tensors: parameters in registration order.
        bucket_cap_bytes: the limit of every bucket but the first.
        first_bucket_bytes: the limit of the first bucket (small, to start early).
    """
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    result: list[list[int]] = []
    for index in reversed(range(len(tensors))):
        tensor = tensors[index]
        key = (tensor.device, tensor.dtype)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        limit = first_bucket_bytes if closed_count.get(key, 0) == 0 else bucket_cap_bytes
        if open_bytes[key] >= limit:
            result.append(bucket)
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key], open_bytes[key]
    # Leftovers close in the order their first tensor arrived.
    result.extend(sorted(open_buckets.values(), key=lambda b: -b[0]))
    return result


@dataclass
class Bucket:
    """A flat buffer holding the gradients of some parameters, reduced as one message.

    Layout: the gradients; the last bucket then carries one used-counter per parameter of
    every bucket and the control numbers the reducer sends along with the gradients.
    """

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    #: the gradient part of the buffer
    grads: torch.Tensor | None = None
    #: one number per parameter: 1 where this rank produced a gradient since the last
    #: reduction, or had one before it. Summed with the gradients, it tells every rank alike
    #: which parameters no rank used or had a gradient for (they go back to None), without
    #: another collective. A view of the last bucket, which carries every bucket's counters.
    used: torch.Tensor | None = None
    #: last bucket only: the used-counters of every bucket, in bucket order (``used`` views them)
    all_used: torch.Tensor | None = None
    #: last bucket only: numbers after the used-counters that travel with it (see Reducer)
    control: torch.Tensor | None = None
    #: compressed copy sent over the wire (fp16/bf16), or None
    wire: torch.Tensor | None = None
    #: the evenly spread gradient elements ``ControlNumbers.before_send`` reads (a view made once)
    sample: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def build_buckets(
    params: Sequence[torch.nn.Parameter],
    bucket_cap_bytes: int,
    first_bucket_bytes: int,
    wire_dtype: torch.dtype | None = None,
    control_size: int = 0,
) -> list[Bucket]:
    """Assign ``params`` to buckets and allocate each bucket's flat gradient buffer.

    Each parameter gets a view into its bucket's buffer, shaped like the parameter and
    with its strides (``grad_view``); the optimizer makes ``param.grad`` that view, so
    backward accumulates straight into the buffer and no copy is needed before the allreduce.

    Args:
        params: parameters in registration order.
        bucket_cap_bytes: see ``assign_buckets``.
        first_bucket_bytes: see ``assign_buckets``.
        wire_dtype: dtype to send in (compression), or None to send as stored.
        control_size: extra numbers at the end of the last bucket (``Bucket.control``).
    """
    groups = assign_buckets(params, bucket_cap_bytes, first_bucket_bytes)
    chosen = [[params[i] for i in members] for members in groups]
    totals = [sum(p.numel() for p in members) for members in chosen]
    # Every bucket's used-counters travel in the last bucket, launched last, once all are known:
    # written once per step there, not once per bucket.
    counters = sum(len(members) for members in chosen)
    buckets = []
    for index, (members, total) in enumerate(zip(chosen, totals)):
        tail = counters + control_size if index == len(chosen) - 1 else 0
        first = members[0]
        buffer = torch.zeros(total + tail, dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for param in members:
            views.append(grad_view(buffer, offset, param))
            offset += param.numel()
        wire = None
        if wire_dtype is not None and wire_dtype != first.dtype and first.dtype.is_floating_point:
            wire = torch.empty(buffer.numel(), dtype=wire_dtype, device=first.device)
        buckets.append(
            Bucket(
                index=index,
                params=members,
                buffer=buffer,
                views=views,
                grads=buffer[:total],
                sample=buffer[: total : max(1, -(-total // PROBE_SIZE))],
                wire=wire,
            )
        )
    if buckets:
        last = buckets[-1]
        counted = last.buffer[totals[-1] : totals[-1] + counters]
        last.all_used = counted
        last.control = last.buffer[totals[-1] + counters :] if control_size else None
        start = 0
        for bucket in buckets:
            bucket.used = counted[start : start + len(bucket.params)]
            start += len(bucket.params)
    return buckets


def grad_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """Return the gradient view of ``param`` at ``offset`` of the flat ``buffer``, laid out as ``param`` is.

    Args:
        buffer: the bucket's flat buffer (storage offset 0).
        offset: where the parameter's elements start in it.
        param: the parameter (a dense layout keeps its strides; another is viewed contiguous).
    """
    # As DDP's bucket views (reducer.cpp, initialize_bucket_views): a channels_last parameter
    # gets a channels_last gradient, because fused optimizers (AdamW(fused=True) on CUDA)
    # require param and grad of one layout; CPU kernels do not check it.
    if has_dense_strides(param):
        return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)
    return buffer[offset : offset + param.numel()].view(param.shape)


def has_dense_strides(tensor: torch.Tensor) -> bool:
    """Return True when ``tensor``'s elements fill a block of memory without gaps or overlap, in any dim order."""
    expected = 1
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def adopt_grad(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the bucket view, moving any gradient autograd put elsewhere (None: zeros)."""
    grad = param.grad
    if grad is view:
        return
    if grad is None:
        view.zero_()
    else:
        view.copy_(grad.to_dense() if grad.is_sparse else grad)  # sparse layers' gradients travel dense
    param.grad = view


def drop_unused_grads(buckets: Sequence[Bucket]) -> None:
    """Set ``grad`` back to None for the buckets' parameters whose reduced counter is 0.

    The counter (``Bucket.used``) is 0 only when no rank used the parameter and no rank had
    a gradient for it before the reduction's first pass: every rank decides alike.

    Args:
        buckets: the reduced buckets, all of them (the last one's ``all_used`` holds every counter:
            one transfer, on a GPU one host sync per step).
    """
    # As DDP, which leaves a parameter no rank used as it was: None stays None (so optimizers
    # skip it instead of applying momentum or weight decay to a zero gradient), and a gradient
    # that was there (zeros from zero_grad(set_to_none=False), the average of an earlier backward
    # pass) stays, averaged with the other ranks' (equal) values like any gradient.
    if not buckets:
        return
    flags = buckets[-1].all_used.tolist()
    at = 0
    for bucket in buckets:
        for param, used in zip(bucket.params, flags[at : at + len(bucket.params)]):
            if used == 0:
                param.grad = None
        at += len(bucket.params)


def write_used_flags(used: torch.Tensor, flags: Sequence[bool]) -> None:
    """Write ``flags`` (one per parameter) into a bucket's ``used`` counters, 1 or 0, without a host sync.

    Args:
        used: the bucket's counters (``Bucket.used``).
        flags: whether each parameter was used or had a gradient.
    """
    # A copy from a host list (torch.tensor(flags)) into GPU memory waits for the device at
    # every bucket; fills of runs of ones are queued like any kernel (issue 34, item 11).
    if all(flags):
        used.fill_(1)
        return
    used.zero_()
    start = None
    for index, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            used[start:index].fill_(1)
            start = None
