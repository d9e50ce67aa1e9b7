"""Map a rank to its device and its CPU threads."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..env.base import RankLayout

__all__ = [
    "GPU",
    "JobDevices",
    "NodePeer",
    "RankDevice",
    "assumed_node_peers",
    "check_gpu_sharing",
    "choose_backend",
    "describe_self",
    "gpu_index",
    "place_rank",
    "set_cpu_threads",
    "threads_follow_world_size",
    "usable_cpus",
    "visible_gpus",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPU:
    """One CUDA device a process sees: a whole GPU or one MIG slice of it."""

    uuid: str
    """CUDA's UUID: one per GPU and one per MIG slice; two ranks with the same one share a device."""
    pci_bus_id: str
    """The PCI address of the physical GPU ("0000:3b:00.0"). MIG slices of one GPU share it, and
    NCCL refuses two ranks at one address ("Duplicate GPU detected": it compares bus ids)."""


@dataclass(frozen=True)
class NodePeer:
    """What one rank on a node sees: its GPUs, in CUDA's order (cuda:0 first), and the CPUs it may run on."""

    gpus: tuple[GPU, ...]
    cpus: frozenset[int]


def usable_cpus() -> frozenset[int]:
    """Return the CPUs this process may run on (its affinity mask)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def visible_gpus() -> tuple[GPU, ...]:
    """Return the GPUs (or MIG slices) this process sees, in CUDA's order, with their UUIDs and PCI addresses."""
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        address = "{:04x}:{:02x}:{:02x}.0".format(
            getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", index), getattr(props, "pci_device_id", 0)
        )
        gpus.append(GPU(str(getattr(props, "uuid", address)), address))
    return tuple(gpus)


def describe_self() -> NodePeer:
    """Return this process's NodePeer, to be gathered over the ranks of its node."""
    return NodePeer(visible_gpus(), usable_cpus())


def assumed_node_peers(me: NodePeer, layout: RankLayout, bound_per_task: bool) -> list[NodePeer]:
    """Return the node's peers as this rank can guess them when MPI cannot ask them (torchrun, srun without MPI).

    Args:
        me: what this rank sees.
        layout: this rank's place in the job.
        bound_per_task: the launcher gave each task GPUs of its own (srun's per-task
            binding: each sees its own GPU as cuda:0); otherwise every local rank sees
            what this one sees (torchrun's workers inherit its CUDA_VISIBLE_DEVICES).
    """
    peers = []
    for local_rank in range(layout.local_size):
        if local_rank == layout.local_rank or not bound_per_task:
            peers.append(me)
        else:  # another task's own GPUs: distinct, as the launcher bound them
            peers.append(
                NodePeer(
                    tuple(GPU(f"{g.uuid}@task{local_rank}", f"{g.pci_bus_id}@task{local_rank}") for g in me.gpus),
                    me.cpus,
                )
            )
    return peers


def gpu_index(me: int, node_peers: Sequence[NodePeer]) -> int | None:
    """Return the index (cuda:N) of the GPU local rank ``me`` uses, or None when it sees none.

    The local ranks that see the same GPUs take them in turn, in local-rank order: all
    of a node's GPUs visible to every rank gives local rank i cuda:i (what
    ``torch.cuda.set_device(LOCAL_RANK)`` does); one GPU per task (srun
    ``--gpus-per-task=1``) gives every rank its own cuda:0.

    Args:
        me: this rank's position in ``node_peers``.
        node_peers: every rank of the node, in local-rank order.
    """
    return _gpu_indices(node_peers)[me]


def _gpu_indices(node_peers: Sequence[NodePeer]) -> list[int | None]:
    """Every local rank's ``gpu_index``, in one pass over the node."""
    taken: dict[tuple[GPU, ...], int] = {}
    indices: list[int | None] = []
    for peer in node_peers:
        if not peer.gpus:
            indices.append(None)
            continue
        turn = taken.get(peer.gpus, 0)
        taken[peer.gpus] = turn + 1
        indices.append(turn % len(peer.gpus))
    return indices


@dataclass(frozen=True)
class RankDevice:
    """The GPU one rank will use and what that means for the backend: this rank's part of the job's agreement."""

    rank: int
    index: int | None
    """cuda:index, or None: the CPU."""
    shares_gpu: bool
    """Another rank of the node uses the same GPU or MIG slice (same UUID)."""
    shares_pci_address: bool
    """Another rank of the node uses a device at the same PCI address (the same GPU, or
    MIG slices of one GPU): NCCL refuses that."""
    node_ranks: int
    node_gpus: int
    """How many ranks and distinct GPUs (or MIG slices) the node's ranks use, for messages."""

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return torch.device("cpu") if self.index is None else torch.device("cuda", self.index)


def place_rank(rank: int, me: int, node_peers: Sequence[NodePeer]) -> RankDevice:
    """Return the GPU rank ``rank`` (local rank ``me`` of ``node_peers``) uses, and whom it shares it with.

    Args:
        rank: this rank in the job.
        me: this rank's position in ``node_peers``.
        node_peers: every rank of the node, in local-rank order (the same list on each).
    """
    indices = _gpu_indices(node_peers)
    chosen = [None if index is None else peer.gpus[index] for peer, index in zip(node_peers, indices)]
    mine = chosen[me]
    others = [gpu for position, gpu in enumerate(chosen) if position != me and gpu is not None]
    return RankDevice(
        rank=rank,
        index=indices[me],
        shares_gpu=mine is not None and any(gpu.uuid == mine.uuid for gpu in others),
        shares_pci_address=mine is not None and any(gpu.pci_bus_id == mine.pci_bus_id for gpu in others),
        node_ranks=len(node_peers),
        node_gpus=len({gpu.uuid for gpu in chosen if gpu is not None}),
    )


@dataclass(frozen=True)
class JobDevices:
    """What the ranks agreed about their GPUs: the first rank (lowest) of each kind, ``world_size`` for none.

    Built from every rank's ``RankDevice`` and sharing setting with one allreduce (MIN) of
    five numbers (``as_numbers``/``from_numbers``), so that every rank decides the same
    backend, and raises the same error or none.
    """

    world_size: int
    first_with_gpu: int
    first_without_gpu: int
    first_sharing_gpu: int
    first_sharing_pci_address: int
    first_forbidding_sharing: int
    """The first rank whose ``allow_gpu_sharing`` is off: the setting may differ between ranks."""

    @staticmethod
    def as_numbers(placed: RankDevice, world_size: int, allow_gpu_sharing: bool) -> list[int]:
        """Return this rank's five numbers, to be reduced with MIN over the job.

        Args:
            placed: this rank's GPU.
            world_size: the number of ranks (the "none" value).
            allow_gpu_sharing: this rank's ``init(allow_gpu_sharing=)`` / HPCDDP_GPU_SHARING.
        """
        return [
            placed.rank if placed.index is not None else world_size,
            placed.rank if placed.index is None else world_size,
            placed.rank if placed.shares_gpu else world_size,
            placed.rank if placed.shares_pci_address else world_size,
            world_size if allow_gpu_sharing else placed.rank,
        ]

    @classmethod
    def from_numbers(cls, numbers: Sequence[int], world_size: int) -> JobDevices:
        """Return the agreement from the five numbers MIN-reduced over every rank."""
        return cls(world_size, *(int(n) for n in numbers))

    def _found(self, rank: int) -> bool:
        return rank < self.world_size

    @property
    def any_gpu(self) -> bool:
        """Some rank uses a GPU."""
        return self._found(self.first_with_gpu)

    @property
    def nccl_possible(self) -> bool:
        """Every rank has a GPU at a PCI address no other rank of its node uses."""
        return (
            self.any_gpu and not self._found(self.first_without_gpu) and not self._found(self.first_sharing_pci_address)
        )

    def why_not_nccl(self) -> str:
        """Say in a few words why NCCL cannot run here ("" when it can)."""
        if not self.any_gpu:
            return "no rank sees a GPU"
        if self._found(self.first_without_gpu):
            return f"rank {self.first_without_gpu} sees no GPU while rank {self.first_with_gpu} does"
        if self._found(self.first_sharing_pci_address):
            return (
                f"rank {self.first_sharing_pci_address} shares its GPU (or MIG slices of one GPU) with another rank "
                "of its node, and NCCL takes one rank per GPU"
            )
        return ""


def check_gpu_sharing(job: JobDevices, placed: RankDevice) -> None:
    """Raise on every rank when ranks would share a GPU and sharing is off on any rank.

    Args:
        job: what the ranks agreed (their sharing settings included), the same on every rank.
        placed: this rank's GPU (named in the message when its node is the one).
    """
    if job.first_forbidding_sharing >= job.world_size or job.first_sharing_gpu >= job.world_size:
        return
    gpus = f"{placed.node_gpus} GPU" + ("s" if placed.node_gpus != 1 else "")
    where = f" ({placed.node_ranks} ranks, {gpus} on this node)" if placed.shares_gpu else ""
    # Sharing is allowed only when every rank allows it: a rank that raised alone would leave the others hanging.
    unset = "" if job.first_forbidding_sharing == 0 else f" (rank {job.first_forbidding_sharing} has it off)"
    raise RuntimeError(
        f"rank {job.first_sharing_gpu} would share a GPU with another rank of its node{where}: start at most one "
        f"rank per GPU, or set HPCDDP_GPU_SHARING=1 (init(allow_gpu_sharing=True)) on every rank{unset} to share "
        "GPUs (backend 'auto' then picks mpi)"
    )


def choose_backend(requested: str, job: JobDevices, *, mpi_launched: bool) -> tuple[str, str | None]:
    """Return the backend for ``requested`` on the agreed devices, and a line saying why "auto" chose it (or None).

    Every rank passes the same ``job`` and so decides alike. "auto": nccl when every
    rank has a GPU of its own, else mpi under an MPI launcher (it stages CUDA tensors
    through the host, so ranks may share a GPU or lack one), else gloo ("local" for one process).

    Args:
        requested: "auto", "mpi", "nccl" or "gloo".
        job: what the ranks agreed about their GPUs.
        mpi_launched: MPI connects the ranks.
    """
    if requested == "nccl" and not job.nccl_possible:
        if not job.any_gpu:
            raise RuntimeError("backend='nccl' needs CUDA, but torch sees no GPU: use backend='mpi' or 'gloo'")
        raise RuntimeError(
            f"backend='nccl' needs one GPU per rank, but {job.why_not_nccl()}: use backend='mpi' "
            "(HPCDDP_BACKEND=mpi), or start one rank per GPU"
        )
    if requested != "auto":
        return requested, None
    if job.nccl_possible:
        return "nccl", None
    fallback = "mpi" if mpi_launched else ("local" if job.world_size == 1 else "gloo")
    if not job.any_gpu:
        return fallback, None
    return fallback, f"hpcddp: backend 'auto' chose {fallback}, not nccl: {job.why_not_nccl()}"


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


def threads_follow_world_size(num_threads: int | None) -> bool:
    """Whether ``set_cpu_threads`` derived the count from the cores per rank (neither given nor OMP_NUM_THREADS)."""
    return num_threads is None and not os.environ.get("OMP_NUM_THREADS")


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
