"""``hpcddp.init()``: environment -> ranks -> device -> backend -> threads."""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._abort import install_exception_hooks, mark_configuration_error
from .comm.base import Communicator
from .config import InitConfig
from .device import NodePeer, describe_self, select_device, set_cpu_threads
from .env import ClusterEnvironment, RankLayout, detect_environment
from .env.settings import read_settings

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = [
    "backend",
    "communicator",
    "device",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "node_rank",
    "num_nodes",
    "rank",
    "shutdown",
    "size",
]

log = logging.getLogger("hpcddp")


@dataclass
class _Runtime:
    config: InitConfig
    environment: ClusterEnvironment
    layout: RankLayout
    device: torch.device
    comm: Communicator
    num_threads: int
    timeline: Timeline | None = None


_runtime: _Runtime | None = None


def init(
    backend: str = "auto",
    *,
    num_threads: int | None = None,
    allow_gpu_sharing: bool = False,
    stall_timeout: float | None = None,
    stall_action: str | None = None,
    timeline: str | os.PathLike | None = None,
) -> None:
    """Join the job: find this rank, pick its device and backend, set its CPU threads.

    Safe to call again (a no-op once initialised). Works under mpirun/mpiexec, srun,
    torchrun and as a plain single process.

    Args:
        backend: "auto" (nccl with CUDA, else mpi), "mpi", "nccl" or "gloo".
        num_threads: torch intra-op threads for this rank; derived from the CPUs the
            rank may use when None (and left alone when OMP_NUM_THREADS is set).
        allow_gpu_sharing: allow more ranks on a node than it has GPUs.
        stall_timeout: seconds a collective may wait for the other ranks before
            the stall inspector reports who is missing and why (mpi backend);
            0 turns it off. Default HPCDDP_STALL_TIMEOUT, else 60.
        stall_action: "abort" (default, or HPCDDP_STALL_ACTION) ends the job after
            a stall report, "warn" only prints it.
        timeline: write a Chrome-trace timeline (forward, backward, step, every
            bucket's reduction) to this path at shutdown. Default HPCDDP_TIMELINE.

    Once more than one rank runs, an uncaught exception on any rank prints its
    traceback with the rank and ends the whole job. A configuration error (bad
    argument or variable, missing mpi4py, too few GPUs, mismatched world sizes) is
    raised as usual; left uncaught it prints as one line, not a traceback.
    """
    if _runtime is not None:
        return
    try:
        _init(backend, num_threads, allow_gpu_sharing, stall_timeout, stall_action, timeline)
    except (ValueError, RuntimeError, ImportError) as err:
        mark_configuration_error(err)
        raise


def _init(backend, num_threads, allow_gpu_sharing, stall_timeout, stall_action, timeline) -> None:
    global _runtime
    explicit = {"stall_timeout": stall_timeout, "stall_action": stall_action, "timeline": timeline}
    settings = {**read_settings(os.environ), **{k: v for k, v in explicit.items() if v is not None}}
    config = InitConfig(backend=backend, num_threads=num_threads, allow_gpu_sharing=allow_gpu_sharing, **settings)
    environment = detect_environment()
    layout = environment.layout()
    mpi_comm = environment.mpi_comm
    # Every rank gathers (a collective), so that ranks seeing different GPU counts cannot hang.
    node_peers = None if mpi_comm is None else _gather_node_peers(mpi_comm)
    device = select_device(layout, config.allow_gpu_sharing, node_peers)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    chosen = _choose_backend(config.backend, environment, layout, device)
    _export_variables(environment, layout)
    _export_rendezvous(environment)
    comm = _create_communicator(chosen, environment, layout, device, config)
    if layout.world_size > 1:
        install_exception_hooks(layout.rank, use_mpi=mpi_comm is not None or chosen == "mpi")
    threads = set_cpu_threads(layout, config.num_threads, node_peers)
    _runtime = _Runtime(config, environment, layout, device, comm, threads)
    if chosen in ("gloo", "nccl") and layout.world_size > 1:
        # Leave torch.distributed together even when the script never calls shutdown().
        shutdown_at_exit()
    if config.timeline is not None:
        from .timeline import start

        start(config.timeline)
    log.debug(
        "hpcddp rank %d/%d on %s, backend %s, %d threads", layout.rank, layout.world_size, device, chosen, threads
    )


_shutdown_registered = False


def shutdown_at_exit() -> None:
    """Make sure ``shutdown()`` runs at interpreter exit (once, however often asked).

    For what must end collectively: torch.distributed groups, timelines.
    """
    global _shutdown_registered
    if not _shutdown_registered:
        atexit.register(shutdown)
        _shutdown_registered = True


def _gather_node_peers(mpi_comm) -> list[NodePeer]:
    from ._mpi import import_mpi

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
        from .comm.local import LocalCommunicator

        return LocalCommunicator()
    if name == "mpi":
        from .comm.mpi import MPICommunicator

        stall = {"stall_timeout": config.stall_timeout, "stall_action": config.stall_action}
        if environment.mpi_comm is None:  # a single process that asked for MPI
            from ._mpi import import_mpi

            return MPICommunicator(import_mpi().COMM_WORLD, **stall)
        return MPICommunicator(environment.mpi_comm, **stall)
    import torch.distributed as dist

    from .comm.torchdist import TorchDistCommunicator, join_process_group

    if not dist.is_initialized():
        # torch.distributed has no stall inspector: a collective that waits longer
        # than stall_timeout fails (gloo) or aborts (NCCL's watchdog) instead.
        join_process_group(name, layout.rank, layout.world_size, timeout_s=config.stall_timeout or 1800, device=device)
    return TorchDistCommunicator(name, device)


def _export_variables(environment: ClusterEnvironment, layout: RankLayout) -> None:
    """Export torchrun's variables so code that uses torch.distributed directly works."""
    values = {
        "RANK": layout.rank,
        "WORLD_SIZE": layout.world_size,
        "LOCAL_RANK": layout.local_rank,
        "LOCAL_WORLD_SIZE": layout.local_size,
        "NODE_RANK": layout.node_rank,
    }
    for name, value in values.items():
        current = os.environ.get(name)
        if current is not None and current != str(value):
            log.warning("hpcddp: overriding %s=%s with %s from %s", name, current, value, environment.name)
        os.environ[name] = str(value)


def _export_rendezvous(environment: ClusterEnvironment) -> None:
    """Agree on torch.distributed's MASTER_ADDR/MASTER_PORT and export them.

    The environment decides (under MPI: rank 0's pair, the user's when set, else a
    free port, broadcast to all); a rank whose own differing value is replaced is warned.
    """
    address, port = environment.rendezvous()
    for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", str(port))):
        current = os.environ.get(name)
        if current and current != value:
            log.warning("hpcddp: overriding %s=%s with %s", name, current, value)
        os.environ[name] = value


def _require() -> _Runtime:
    if _runtime is None:
        raise RuntimeError("hpcddp is not initialised: call hpcddp.init() first")
    return _runtime


def is_initialized() -> bool:
    """Return True between ``init()`` and ``shutdown()``."""
    return _runtime is not None


def rank() -> int:
    """Return this process's rank in the job (0 .. size()-1)."""
    return _require().layout.rank


def size() -> int:
    """Return the number of ranks in the job."""
    return _require().layout.world_size


def local_rank() -> int:
    """Return this process's rank among the ranks on its node."""
    return _require().layout.local_rank


def local_size() -> int:
    """Return the number of ranks on this node."""
    return _require().layout.local_size


def node_rank() -> int:
    """Return the index of this node in the job (0 .. num_nodes()-1)."""
    return _require().layout.node_rank


def num_nodes() -> int:
    """Return the number of nodes in the job."""
    return _require().layout.num_nodes


def device() -> torch.device:
    """Return the device this rank computes on (``cuda:N`` or ``cpu``)."""
    return _require().device


def backend() -> str:
    """Return the communication backend in use: "mpi", "nccl", "gloo" or "local"."""
    return _require().comm.name


def current_timeline() -> Timeline | None:
    """Return the timeline being recorded, or None (for ``hpcddp.timeline``)."""
    return None if _runtime is None else _runtime.timeline


def set_timeline(recorder: Timeline | None) -> None:
    """Install or remove the timeline being recorded (for ``hpcddp.timeline``)."""
    _require().timeline = recorder


def communicator() -> Communicator:
    """Return the active Communicator (for wrappers and tests)."""
    return _require().comm


def shutdown() -> None:
    """Leave the job: write the timeline (if recording), stop the communication thread
    and destroy the process group. Collective when a timeline is recorded.

    MPI itself stays initialised (it cannot be re-initialised in one process);
    mpi4py finalises it at exit.
    """
    global _runtime
    if _runtime is not None:
        from .timeline import stop

        stop()
        _runtime.comm.close()
        _runtime = None
