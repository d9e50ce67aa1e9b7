"""Map a rank to its device and its CPU threads."""

from __future__ import annotations

import logging
import os

import torch

from .env.base import RankLayout

__all__ = ["select_device", "set_cpu_threads", "usable_cpus", "visible_gpu_ids"]

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """Return how many CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def select_device(layout: RankLayout, allow_gpu_sharing: bool, gpu_ids_on_node=None) -> torch.device:
    """Return ``cuda:(local_rank % visible GPUs)`` when CUDA is available, else CPU.

    Args:
        layout: this rank's place in the job.
        allow_gpu_sharing: permit more ranks on the node than GPUs.
        gpu_ids_on_node: callable returning every local rank's tuple of visible GPU
            ids; used to tell one-GPU-per-task binding (each rank sees a different
            GPU as cuda:0) from ranks that really share GPUs.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if layout.local_size > visible and not allow_gpu_sharing:
        distinct = visible
        if gpu_ids_on_node is not None:
            seen = gpu_ids_on_node()
            distinct = len({gpu for ids in seen for gpu in ids})
        if layout.local_size > distinct:
            raise RuntimeError(
                f"{layout.local_size} ranks on this node but only {distinct} GPUs: start at most "
                f"{distinct} ranks per node, or pass init(allow_gpu_sharing=True)"
            )
    return torch.device("cuda", layout.local_rank % visible)


def visible_gpu_ids() -> tuple[str, ...]:
    """Return stable ids (UUIDs) of the GPUs this process sees."""
    if not torch.cuda.is_available():
        return ()
    ids = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        ids.append(str(getattr(props, "uuid", index)))
    return tuple(ids)


def set_cpu_threads(layout: RankLayout, num_threads: int | None) -> int:
    """Set torch's intra-op threads for this rank and return the number used.

    OMP_NUM_THREADS, when set, wins. Otherwise a rank bound to a CPU set uses that
    set; an unbound rank shares the node's CPUs with the other local ranks.

    Args:
        layout: this rank's place in the job.
        num_threads: an explicit count, or None to derive it.
    """
    if num_threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        cpus = usable_cpus()
        node_cpus = os.cpu_count() or cpus
        num_threads = cpus if cpus < node_cpus else node_cpus // layout.local_size
    num_threads = max(1, num_threads)
    torch.set_num_threads(num_threads)
    return num_threads
