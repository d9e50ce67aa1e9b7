"""Horovod's process sets: subsets of ranks that run collectives among themselves, as communicator splits."""

from __future__ import annotations

from collections.abc import Sequence

from ..comm.base import Communicator
from ..runtime import state

__all__ = [
    "ProcessSet", "add_process_set", "communicator_of", "global_process_set", "remove_process_set", "set_rank",
]  # fmt: skip


class ProcessSet:
    """A set of ranks that runs collectives among its members (pass it as ``process_set=``).

    Register it with ``add_process_set`` (on every rank) or ``hvd.init(process_sets=[...])``
    before use. Ranks are kept in ascending order, as Horovod does.

    Args:
        ranks: the member ranks, or an mpi4py communicator whose ranks become the set.
    """

    def __init__(self, ranks: Sequence[int] | object) -> None:
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator: its members in COMM_WORLD numbering
            from ..env.mpi_import import import_mpi

            MPI = import_mpi()
            ranks = MPI.Group.Translate_ranks(
                ranks.Get_group(), list(range(ranks.Get_size())), MPI.COMM_WORLD.Get_group()
            )
        self.ranks: list[int] | None = None if ranks is None else sorted(int(r) for r in ranks)
        #: Horovod's id: 0 for the global set, then 1, 2, ... in registration order; None until registered
        self.process_set_id: int | None = None
        self._comm: Communicator | None = None

    def _communicator(self) -> Communicator:
        if self is global_process_set:
            return state.communicator()
        if self.process_set_id is None:
            raise ValueError(
                f"process set {self.ranks} is not registered: call hvd.add_process_set on every rank first"
            )
        if self._comm is None:
            raise ValueError(
                f"rank {state.rank()} is not in process set {self.ranks}: call collectives of a process set "
                "only on its members"
            )
        return self._comm

    def size(self) -> int | None:
        """Return the number of ranks in the set (None before ``init``)."""
        if self is global_process_set:
            return state.size() if state.is_initialized() else None
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """Return this process's rank within the set, or None if it is not a member."""
        if self is global_process_set:
            return state.rank() if state.is_initialized() else None
        return self.ranks.index(state.rank()) if self.included() else None

    def included(self) -> bool | None:
        """Return True if this process belongs to the set."""
        if self is global_process_set:
            return state.is_initialized() or None
        return state.rank() in self.ranks

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self is other or (self.ranks is not None and self.ranks == other.ranks)

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        ranks = "all" if self is global_process_set else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


#: every rank; the default ``process_set`` of every operation
global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
_next_id = 1


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: call it on every rank with the same ranks) and return it.

    Args:
        process_set: a ProcessSet or a list of ranks.
    """
    global _next_id
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is registered already: remove it first or create a new ProcessSet")
    for existing in _registered.values():
        if existing.ranks == process_set.ranks:
            raise ValueError(f"a process set with ranks {process_set.ranks} exists already ({existing!r})")
    process_set._comm = state.communicator().split(process_set.ranks)
    state.at_shutdown(forget_process_sets)
    process_set.process_set_id = _next_id
    _registered[_next_id] = process_set
    _next_id += 1
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over every rank); return False if it was not registered.

    Args:
        process_set: a set returned by ``add_process_set``; the global set cannot be removed.
    """
    if process_set is global_process_set or _registered.get(process_set.process_set_id) is not process_set:
        return False
    state.communicator().barrier()  # every rank removes it, none while others still use it
    del _registered[process_set.process_set_id]
    if process_set._comm is not None:
        process_set._comm.close()
    process_set._comm = None
    process_set.process_set_id = None
    return True


def communicator_of(process_set: ProcessSet | None) -> Communicator:
    """Return the communicator that runs ``process_set``'s collectives (the global one for None)."""
    if process_set is None:
        return state.communicator()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet (hvd.add_process_set), got {type(process_set).__name__}")
    return process_set._communicator()


def set_rank(process_set: ProcessSet | None, root_rank: int, argument: str = "root_rank") -> int:
    """Return the position in ``process_set`` of global rank ``root_rank`` (Horovod names roots globally)."""
    if process_set is None or process_set is global_process_set:
        size = state.size()
        if not 0 <= root_rank < size:
            raise ValueError(f"{argument} must be in [0, {size}), got {root_rank}")
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"{argument} must be a member of process set {process_set.ranks}, got {root_rank}")
    return process_set.ranks.index(root_rank)


def forget_process_sets() -> None:
    """Drop every registered set (at shutdown; their communicators close with hpcddp's)."""
    global _next_id
    for process_set in _registered.values():
        if process_set._comm is not None:
            process_set._comm.close()
        process_set._comm = None
        process_set.process_set_id = None
    _registered.clear()
    _next_id = 1
