"""``hpcddp.init()`` and ``hpcddp.shutdown()``: start the rank, then what hangs off a started job.

``bootstrap.start`` makes the rank (environment, device, backend, communicator,
threads); this module adds, in order, the job-wide failure handling (an uncaught
exception ends every rank), the stall inspector, the torch.distributed backend names
and the timeline. Each feature reads the job through ``state`` and ends through
``state.at_shutdown``, so that none of them imports this module or the bootstrap.
"""

from __future__ import annotations

import atexit
import logging
import os

from ..env.settings import read_settings, read_stop_wait, run_status_dir
from ..fault import stall
from ..fault.abort import exit_code, install_exception_hooks, mark_configuration_error, record_exit_code
from ..fault.stop_signals import hold_stop_signals, release_held_signals
from . import bootstrap, state
from .config import InitConfig
from .state import shutdown

__all__ = ["init", "shutdown"]

log = logging.getLogger("hpcddp")


def init(
    backend: str = "auto",
    *,
    num_threads: int | None = None,
    allow_gpu_sharing: bool | None = None,
    interface: str | None = None,
    stall_timeout: float | None = None,
    stall_abort_after: float | None = None,
    stall_action: str | None = None,
    dist_timeout: float | None = None,
    hierarchical_allreduce: bool | str | None = None,
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
        allow_gpu_sharing: allow more ranks on a node than it has GPUs (backend "auto"
            then picks mpi: NCCL takes one rank per GPU). Default HPCDDP_GPU_SHARING, else False.
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
            node, then between nodes); "auto" when the ranks span several nodes and a
            node holds several. Default HPCDDP_HIERARCHICAL_ALLREDUCE, else off
            (Open MPI's own allreduce was as node-aware on the tests' virtual nodes).
        timeline: write a Chrome-trace timeline (forward, backward, step, every
            bucket's reduction) to this path at shutdown. Default HPCDDP_TIMELINE.
        check_collectives: compare every collective's shapes, dtypes, roots and ops
            across ranks before running it (hpcddp.allreduce & co., hpcddp.horovod),
            raising CollectiveMismatchError on every rank when they differ. Default
            HPCDDP_CHECK_COLLECTIVES, else True.

    From here on, a SIGUSR1 or SIGTERM that arrives before the script enters a
    ``PreemptionHandler`` is held for it (its first ``should_stop()`` is True), for at
    most HPCDDP_STOP_WAIT seconds (default 25; 0: not held), after which the process
    ends as the signal would end it; ``shutdown()`` ends the holding.

    Once more than one rank runs, an uncaught exception on any rank prints its
    traceback with the rank and ends the whole job. A configuration error (bad
    argument or variable, missing mpi4py, too few GPUs, mismatched world sizes, an
    unreachable rendezvous) is raised as usual; left uncaught it prints as one
    line, not a traceback.
    """
    if state.is_initialized():
        return
    explicit = {
        "allow_gpu_sharing": allow_gpu_sharing,
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
        _init(backend, num_threads, explicit)
    except (ValueError, RuntimeError, ImportError) as err:
        mark_configuration_error(err)
        raise


def _init(backend, num_threads, explicit) -> None:
    settings = read_settings(os.environ)
    from_environment = settings.pop("backend", None)
    if from_environment is not None and backend == "auto":
        backend = from_environment
    elif from_environment is not None and from_environment != backend:
        log.warning("hpcddp: HPCDDP_BACKEND=%s ignored: the script passed init(backend=%r)", from_environment, backend)
    settings.update({k: v for k, v in explicit.items() if v is not None})
    config = InitConfig(backend=backend, num_threads=num_threads, **settings)
    # Before the start, which takes minutes at scale: Slurm's stop then waits for the handler.
    hold_stop_signals(read_stop_wait(os.environ))
    runtime = bootstrap.start(config)
    layout, mpi_comm = runtime.layout, runtime.environment.mpi_comm
    if layout.world_size > 1:
        install_exception_hooks(layout.rank, use_mpi=mpi_comm is not None or runtime.comm.name == "mpi")
        _start_stall_inspector(mpi_comm, config)
    status = run_status_dir(os.environ)
    if status is not None and layout.world_size > 1:
        from ..fault.run_status import mark_started

        mark_started(status, layout.rank)
    state.install(runtime)
    state.at_shutdown(release_held_signals, at_exit=False)
    if runtime.comm.name in ("gloo", "nccl") and layout.world_size > 1:
        # Leave torch.distributed together even when the script never calls shutdown().
        state.shutdown_at_exit()
    from ..torch_backend import install

    install()  # init_process_group("hpcddp"), and "mpi" where torch has none
    if config.timeline is not None:
        from ..observe.timeline import start

        try:
            start(config.timeline)
        except Exception:
            shutdown()  # every rank fails here alike: leave together, as if init never ran
            raise
    # Registered last, so that it runs first at exit: before shutdown() says "called hpcddp.shutdown()".
    atexit.register(_leave_at_exit)
    log.debug(
        "hpcddp rank %d/%d on %s, backend %s, %d threads",
        layout.rank,
        layout.world_size,
        runtime.device,
        runtime.comm.name,
        runtime.num_threads,
    )


def _start_stall_inspector(mpi_comm, config: InitConfig) -> None:
    """Start the stall inspector where MPI connects the ranks (it talks over MPI, beside any backend).

    Each rank then tells the others when it leaves (``shutdown()``, or the end of the
    process, with its exit code), so that a clean end is never taken for a lost node.
    """
    if mpi_comm is None or config.stall_timeout <= 0:
        return
    stall.start(mpi_comm, config.stall_timeout, config.stall_action, config.stall_abort_after)
    record_exit_code()
    # First registered, so run last of shutdown()'s endings: a timeline written before it is still watched.
    state.at_shutdown(_leave_at_shutdown, at_exit=False)


def _leave_at_shutdown() -> None:
    stall.leave("called hpcddp.shutdown()")


def _leave_at_exit() -> None:
    code = exit_code()
    stall.leave("ended its script" if code is None else "exited", code)
