"""The store behind hpcddp's default group, and the gloo/NCCL groups that would wait on it.

hpcddp's groups never read a store: the ranks know each other through MPI. torch's own
MPI backend gets a placeholder ``Store()``, and ``init_process_group("hpcddp")`` with no
``init_method`` a process-local ``HashStore``. A gloo or NCCL group made beside them
(``new_group(backend="gloo")``) rendezvouses in the default group's store, which no other
rank reaches: on the placeholder torch fails with an internal assert, on the HashStore it
waits until its timeout (30 minutes by default). ``refuse_placeholder_store`` turns both
into a one-line error that names the fix.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .group import BACKEND_NAME

__all__ = ["refuse_placeholder_store", "supply_store"]

_local_stores: list[dist.Store] = []  # the process-local stores supply_store handed to torch


def supply_store(init_process_group, world_communicator, serves_mpi: Callable[[], bool] = lambda: False):
    """Wrap ``init_process_group`` so that ``"hpcddp"`` without a store or init_method takes rank and size from MPI.

    ``"mpi"`` with ``rank=``/``world_size=`` that MPI's agree with (a torchrun script's
    ``rank=int(os.environ["RANK"])``, from the variables hpcddp exported) runs without
    torch's "world_size and rank are ignored" warning where hpcddp serves "mpi"
    (``serves_mpi``); values MPI does not agree with keep it.
    """

    @functools.wraps(init_process_group)
    def wrapper(backend=None, init_method=None, *args, **kwargs):
        if (
            str(backend).lower() == "mpi"
            and serves_mpi()
            and _given(kwargs)
            and _agree_with(world_communicator, kwargs)
        ):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", _IGNORED_FOR_MPI, UserWarning)
                return init_process_group(backend, init_method, *args, **kwargs)
        # Only positional use of backend/init_method is shifted here; the rest passes through.
        if str(backend).lower() == BACKEND_NAME and init_method is None and kwargs.get("store") is None and not args:
            world = world_communicator()
            for name, value in (("rank", world.rank), ("world_size", world.size)):
                given = kwargs.get(name, -1)
                if given not in (-1, None, value):
                    raise ValueError(
                        f"init_process_group({BACKEND_NAME!r}): {name}={given} but MPI says {value}: drop {name}="
                    )
                kwargs[name] = value
            _local_stores[:] = [dist.HashStore()]
            kwargs["store"] = _local_stores[0]
        return init_process_group(backend, init_method, *args, **kwargs)

    wrapper.__hpcddp__ = True
    return wrapper


# torch's warning for rank=/world_size= with backend "mpi" (distributed_c10d.init_process_group)
_IGNORED_FOR_MPI = r"For MPI backend, world_size \(-?\d+\) and rank \(-?\d+\) are ignored"


def _given(kwargs: dict) -> bool:
    return any(kwargs.get(name, -1) not in (-1, None) for name in ("rank", "world_size"))


def _agree_with(world_communicator, kwargs: dict) -> bool:
    world = world_communicator("mpi")
    return kwargs.get("rank", -1) in (-1, None, world.rank) and kwargs.get("world_size", -1) in (-1, None, world.size)


def refuse_placeholder_store(backend, group_size: int | None) -> None:
    """Raise ValueError when a ``backend`` group (gloo, NCCL) would rendezvous in a store only this process sees.

    A group of one rank meets nobody: it works on the process-local store (torch's
    placeholder fails even then).
    """
    name = str(backend).lower() if backend is not None else ""
    if name in ("", BACKEND_NAME, "mpi", "undefined") or c10d.GroupMember.WORLD is None:
        return  # the default group itself, or one of hpcddp's: no store read
    default = c10d._world.pg_map.get(c10d.GroupMember.WORLD, (None, None))[1]
    while isinstance(default, dist.PrefixStore):
        default = default.underlying_store
    local = any(default is s for s in _local_stores) and not (group_size is not None and group_size <= 1)
    if default is None or not (type(default) is dist.Store or local):
        return
    raise ValueError(
        f"new_group(backend={name!r}): the default group ({dist.get_backend()!r}) has no store the other ranks "
        f"reach, where a {name} group meets: make the default group with "
        f"init_process_group({BACKEND_NAME!r}, init_method='env://') (hpcddp.init() exported MASTER_ADDR and "
        "MASTER_PORT), or use hpcddp's groups (new_group without backend=)"
    )
