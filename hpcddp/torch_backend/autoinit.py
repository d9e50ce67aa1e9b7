"""``init_process_group`` in a script that never calls ``hpcddp.init()``.

torch's wheels have no MPI of their own; hpcddp serves the name once ``hpcddp.init()``
ran. Scripts written for a source-built torch call ``init_process_group("mpi")``
straight away. ``enable()`` makes that call run ``hpcddp.init()`` first.

Scripts written for torchrun call ``init_process_group("gloo")`` (or nccl) with
env://, which reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Under mpirun or
srun, where one is missing (``hpcddp run`` exports what it knows at launch; rank 0's
address across nodes it cannot know then), the call first exports them as
``hpcddp.init()`` does: the ranks from the launcher, the rendezvous through hpcddp's
own, over MPI. Only there: importing torch never starts MPI, as DataLoader workers and
a rank's subprocesses import it too.

``enable()`` runs at ``import hpcddp`` and, for scripts that never import hpcddp, from
the ``sitecustomize`` that ``hpcddp run`` and ``slurm/train.sh`` put on ``PYTHONPATH``
(``hpcddp/_site``; ``python -m hpcddp._site`` prints its path).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

from torch.distributed import distributed_c10d as c10d

from ..comm.rendezvous import DEFAULT_GROUP_LOCK

__all__ = ["enable"]

_SERVED = ("mpi", "hpcddp")
_busy = False  # hpcddp.init() itself may make a gloo/NCCL group: that call passes straight through


def _names_mpi(backend) -> bool:
    # "cpu:mpi,cuda:nccl" names a backend per device; any "mpi" in it needs hpcddp.
    if backend is None:
        return False
    parts = str(backend).lower().replace(",", " ").split()
    return any(part.rpartition(":")[2] in _SERVED for part in parts)


def enable(init: Callable[[], None], mark_error: Callable[[BaseException], None] | None = None) -> None:
    """Make ``init_process_group`` start what the script left out (idempotent).

    With ``"mpi"`` or ``"hpcddp"`` it calls ``init`` first; with any other backend
    and env:// under mpirun or srun it exports the variables env:// reads that are
    missing. A default group that hpcddp made already, or ``"mpi"`` under torchrun,
    is a one-line error.

    Args:
        init: ``hpcddp.init`` (passed in: the backend is one of the features ``init`` starts).
        mark_error: makes an uncaught error print as one line (``hpcddp.fault.abort.mark_configuration_error``).
    """
    if getattr(c10d.init_process_group, "__hpcddp_autoinit__", False):
        return
    original = c10d.init_process_group
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if _busy:
            return original(backend, *args, **kwargs)
        with DEFAULT_GROUP_LOCK:  # not while hpcddp's first collective makes the group (torchrun)
            return _init_process_group(backend, args, kwargs)

    def _init_process_group(backend, args, kwargs):
        global _busy
        from ..runtime import state

        try:
            _check_no_default_group(backend)
            if _names_mpi(backend):
                _check_mpi_world(backend)
            else:
                _complete_env(backend, _arguments(signature, backend, args, kwargs))
        except (ValueError, RuntimeError) as err:
            if mark_error is not None:
                mark_error(err)
            raise
        if state.is_initialized() or not _names_mpi(backend):
            return original(backend, *args, **kwargs)
        _busy = True
        try:
            init()
        finally:
            _busy = False
        # init() installed the backend and may have wrapped this function again: call what is there now.
        return c10d.init_process_group(backend, *args, **kwargs)

    init_process_group.__hpcddp_autoinit__ = True
    import torch.distributed as dist

    c10d.init_process_group = dist.init_process_group = init_process_group


def _arguments(signature: inspect.Signature, backend, args, kwargs) -> dict:
    try:
        return signature.bind_partial(backend, *args, **kwargs).arguments
    except TypeError:  # torch says what is wrong with them
        return {}


def _check_no_default_group(backend) -> None:
    from ..comm.rendezvous import made_default_group

    if made_default_group():
        raise RuntimeError(
            f"init_process_group({backend!r}): hpcddp already made torch.distributed's default group "
            f"({c10d.get_backend()}) for its own collectives: call init_process_group before hpcddp.init() "
            "(hpcddp then uses the script's group), or drop this call (torch.distributed uses hpcddp's group)"
        )


def _check_mpi_world(backend) -> None:
    """torchrun (or srun without MPI) starts no MPI world: say so before hpcddp.init() starts."""
    from ..env import detect_environment
    from ..runtime import state
    from .install import no_mpi_world

    if state.is_initialized():
        name, without_mpi = state.environment_name(), state.launcher_comm() is None and state.size() > 1
    else:
        environment = detect_environment()
        name, without_mpi = environment.name, environment.mpi_comm is None and environment.layout().world_size > 1
    if without_mpi:
        raise no_mpi_world(str(backend), name)


_ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _complete_env(backend, arguments: dict) -> None:
    """Export what env:// reads and the environment lacks, where a launcher can tell (collective under MPI)."""
    method = arguments.get("init_method")
    if arguments.get("store") is not None or (method is not None and not str(method).startswith("env://")):
        return
    given = {"RANK": arguments.get("rank", -1), "WORLD_SIZE": arguments.get("world_size", -1)}
    missing = [name for name in _ENV_VARIABLES if not os.environ.get(name) and given.get(name, -1) in (-1, None)]
    if not missing:
        return
    from ..env import MPIEnvironment, SlurmEnvironment, detect_environment

    environment = detect_environment()
    if not isinstance(environment, (MPIEnvironment, SlurmEnvironment)):
        raise ValueError(
            f"init_process_group({backend!r}) reads {', '.join(missing)} from the environment (env://), but no "
            "launcher set them: launch with hpcddp run -np N (or torchrun), or call hpcddp.init() first, "
            "which exports them"
        )
    from ..env.settings import read_settings
    from ..runtime.exports import export_for_torch

    export_for_torch(environment, read_settings(os.environ).get("interface"))
