"""Map a rank to its device and its CPU threads."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..env.base import RankLayout

__all__ = ["NodePeer", "describe_self", "select_device", "set_cpu_threads", "usable_cpus", "visible_gpu_ids"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodePeer:
    """What one rank on a node sees: its GPUs (stable ids) and the CPUs it may run on."""

    gpu_ids: tuple[str, ...]
    cpus: frozenset[int]


def usable_cpus() -> frozenset[int]:
    """Return the CPUs this process may run on (its affinity mask)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def visible_gpu_ids() -> tuple[str, ...]:
    """Return stable ids (UUIDs) of the GPUs this process sees."""
    if not torch.cuda.is_available():
        return ()
    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        ids.append(str(getattr(props, "uuid", index)))
    return tuple(ids)


def describe_self() -> NodePeer:
    """Return this process's NodePeer, to be gathered over the ranks of its node."""
    return NodePeer(visible_gpu_ids(), usable_cpus())


def select_device(
    layout: RankLayout, allow_gpu_sharing: bool, node_peers: Sequence[NodePeer] | None = None
) -> torch.device:
    """Return ``cuda:(local_rank % visible GPUs)`` when CUDA is available, else CPU.

    Args:
        layout: this rank's place in the job.
        allow_gpu_sharing: permit more ranks on the node than GPUs.
        node_peers: every local rank's NodePeer (from MPI), which tells one GPU per
            task (each rank sees a different GPU as cuda:0) from ranks that really
            share GPUs; None when the ranks cannot be asked.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if layout.local_size > visible and not allow_gpu_sharing:
        if node_peers is not None:
            distinct = len({gpu for peer in node_peers for gpu in peer.gpu_ids})
        elif os.environ.get("CUDA_VISIBLE_DEVICES"):
            # Without MPI the other ranks cannot be asked; a per-process
            # CUDA_VISIBLE_DEVICES is how launchers (srun --gpus-per-task) bind one GPU each.
            distinct = layout.local_size
        else:
            distinct = visible
        if layout.local_size > distinct:
            raise RuntimeError(
                f"{layout.local_size} ranks on this node but only {distinct} GPUs: start at most "
                f"{distinct} ranks per node, or pass init(allow_gpu_sharing=True)"
            )
    return torch.device("cuda", layout.local_rank % visible)


def _ranks_sharing(cpus, layout: RankLayout, node_peers: Sequence[NodePeer] | None) -> int:
    """How many local ranks share this rank's CPUs (``cpus``, its affinity mask)."""
    if node_peers is not None:
        return max(1, sum(1 for peer in node_peers if peer.cpus == cpus))
    node_cpus = os.cpu_count() or len(cpus)
    return max(1, layout.local_size if len(cpus) >= node_cpus else 1)


def ranks_outnumber_cores(layout: RankLayout, node_peers: Sequence[NodePeer] | None = None) -> bool:
    """Whether the local ranks sharing this rank's CPUs are more than those CPUs (an oversubscribed node).

    Args:
        layout: this rank's place in the job.
        node_peers: every local rank's NodePeer, or None when unknown.
    """
    cpus = usable_cpus()
    return _ranks_sharing(cpus, layout, node_peers) > len(cpus)


def set_cpu_threads(layout: RankLayout, num_threads: int | None, node_peers: Sequence[NodePeer] | None = None) -> int:
    """Set torch's intra-op threads for this rank and return the number used.

    OMP_NUM_THREADS, when set, wins. Otherwise the rank's CPUs (its affinity mask)
    are split evenly between the local ranks that share that very mask: a rank bound
    to its own cores uses them all, ranks bound to one socket (Open MPI's default
    past two ranks) or not bound at all divide it.

    Args:
        layout: this rank's place in the job.
        num_threads: an explicit count, or None to derive it.
        node_peers: every local rank's NodePeer, or None when unknown (then an
            unbound rank assumes all local ranks share the node).
    """
    if num_threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        cpus = usable_cpus()
        num_threads = len(cpus) // _ranks_sharing(cpus, layout, node_peers)
    num_threads = max(1, num_threads)
    torch.set_num_threads(num_threads)
    return num_threads
