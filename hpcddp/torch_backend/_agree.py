"""Agreement on a collective's metadata before any byte moves: a mismatch is an error on every rank.

MPI moves whatever counts each rank passes: a rank with a shorter tensor would
reduce into a prefix, or receive a truncated message, and the job would go on
with wrong numbers. One small allgather of (shape, dtype, root, op) per
collective turns that into an exception naming the collective and the ranks,
raised alike on every rank, so the job can end with it or catch it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CollectiveMismatchError", "agree", "describe"]


class CollectiveMismatchError(RuntimeError):
    """Ranks called the same collective with tensors or arguments that do not match."""


def describe(tensors: Sequence[torch.Tensor]) -> str:
    """Return ``float32[4, 2]`` for one tensor, a comma-separated list for several."""
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)


def agree(mpi_comm, collective: str, local: dict[str, Any], group_ranks: Sequence[int] | None = None) -> list[dict]:
    """Allgather ``local`` (this rank's metadata) and raise unless every rank passed the same.

    Args:
        mpi_comm: the group's mpi4py communicator (call on its communication thread).
        collective: the torch.distributed name, for the message.
        local: what must match, e.g. ``{"tensor": "float32[4]", "op": "SUM"}``; keys
            starting with ``_`` travel but are not compared (the caller checks them);
            ``_error``, a rank's own argument error, fails the collective on every rank.
        group_ranks: global ranks of the group's members, to name ranks as the user knows them.

    Returns:
        Every rank's ``local``, in group rank order.
    """
    every = mpi_comm.allgather(local)
    names = list(group_ranks) if group_ranks is not None else list(range(len(every)))
    refused = [f"rank {names[r]}: {d['_error']}" for r, d in enumerate(every) if d.get("_error")]
    if refused:
        raise CollectiveMismatchError(f"{collective}: " + "; ".join(refused))
    compared = [{k: v for k, v in d.items() if not k.startswith("_")} for d in every]
    if any(c != compared[0] for c in compared[1:]):
        raise CollectiveMismatchError(mismatch_message(collective, compared, group_ranks))
    return every


def mismatch_message(collective: str, every: list[dict], group_ranks: Sequence[int] | None = None) -> str:
    """Return one line: the collective, then each distinct argument set with the ranks that passed it."""
    names = list(group_ranks) if group_ranks is not None else list(range(len(every)))
    groups: dict[str, list[int]] = {}
    for rank, desc in enumerate(every):
        text = ", ".join(f"{k} {v}" for k, v in desc.items())
        groups.setdefault(text, []).append(names[rank])
    parts = "; ".join(f"{_ranks(r)}: {text}" for text, r in groups.items())
    return (
        f"{collective}: the ranks passed different arguments ({parts}); every rank must pass the same "
        "shapes, dtypes, root and op to a collective, nothing was transferred"
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
