"""``hvd.elastic.run``: run a training function again from the last commit after a failure or a change of hosts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...elastic.session import worker_session
from ..basics import HorovodInternalError, HostsUpdatedInterrupt, init, shutdown
from ..functions import allgather_object, broadcast_object
from .state import State

__all__ = ["run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function ``func(state, ...)`` so that it survives failures and host changes.

    Before ``func`` runs, every rank takes rank 0's state (``state.sync()``). When a
    collective fails (HorovodInternalError) the state goes back to its last commit; when
    the hosts change (HostsUpdatedInterrupt, raised by ``state.commit()``) it keeps its
    current values; either way the ranks reset and ``func`` runs again. As in Horovod,
    ``func`` must not be preceded by collectives that new ranks would not make.

    Under ``hpcddp run --min-np`` a reset is a new start of the job (an MPI job cannot
    take in or lose processes): the ranks leave, the driver starts them on the hosts
    available, and the new ranks resume from the newest commit any node kept, run the
    reset callbacks, sync and call ``func`` again. Elsewhere a reset is
    ``hvd.shutdown(); hvd.init()`` in the same processes, as in Horovod.

    Args:
        func: the training function; its first argument is a ``State``.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        session = worker_session()
        try:
            return _resume_and_run(func, session, state, args, kwargs)
        except SystemExit as exit_request:
            # A failure the script chose, in func or a reset callback: the exit handler would
            # report "done", and the driver take the failing rank for one that finished.
            # leave_for_restart's SystemExit(0) passes (its "restart" went first; finish sends once).
            if session is not None and not _is_success(exit_request.code):
                session.finish("error", f"sys.exit({exit_request.code!r}) in hvd.elastic.run")
            raise

    return wrapper


def _is_success(code: Any) -> bool:
    """Whether ``SystemExit(code)`` ends the process with status 0, as Python decides it."""
    return code is None or (isinstance(code, int) and code == 0)


def _resume_and_run(func: Callable[..., Any], session, state: State, args: tuple, kwargs: dict) -> Any:
    if session is not None:
        commit = session.newest_commit(allgather_object, broadcast_object)
        if commit is not None:
            state._serial = commit[0]
            state._load_snapshot(commit[1])
            state.on_reset()
        # After on_reset, which forgets host messages: an update that came while this start
        # began is for this start (the link keeps it and replays it here).
        session.link.add_listener(state.on_hosts_updated)
    try:
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                if session is not None:
                    session.leave_for_restart("a collective failed")
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                if session is not None:
                    # Keep this point (not only the last commit): Horovod's ranks go on from here.
                    state.save()
                    state._keep()
                    session.leave_for_restart("the hosts changed")
                skip_sync = interrupt.skip_sync
            shutdown()
            init()
            state.on_reset()
    finally:
        if session is not None:
            session.link.remove_listener(state.on_hosts_updated)
