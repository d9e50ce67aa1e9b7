"""Make ``init_process_group("hpcddp")`` (and ``"mpi"`` on torch builds without MPI) reach hpcddp.

``hpcddp.init()`` calls ``install()``:

- ``"hpcddp"`` is registered with ``torch.distributed.Backend.register_backend``.
  With no store and no init_method, ``init_process_group`` would rendezvous at
  ``env://`` (a TCP store on MASTER_ADDR); hpcddp's ranks already know each
  other through MPI, so the call gets the rank and world size from MPI and a
  process-local store. A gloo or NCCL group made beside it needs a store every
  rank reaches: pass ``init_method="env://"`` (hpcddp.init() exported MASTER_ADDR/PORT).
- ``"mpi"``: torch sends that name to its own ``ProcessGroupMPI`` before any
  registered backend, and the wheels ship without it ("Distributed package
  doesn't have MPI built in"). When it is missing, ``install()`` puts hpcddp's
  group where torch looks for it, so ``init_process_group("mpi")`` and
  ``new_group(..., backend="mpi")`` from the tutorials run unchanged.
- ``timeout=``: torch hands it to a registered backend's creator but not to
  ``ProcessGroupMPI.create(ranks)``, so ``install()`` wraps torch's
  ``_new_process_group_helper`` to see it while the group is made. With
  HPCDDP_GROUP_TIMEOUTS=1 (else a warning: see ``_seconds``), a group whose
  timeout is not torch's default fails a collective the other ranks do not join in
  time, and is unusable after that (rule 9 of ``hpcddp.comm.mpi.engine``). That failure
  belongs to a communicator: the default group's timeout is the job's communicator's
  (hpcddp's own collectives share its order, and so its timeout, until the group is
  destroyed); every ``new_group`` has its own communicator, so a timed-out
  ``new_group(timeout=...)`` never breaks the default group.
- ``monitored_barrier``: torch's refuses every backend but gloo by name; for hpcddp's
  groups the wrapper calls the group's own (gloo's protocol and messages), and any
  other group still gets torch's.
- ``device_id=``: ``init_process_group("hpcddp", device_id=torch.device("cuda", i))`` is
  accepted; the group is not bound to the device (torch ignores ``device_id`` for its own MPI
  backend too), since hpcddp's groups take tensors on any device.
- ``batch_isend_irecv``: from torch 2.14 on it asks every ``ProcessGroup`` subclass for
  its C++ backend to see whether it coalesces ("No backend type associated with device
  type cpu" for a group written in Python, which has none); for hpcddp's groups the
  wrapper posts each message as torch does for a backend that does not coalesce (torch
  2.13 and older did that for every subclass), any other group still gets torch's.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import os
import threading
import warnings

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ._stores import refuse_placeholder_store, supply_store
from .group import BACKEND_NAME, ProcessGroupHPCDDP

__all__ = ["BACKEND_NAME", "install", "mpi_routed", "new_group_over", "no_mpi_world"]


log = logging.getLogger("hpcddp")
_installed = False
_mpi_routed = False
_world = None  # the MPICommunicator all ranks' groups split from
_owned: list = []  # communicators this module made (subgroups), closed at hpcddp.shutdown()
_making = threading.local()  # .timeout: the timeout torch passes for the group being made


def mpi_routed() -> bool:
    """Return True when ``init_process_group("mpi")`` creates hpcddp's group (torch has no MPI of its own)."""
    return _mpi_routed


def no_mpi_world(backend_name: str, environment_name: str) -> RuntimeError:
    """The error for torch.distributed's ``"mpi"``/``"hpcddp"`` in a job that no MPI launcher started.

    Args:
        backend_name: the name the script passed.
        environment_name: the launcher hpcddp found ("torchrun", "slurm").
    """
    return RuntimeError(
        f"init_process_group({backend_name!r}) needs ranks started by an MPI launcher, but {environment_name} "
        f"started these without an MPI world: use 'gloo' or 'nccl' under {environment_name}, or launch with "
        "mpirun, srun --mpi=pmix or hpcddp run"
    )


def _world_communicator(backend_name: str = BACKEND_NAME):
    """hpcddp's MPI communicator when init() chose MPI, else one over the launcher's ranks."""
    global _world
    from ..comm.mpi import MPICommunicator
    from ..runtime import state

    comm = state.communicator()
    if isinstance(comm, MPICommunicator):
        return comm
    if _world is None:
        mpi_comm = state.launcher_comm()
        if mpi_comm is None and state.size() == 1:
            from ..env.mpi_import import import_mpi

            mpi_comm = import_mpi().COMM_WORLD  # a plain process: MPI's world of one
        if mpi_comm is None:
            raise no_mpi_world(backend_name, state.environment_name())
        _world = _own(state.new_mpi_communicator(mpi_comm))
    return _world


def _own(comm):
    if not _owned:
        from ..runtime.state import at_shutdown

        at_shutdown(_close)
    _owned.append(comm)
    return comm


def new_group_over(
    global_ranks: list[int] | None, backend_name: str = BACKEND_NAME, timeout: datetime.timedelta | None = None
) -> ProcessGroupHPCDDP | None:
    """Return a process group over ``global_ranks`` (the default group when empty or None); None on other ranks.

    Collective over the listed ranks only (``MPI_Comm_create_group``), in the order
    torch creates groups. Every group but the default one has its own communicator (its
    own queue, numbering and thread), released when torch destroys the group: a group
    over all ranks too, since torch orders each group's collectives on its own (one
    rank's collective on it may meet another's on the default group, and sharing a
    communicator would pair them).

    Args:
        global_ranks: members, as ranks of the whole job; the group numbers them in list order.
        backend_name: the name the group reports ("hpcddp" or "mpi").
        timeout: the group's timeout; None or torch's default: none.
    """
    world = _world_communicator(backend_name)
    seconds = _seconds(timeout)
    if not global_ranks:  # the default group: its timeout is the job's communicator's while it lives
        agreement = world.engine.agreement
        agreement.timeout, label = seconds, agreement.label
        agreement.label = f"the default process group ({world.size} ranks)"

        def forget_timeout() -> None:
            agreement.timeout, agreement.label = None, label

        return ProcessGroupHPCDDP(world, None, backend_name, on_shutdown=forget_timeout, timeout=timeout)
    ranks = list(global_ranks)
    if world.rank not in ranks:
        return None
    comm = _own(world.group_over(ranks))
    comm.engine.agreement.timeout = seconds
    return ProcessGroupHPCDDP(comm, ranks, backend_name, on_shutdown=functools.partial(release, comm), timeout=timeout)


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    """The timeout a communicator enforces: none for torch's default, which changes nothing.

    Enforced only with HPCDDP_GROUP_TIMEOUTS=1: MPI cannot cancel a collective, so a rank
    that arrives after another gave up can wait for good in the transfer (a job that would
    have finished hangs); without it the stall inspector reports and ends real stalls.
    """
    if timeout is None or timeout == c10d.default_pg_timeout:
        return None
    from ..env.settings import _switch

    if not _switch("HPCDDP_GROUP_TIMEOUTS", os.environ.get("HPCDDP_GROUP_TIMEOUTS", "0").lower()):
        if not _warned_timeout:
            _warned_timeout.append(timeout)
            log.warning(
                "hpcddp: timeout=%s of init_process_group/new_group is not enforced on the MPI backend "
                "(a rank arriving after the timeout could hang, MPI cannot cancel a collective); hpcddp's stall "
                "inspector reports stalls (HPCDDP_STALL_TIMEOUT); HPCDDP_GROUP_TIMEOUTS=1 enforces it (experimental)",
                timeout,
            )
        return None
    return timeout.total_seconds()


_warned_timeout: list = []


def release(comm) -> None:
    """Close a subgroup's communicator (its process group was destroyed)."""
    if comm in _owned:
        _owned.remove(comm)
    comm.close()


def _create(options, _backend_options) -> ProcessGroupHPCDDP:
    return new_group_over(list(options.global_ranks_in_group), timeout=options.timeout)


class _MPIGroups:
    """Stands in for torch's missing ``ProcessGroupMPI``: ``create(ranks)`` is all torch asks of it."""

    @staticmethod
    def create(ranks: list[int]) -> ProcessGroupHPCDDP | None:
        return new_group_over(list(ranks), "mpi", getattr(_making, "timeout", None))


def _see_timeout(helper):
    """Wrap torch's ``_new_process_group_helper`` so that ``_MPIGroups.create`` knows the group's ``timeout``
    (and a gloo or NCCL group is refused where it would wait on a store no other rank reaches)."""
    signature = inspect.signature(helper)

    @functools.wraps(helper)
    def wrapper(*args, **kwargs):
        previous = getattr(_making, "timeout", None)
        arguments = signature.bind_partial(*args, **kwargs).arguments
        refuse_placeholder_store(arguments.get("backend"), arguments.get("group_size"))
        if str(arguments.get("backend")).lower() in (BACKEND_NAME, "mpi") and "device_id" in kwargs:
            # torch binds a group to device_id by asking its C++ backend for that device, which a
            # group written in Python has none of ("No backend type associated with device type
            # cuda"); hpcddp's groups take tensors on any device, so, as torch does for its own
            # MPI backend, the device is not bound (issue 34).
            kwargs["device_id"] = None
        _making.timeout = arguments.get("timeout")
        try:
            return helper(*args, **kwargs)
        finally:
            _making.timeout = previous

    wrapper.__hpcddp__ = True
    return wrapper


def _route_monitored_barrier(monitored_barrier):
    """Wrap torch's ``monitored_barrier``: hpcddp's groups run their own, every other group torch's."""

    @functools.wraps(monitored_barrier)
    def wrapper(group=None, timeout=None, wait_all_ranks=False):
        target = group if group is not None or not c10d.is_initialized() else c10d._get_default_group()
        if not isinstance(target, ProcessGroupHPCDDP):
            return monitored_barrier(group, timeout, wait_all_ranks)
        if isinstance(timeout, (int, float)):
            warnings.warn(  # torch's own conversion, with torch's warning
                "Please specify timeout arg as a timedelta. "
                f"Converting current value of {timeout} assuming it represents seconds",
                stacklevel=2,
            )
            timeout = datetime.timedelta(seconds=timeout)
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"monitored_barrier: timeout must be a datetime.timedelta, got {timeout!r}")
        return target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    wrapper.__hpcddp__ = True
    return wrapper


def _route_batch_isend_irecv(batch_isend_irecv):
    """Wrap torch's ``batch_isend_irecv``: hpcddp's groups post each message, every other group gets torch's."""

    @functools.wraps(batch_isend_irecv)
    def wrapper(p2p_op_list):
        group = getattr(p2p_op_list[0], "group", None) if isinstance(p2p_op_list, list) and p2p_op_list else None
        if group is None and c10d.is_initialized():
            group = c10d._get_default_group()
        if not isinstance(group, ProcessGroupHPCDDP):
            return batch_isend_irecv(p2p_op_list)  # also torch's errors for a list that is not one of P2POps
        c10d._check_p2p_op_list(p2p_op_list)
        works = []
        for op in p2p_op_list:  # op.peer: the global rank in every torch release (group_peer came later)
            work = op.op(op.tensor, op.peer, group=op.group, tag=op.tag)
            if work:
                works.append(work)
        return works

    wrapper.__hpcddp__ = True
    return wrapper


def install() -> None:
    """Register the ``hpcddp`` backend and, on torch builds without MPI, route ``"mpi"`` to it (idempotent)."""
    global _installed, _mpi_routed
    if _installed:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    if not getattr(c10d.init_process_group, "__hpcddp__", False):
        c10d.init_process_group = dist.init_process_group = supply_store(
            c10d.init_process_group, _world_communicator, mpi_routed
        )
    if not getattr(c10d.monitored_barrier, "__hpcddp__", False):
        c10d.monitored_barrier = dist.monitored_barrier = _route_monitored_barrier(c10d.monitored_barrier)
    if not getattr(c10d.batch_isend_irecv, "__hpcddp__", False):
        c10d.batch_isend_irecv = dist.batch_isend_irecv = _route_batch_isend_irecv(c10d.batch_isend_irecv)
    if not getattr(c10d._new_process_group_helper, "__hpcddp__", False):
        c10d._new_process_group_helper = _see_timeout(c10d._new_process_group_helper)
    if not c10d.is_mpi_available():
        c10d.ProcessGroupMPI = _MPIGroups
        c10d.is_mpi_available = dist.is_mpi_available = _mpi_available
        _mpi_routed = True
    _installed = True


def _mpi_available() -> bool:
    """True: hpcddp serves torch.distributed's "mpi" backend (torch itself was built without MPI)."""
    return True


def _close() -> None:
    global _world
    while _owned:
        _owned.pop().close()
    _world = None
