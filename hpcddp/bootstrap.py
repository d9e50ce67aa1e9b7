"""``hpcddp.init()``: environment -> ranks -> device -> backend -> threads."""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._abort import install_exception_hooks, mark_configuration_error
from .comm.base import Communicator
from .config import InitConfig
from .device import NodePeer, describe_self, select_device, set_cpu_threads
from .env import ClusterEnvironment, RankLayout, Rendezvous, detect_environment
from .env.network import SOCKET_IFNAME_VARIABLES, socket_ifname_hint
from .env.settings import read_settings, run_status_dir

__all__ = [
    "at_shutdown",
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


_runtime: _Runtime | None = None
#: what shutdown() runs first, newest first: collective endings such as writing a timeline
_shutdown_callbacks: list[Callable[[], object]] = []


def init(
    backend: str = "auto",
    *,
    num_threads: int | None = None,
    allow_gpu_sharing: bool = False,
    interface: str | None = None,
    stall_timeout: float | None = None,
    stall_abort_after: float | None = None,
    stall_action: str | None = None,
    dist_timeout: float | None = None,
    hierarchical_allreduce: bool | None = None,
    timeline: str | os.PathLike | None = None,
    check_collectives: bool | None = None,
) -> None:
    """Join the job: find this rank, pick its device and backend, set its CPU threads.

    Safe to call again (a no-op once initialised). Works under mpirun/mpiexec, srun,
    torchrun and as a plain single process, on one node or many.

    Args:
        backend: "auto" (nccl with CUDA, else mpi), "mpi", "nccl" or "gloo";
            with "auto", HPCDDP_BACKEND decides when set.
        num_threads: torch intra-op threads for this rank; derived from the CPUs the
            rank may use when None (and left alone when OMP_NUM_THREADS is set).
        allow_gpu_sharing: allow more ranks on a node than it has GPUs.
        interface: the network interface that connects the nodes (e.g. "ib0"):
            rank 0 publishes its address for torch.distributed's rendezvous and
            gloo/NCCL use it. Default HPCDDP_IFACE, else one every node shares a
            subnet with (no host name is ever resolved).
        stall_timeout: seconds a collective may wait for the other ranks before
            the stall inspector warns which ranks are missing and why; 0 turns it
            off. Default HPCDDP_STALL_TIMEOUT, else 60.
        stall_abort_after: seconds a stalled collective may wait before the job is
            ended (0: never, for ranks that are only slow); ranks found dead or
            unreachable end it at once. Default HPCDDP_STALL_ABORT_AFTER, else 1800.
        stall_action: "abort" (default, or HPCDDP_STALL_ACTION) ends the job as
            above; "warn" only reports.
        dist_timeout: torch.distributed's timeout for gloo/nccl collectives.
            Default HPCDDP_DIST_TIMEOUT, else 1800.
        hierarchical_allreduce: on backend mpi, allreduce in two levels (inside each
            node, then between nodes). Default HPCDDP_HIERARCHICAL_ALLREDUCE, else off
            (Open MPI's own allreduce was as node-aware on the tests' virtual nodes).
        timeline: write a Chrome-trace timeline (forward, backward, step, every
            bucket's reduction) to this path at shutdown. Default HPCDDP_TIMELINE.
        check_collectives: compare every collective's shapes, dtypes, roots and ops
            across ranks before running it (hpcddp.allreduce & co., hpcddp.horovod),
            raising CollectiveMismatchError on every rank when they differ. Default
            HPCDDP_CHECK_COLLECTIVES, else True.

    Once more than one rank runs, an uncaught exception on any rank prints its
    traceback with the rank and ends the whole job. A configuration error (bad
    argument or variable, missing mpi4py, too few GPUs, mismatched world sizes, an
    unreachable rendezvous) is raised as usual; left uncaught it prints as one
    line, not a traceback.
    """
    if _runtime is not None:
        return
    explicit = {
        "interface": interface,
        "stall_timeout": stall_timeout,
        "stall_abort_after": stall_abort_after,
        "stall_action": stall_action,
        "dist_timeout": dist_timeout,
        "hierarchical_allreduce": hierarchical_allreduce,
        "timeline": timeline,
        "check_collectives": check_collectives,
    }
    try:
        _init(backend, num_threads, allow_gpu_sharing, explicit)
    except (ValueError, RuntimeError, ImportError) as err:
        mark_configuration_error(err)
        raise


def _init(backend, num_threads, allow_gpu_sharing, explicit) -> None:
    global _runtime
    settings = read_settings(os.environ)
    from_environment = settings.pop("backend", None)
    if from_environment is not None and backend == "auto":
        backend = from_environment
    elif from_environment is not None and from_environment != backend:
        log.warning("hpcddp: HPCDDP_BACKEND=%s ignored: the script passed init(backend=%r)", from_environment, backend)
    settings.update({k: v for k, v in explicit.items() if v is not None})
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
    _export_rendezvous(environment.rendezvous(config.interface))
    comm = _create_communicator(chosen, environment, layout, device, config)
    comm.check_collectives = config.check_collectives
    if layout.world_size > 1:
        install_exception_hooks(layout.rank, use_mpi=mpi_comm is not None or chosen == "mpi")
        _start_stall_inspector(mpi_comm, config)
    status = run_status_dir(os.environ)
    if status is not None and layout.world_size > 1:
        from ._run_status import mark_started

        mark_started(status, layout.rank)
    threads = set_cpu_threads(layout, config.num_threads, node_peers)
    _runtime = _Runtime(config, environment, layout, device, comm, threads)
    if chosen in ("gloo", "nccl") and layout.world_size > 1:
        # Leave torch.distributed together even when the script never calls shutdown().
        shutdown_at_exit()
    from .torch_backend import install

    install()  # init_process_group("hpcddp"), and "mpi" where torch has none
    if config.timeline is not None:
        from .timeline import start

        try:
            start(config.timeline)
        except Exception:
            shutdown()  # every rank fails here alike: leave together, as if init never ran
            raise
    # Registered last, so that it runs first at exit: before shutdown() says "called hpcddp.shutdown()".
    atexit.register(_leave_at_exit)
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


def at_shutdown(callback: Callable[[], object]) -> None:
    """Run ``callback`` in ``shutdown()`` (or at exit), before the communicator closes; once.

    Args:
        callback: called with no arguments on every rank; may use collectives.
    """
    if callback not in _shutdown_callbacks:
        _shutdown_callbacks.append(callback)
    shutdown_at_exit()


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

        if environment.mpi_comm is None:  # a single process that asked for MPI
            from ._mpi import import_mpi

            return MPICommunicator(import_mpi().COMM_WORLD, hierarchical=config.hierarchical_allreduce)
        return MPICommunicator(environment.mpi_comm, hierarchical=config.hierarchical_allreduce)
    import torch.distributed as dist

    from .comm.rendezvous import join_process_group
    from .comm.torchdist import TorchDistCommunicator

    if not dist.is_initialized():
        join_process_group(
            name,
            layout.rank,
            layout.world_size,
            timeout_s=config.dist_timeout,
            device=device,
            mpi_comm=environment.mpi_comm,
        )
    return TorchDistCommunicator(name, device)


def _start_stall_inspector(mpi_comm, config: InitConfig) -> None:
    """Start the stall inspector where MPI connects the ranks (it talks over MPI, beside any backend).

    Each rank then tells the others when it leaves (``shutdown()``, or the end of the
    process, with its exit code), so that a clean end is never taken for a lost node.
    """
    if mpi_comm is None or config.stall_timeout <= 0:
        return
    from . import stall
    from ._abort import record_exit_code

    stall.start(mpi_comm, config.stall_timeout, config.stall_action, config.stall_abort_after)
    record_exit_code()


def _leave_at_exit() -> None:
    from . import stall
    from ._abort import exit_code

    code = exit_code()
    stall.leave("ended its script" if code is None else "exited", code)


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


def _export_rendezvous(rendezvous: Rendezvous) -> None:
    """Export torch.distributed's MASTER_ADDR/MASTER_PORT and gloo's and NCCL's interface.

    The environment decided (under MPI: rank 0's choice, broadcast to all). A rank
    whose own differing MASTER_* value is replaced is warned; GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME set by the user are kept, with a warning when they name
    another interface than the one that reaches rank 0.
    """
    for name, value in (("MASTER_ADDR", rendezvous.address), ("MASTER_PORT", str(rendezvous.port))):
        current = os.environ.get(name)
        if current and current != value:
            log.warning("hpcddp: overriding %s=%s with %s", name, current, value)
        os.environ[name] = value
    if rendezvous.interface is None:
        return
    source = "HPCDDP_IFACE" if rendezvous.interface_named else f"the interface that reaches {rendezvous.address}"
    for name in SOCKET_IFNAME_VARIABLES:
        current = os.environ.get(name, "").strip()
        if not current:
            os.environ[name] = rendezvous.interface
        elif current != rendezvous.interface and socket_ifname_hint({name: current}) == current:
            log.warning(
                "hpcddp: %s=%s differs from %s (%s): keeping %s; unset it to use %s",
                name,
                current,
                rendezvous.interface,
                source,
                name,
                rendezvous.interface,
            )


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


def launcher_comm():
    """Return the launcher's MPI communicator over all ranks, or None (srun without MPI, torchrun)."""
    return _require().environment.mpi_comm


def environment_name() -> str:
    """Return the name of the launch environment init() detected (e.g. "mpirun", "slurm")."""
    return _require().environment.name


def new_mpi_communicator(mpi_comm):
    """Return an ``MPICommunicator`` over ``mpi_comm`` (collective over it); the stall inspector sees it.

    Args:
        mpi_comm: an mpi4py communicator; it is duplicated.
    """
    from .comm.mpi import MPICommunicator

    _require()
    return MPICommunicator(mpi_comm)


def communicator() -> Communicator:
    """Return the active Communicator (for wrappers and tests)."""
    return _require().comm


def shutdown() -> None:
    """Leave the job: run what was registered with ``at_shutdown`` (writing a timeline),
    stop the communication thread and destroy the process group. Collective when a
    timeline is recorded.

    MPI itself stays initialised (it cannot be re-initialised in one process);
    mpi4py finalises it at exit.
    """
    global _runtime
    if _runtime is not None:
        while _shutdown_callbacks:
            _shutdown_callbacks.pop()()
        from . import stall

        stall.leave("called hpcddp.shutdown()")
        _runtime.comm.close()
        _runtime = None
