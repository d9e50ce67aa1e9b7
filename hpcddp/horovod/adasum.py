"""Horovod's Adasum reduction: pairwise, scale-aware combination of the ranks' tensors.

Horovod 0.28.1 (``horovod/common/ops/adasum/adasum.h``) combines two ranks' vectors
``a`` and ``b`` into ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b``, with the dot
product and norms summed in float64 over each tensor (per tensor also inside a fused
buffer) and a coefficient left at 1 when its norm squared is below sqrt(DBL_MIN).
Its vector-halving, distance-doubling exchange pairs rank ``r`` with ``r ^ level`` for
level = 1, 2, 4, ...: the ranks ``[0, 1]``, ``[2, 3]``, ... first, then those pairs'
results, the lower ranks' always as ``a``; each level's result is stored in the
tensor's dtype. Only float16, float32 and float64 are reduced, over a power-of-2
number of ranks of the global process set.

hpcddp gathers every rank's tensor (one allgather, ``size()`` times the tensor's
memory and traffic, where Horovod's exchange moves about twice the tensor) and every
rank combines the same vectors in the same order, so all ranks end with the same bits.
"""

from __future__ import annotations

import math
import sys

import torch

from ..comm.base import Communicator, Handle

__all__ = ["ADASUM_DTYPES", "adasum_async", "check_adasum", "combine", "pair"]

ADASUM_DTYPES = (torch.float16, torch.float32, torch.float64)
# Horovod's threshold: below it a norm counts as zero and its vector keeps coefficient 1.
_TINY_NORM_SQUARED = math.sqrt(sys.float_info.min)


def check_adasum(size: int, dtype: torch.dtype, *, global_set: bool = True) -> None:
    """Raise what Horovod refuses: a non-global process set, a world that is not a power of 2, a non-float dtype."""
    if not global_set:
        raise NotImplementedError(
            "op=hvd.Adasum reduces over the global process set only, as in Horovod: drop process_set= or use op=hvd.Sum"
        )
    if size < 1 or size & (size - 1):
        raise NotImplementedError(
            f"op=hvd.Adasum needs a power-of-2 number of ranks, as in Horovod, got size()={size}: "
            "launch 1, 2, 4, 8, ... ranks or use op=hvd.Average"
        )
    if dtype not in ADASUM_DTYPES:
        raise TypeError(
            f"op=hvd.Adasum reduces float16, float32 or float64 tensors, as in Horovod, got {dtype}: "
            "cast the tensor or use op=hvd.Sum"
        )


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return Adasum's combination of the float64 vectors ``a`` (lower ranks) and ``b``."""
    dot = float(torch.dot(a, b))
    a_norm_sq, b_norm_sq = float(torch.dot(a, a)), float(torch.dot(b, b))
    a_coeff = 1.0 - dot / a_norm_sq * 0.5 if a_norm_sq >= _TINY_NORM_SQUARED else 1.0
    b_coeff = 1.0 - dot / b_norm_sq * 0.5 if b_norm_sq >= _TINY_NORM_SQUARED else 1.0
    return a_coeff * a + b_coeff * b


def combine(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return the Adasum of the rows of ``rows`` (one flat vector per rank, rank order) in ``dtype``.

    Args:
        rows: a (power-of-2 ranks, elements) tensor.
        dtype: the tensor's own dtype: every level's result is rounded to it, as
            Horovod stores each level in the reduced buffer.
    """
    vectors = list(rows.to(torch.float64).unbind(0))
    level = 1
    while level < len(vectors):
        for low in range(0, len(vectors), 2 * level):
            vectors[low] = pair(vectors[low], vectors[low + level]).to(dtype).to(torch.float64)
        level *= 2
    return vectors[0].to(dtype)


def adasum_async(comm: Communicator, tensor: torch.Tensor, *, check: str | None = "", label: str = "") -> Handle:
    """Start the Adasum of ``tensor`` over ``comm``'s ranks; the handle yields a new tensor of its shape.

    Args:
        comm: the communicator (its size a power of 2).
        tensor: a float16, float32 or float64 tensor of the same shape on every rank.
        check: the name under which the ranks agree on shape and dtype first.
        label: what it is for (Horovod's ``name``), as stall reports name it.
    """
    check_adasum(comm.size, tensor.dtype)
    # One row per rank: a rank whose tensor has another length fails the agreement on every rank.
    row = tensor.detach().reshape(1, -1).contiguous()
    handle = comm.allgather_async(row, check=check, label=label)
    return handle.then(lambda rows: combine(rows, tensor.dtype).reshape(tensor.shape))
