"""Start this rank: environment -> ranks -> device -> backend -> communicator -> threads.

The core of ``hpcddp.init()`` (``lifecycle`` adds the features that hang off a
started job: abort on failure, the stall inspector, the torch.distributed backend,
the timeline).
"""

from __future__ import annotations

import functools

import torch

from ..comm.base import Communicator
from ..comm.waits import share_cores
from ..env import ClusterEnvironment, RankLayout, detect_environment
from .config import InitConfig
from .device import NodePeer, describe_self, ranks_outnumber_cores, select_device, set_cpu_threads
from .exports import export_layout, export_rendezvous
from .state import Runtime

__all__ = ["start"]


def start(config: InitConfig) -> Runtime:
    """Find this rank, pick its device and backend, make its communicator and set its threads.

    Collective over the launcher's ranks (they gather each node's devices).

    Args:
        config: the settings ``hpcddp.init()`` resolved from its arguments and the environment.
    """
    environment = detect_environment()
    layout = environment.layout()
    mpi_comm = environment.mpi_comm
    # Every rank gathers (a collective), so that ranks seeing different GPU counts cannot hang.
    node_peers = None if mpi_comm is None else _gather_node_peers(mpi_comm)
    device = select_device(layout, config.allow_gpu_sharing, node_peers)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chosen = _choose_backend(config.backend, environment, layout, device)
    export_layout(environment, layout)
    export_rendezvous(environment.rendezvous(config.interface))
    comm = _create_communicator(chosen, environment, layout, device, config)
    comm.check_collectives = config.check_collectives
    threads = set_cpu_threads(layout, config.num_threads, node_peers)
    share_cores(ranks_outnumber_cores(layout, node_peers))
    return Runtime(config, environment, layout, device, comm, threads)


def _gather_node_peers(mpi_comm) -> list[NodePeer]:
    from ..env.mpi_import import import_mpi

    node = mpi_comm.Split_type(import_mpi().COMM_TYPE_SHARED)
    try:
        return node.allgather(describe_self())
    finally:
        node.Free()


def _choose_backend(requested: str, environment: ClusterEnvironment, layout: RankLayout, device) -> str:
    if requested == "nccl" and device.type != "cuda":
        raise RuntimeError("backend='nccl' needs CUDA, but torch sees no GPU: use backend='mpi' or 'gloo'")
    if requested == "mpi" and environment.mpi_comm is None and layout.world_size > 1:
        raise RuntimeError(
            f"backend='mpi' needs ranks started by an MPI launcher, but this job was started by "
            f"{environment.name}: launch with mpirun or srun --mpi=pmix, or use backend='gloo'"
        )
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "nccl"
    if environment.mpi_comm is not None:
        return "mpi"
    return "local" if layout.world_size == 1 else "gloo"


def _create_communicator(name: str, environment, layout: RankLayout, device, config: InitConfig) -> Communicator:
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
        return TorchDistCommunicator(name, device, rank=layout.rank, size=layout.world_size, join=join)
    join_process_group(
        name,
        layout.rank,
        layout.world_size,
        timeout_s=config.dist_timeout,
        device=device,
        mpi_comm=environment.mpi_comm,
    )
    return TorchDistCommunicator(name, device)
