"""Start this rank: environment -> ranks -> device -> backend -> communicator -> threads.

The core of ``hpcddp.init()`` (``lifecycle`` adds the features that hang off a
started job: abort on failure, the stall inspector, the torch.distributed backend,
the timeline).
"""

from __future__ import annotations

import array
import functools
import logging

import torch

from ..comm._cuda_events import set_rank_cuda_device
from ..comm.base import Communicator
from ..comm.mpi.waits import share_cores
from ..env import ClusterEnvironment, RankLayout, detect_environment
from ..env.gpus import gpus_bound_per_task
from .config import InitConfig
from .device import (
    JobDevices,
    NodePeer,
    RankDevice,
    assumed_node_peers,
    check_gpu_sharing,
    choose_backend,
    describe_self,
    place_rank,
    ranks_outnumber_cores,
    set_cpu_threads,
)
from .exports import export_layout, export_rendezvous, forget_chosen_port
from .state import Runtime, at_shutdown

__all__ = ["start"]

log = logging.getLogger("hpcddp")


def start(config: InitConfig) -> Runtime:
    """Find this rank, pick its device and backend, make its communicator and set its threads.

    Collective over the launcher's ranks (they gather each node's devices and agree on
    the backend with one small allreduce).

    Args:
        config: the settings ``hpcddp.init()`` resolved from its arguments and the environment.
    """
    taken = forget_chosen_port()
    environment = detect_environment()
    layout = environment.layout()
    mpi_comm = environment.mpi_comm
    if mpi_comm is not None:
        # Every rank gathers (a collective), so that ranks seeing different GPU counts cannot hang.
        me, node_peers = _gather_node_peers(mpi_comm, environment.environ)
    else:
        me = layout.local_rank
        node_peers = assumed_node_peers(describe_self(), layout, gpus_bound_per_task(environment.environ))
    placed = place_rank(layout.rank, me, node_peers)
    job = _agree(mpi_comm, placed, layout.world_size, config.allow_gpu_sharing)
    check_gpu_sharing(job, placed)
    chosen, reason = choose_backend(config.backend, job, mpi_launched=mpi_comm is not None)
    _check_mpi_launcher(chosen, environment, layout)
    if reason is not None and layout.rank == 0:
        log.warning("%s", reason)
    device = placed.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Communication threads take this device, not the one selected where they are made (a
    # communicator made under `with torch.cuda.device(k)`): CUDA's current device is per thread.
    set_rank_cuda_device(device.index if device.type == "cuda" else None)
    try:
        export_layout(environment, layout)
        export_rendezvous(environment.away_from(environment.rendezvous(config.interface), taken))
        comm = _create_communicator(
            chosen, environment, layout, device, config, lazy=config.backend == "auto" and chosen == "nccl"
        )
        comm.check_collectives = config.check_collectives
        threads = set_cpu_threads(layout, config.num_threads, node_peers if mpi_comm is not None else None)
        share_cores(ranks_outnumber_cores(layout, node_peers if mpi_comm is not None else None))
    except BaseException:
        # No job started: a thread made after this (a later init's, a script's own) must not
        # take the device of a start that failed.
        set_rank_cuda_device(None)
        raise
    at_shutdown(_forget_rank_cuda_device, at_exit=False)
    return Runtime(config, environment, layout, device, comm, threads)


def _forget_rank_cuda_device() -> None:
    """After ``shutdown()``, threads take the device of the thread that makes them again, as before ``init()``."""
    set_rank_cuda_device(None)


def _gather_node_peers(mpi_comm, environ) -> tuple[int, list[NodePeer]]:
    """This rank's position among its node's ranks, and what each of them sees (in local-rank order)."""
    from ..env.mpi import node_order_key
    from ..env.mpi_import import import_mpi

    node = mpi_comm.Split_type(import_mpi().COMM_TYPE_SHARED, key=node_order_key(environ, mpi_comm))
    try:
        return node.Get_rank(), node.allgather(describe_self())
    finally:
        node.Free()


def _agree(mpi_comm, placed: RankDevice, world_size: int, allow_gpu_sharing: bool) -> JobDevices:
    """One allreduce of five numbers: every rank then knows who lacks a GPU, shares one or forbids sharing.

    Every rank then decides alike.

    Without MPI the ranks cannot be asked before the backend exists: the decision is this rank's own.
    """
    numbers = array.array("q", JobDevices.as_numbers(placed, world_size, allow_gpu_sharing))
    if mpi_comm is not None:
        from ..env.mpi_import import import_mpi

        MPI = import_mpi()  # noqa: N806 - mpi4py's name
        mpi_comm.Allreduce(MPI.IN_PLACE, [numbers, MPI.INT64_T], op=MPI.MIN)
    return JobDevices.from_numbers(numbers, world_size)


def _check_mpi_launcher(chosen: str, environment: ClusterEnvironment, layout: RankLayout) -> None:
    if chosen == "mpi" and environment.mpi_comm is None and layout.world_size > 1:
        raise RuntimeError(
            f"backend='mpi' needs ranks started by an MPI launcher, but this job was started by "
            f"{environment.name}: launch with mpirun or srun --mpi=pmix, or use backend='gloo'"
        )


def _create_communicator(
    name: str, environment, layout: RankLayout, device, config: InitConfig, *, lazy: bool = False
) -> Communicator:
    """Make the communicator for backend ``name``.

    ``lazy``: nccl that "auto" chose. torch.distributed's default group is then made at
    hpcddp's first collective, not here, so that a script's own
    ``init_process_group("mpi")`` after ``hpcddp.init()`` makes the group it asked for
    (hpcddp's collectives then run on that group), as under torchrun.
    """
    if name == "local":
        from ..comm.local import LocalCommunicator

        return LocalCommunicator()
    if name == "mpi":
        from ..comm.mpi import MPICommunicator

        if environment.mpi_comm is None:  # a single process that asked for MPI
            from ..env.mpi_import import import_mpi

            return MPICommunicator(import_mpi().COMM_WORLD, hierarchical=config.hierarchical_allreduce)
        return MPICommunicator(environment.mpi_comm, hierarchical=config.hierarchical_allreduce)
    import torch.distributed as dist

    from ..comm.rendezvous import join_process_group, join_through_env
    from ..comm.torchdist import TorchDistCommunicator

    if dist.is_initialized():  # the script made the default group before init()
        return TorchDistCommunicator(name, device)
    if environment.script_makes_process_group:
        # The script's own init_process_group makes the group (hpcddp joins it then);
        # when hpcddp's collectives come first, they make it through torch's env://.
        join = functools.partial(
            join_through_env, name, layout.rank, layout.world_size, timeout_s=config.dist_timeout, device=device
        )
        return TorchDistCommunicator(
            name, device, rank=layout.rank, size=layout.world_size, join=join, adopt_backend=lazy
        )
    join = functools.partial(
        join_process_group,
        name,
        layout.rank,
        layout.world_size,
        timeout_s=config.dist_timeout,
        device=device,
        mpi_comm=environment.mpi_comm,
    )
    if lazy:
        return TorchDistCommunicator(
            name, device, rank=layout.rank, size=layout.world_size, join=join, adopt_backend=True
        )
    join()
    return TorchDistCommunicator(name, device)
