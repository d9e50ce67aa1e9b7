"""Bucket assignment (DDP's rule) and the flat buffers gradients live in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "assign_buckets", "build_buckets"]

MB = 1024 * 1024


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
    """A flat buffer holding the gradients of some parameters, reduced as one message."""

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    #: one number per parameter after the gradients: 1 where this rank produced a
    #: gradient since the last reduction. Summed with the gradients, it tells every
    #: rank which parameters no rank used, without another collective.
    used: torch.Tensor | None = None
    #: compressed copy sent over the wire (fp16/bf16), or None
    wire: torch.Tensor | None = None

    @property
    def grads(self) -> torch.Tensor:
        """The gradient part of the buffer (without the used-counters after it)."""
        return self.buffer[: self.buffer.numel() - self.used.numel()]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def build_buckets(
    params: Sequence[torch.nn.Parameter],
    bucket_cap_bytes: int,
    first_bucket_bytes: int,
    wire_dtype: torch.dtype | None = None,
) -> list[Bucket]:
    """Assign ``params`` to buckets and allocate each bucket's flat gradient buffer.

    Each parameter gets a view into its bucket's buffer, shaped like the parameter;
    the optimizer makes ``param.grad`` that view, so backward accumulates straight
    into the buffer and no copy is needed before the allreduce.

    Args:
        params: parameters in registration order.
        bucket_cap_bytes: see ``assign_buckets``.
        first_bucket_bytes: see ``assign_buckets``.
        wire_dtype: dtype to send in (compression), or None to send as stored.
    """
    buckets = []
    for index, members in enumerate(assign_buckets(params, bucket_cap_bytes, first_bucket_bytes)):
        chosen = [params[i] for i in members]
        total = sum(p.numel() for p in chosen)
        first = chosen[0]
        buffer = torch.zeros(total + len(chosen), dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for param in chosen:
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        wire = None
        if wire_dtype is not None and wire_dtype != first.dtype and first.dtype.is_floating_point:
            wire = torch.empty(buffer.numel(), dtype=wire_dtype, device=first.device)
        buckets.append(Bucket(index=index, params=chosen, buffer=buffer, views=views, used=buffer[total:], wire=wire))
    return buckets
