"""End the whole job from one rank: print why, then abort every rank.

An uncaught exception on one rank would otherwise leave the others blocked in their
next collective until the job's time limit; ``MPI_Abort`` ends all of them at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

from ..runtime.state import run_abort_callbacks

__all__ = [
    "abort_job",
    "exit_code",
    "install_exception_hooks",
    "launcher_rank",
    "mark_configuration_error",
    "record_exit_code",
]

#: seconds MPI_Abort may take before this process ends itself
ABORT_GRACE_S = 10

_installed = False
_config_hook_installed = False
# Set by the launchers before Python starts: the rank, for messages printed before
# hpcddp knows it.
_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "RANK")


def launcher_rank() -> int | None:
    """This process's rank as its launcher announced it, or None when no launcher did."""
    raw = next((os.environ[name] for name in _RANK_VARIABLES if os.environ.get(name)), None)
    return int(raw) if raw is not None and raw.isdigit() else None


def mark_configuration_error(error: BaseException) -> None:
    """Let ``error`` print as one line (``[hpcddp rank R] error: ...``) if nobody catches it.

    Only the way an uncaught error of hpcddp's configuration is shown changes; code
    that catches it sees the ordinary exception.
    """
    global _config_hook_installed
    error.__hpcddp_configuration__ = True  # type: ignore[attr-defined]
    if _config_hook_installed:
        return
    _config_hook_installed = True
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if not getattr(exc, "__hpcddp_configuration__", False):
            previous_hook(exc_type, exc, tb)
            return
        rank = launcher_rank()
        where = f"[hpcddp rank {rank}]" if rank is not None else "[hpcddp]"
        sys.stderr.write(f"{where} error: {exc}\n")
        sys.stderr.flush()

    sys.excepthook = excepthook


def _write_stderr(text: str) -> None:
    """Write to the process's real standard error, whatever ``sys.stderr`` is now.

    torch.distributed's excepthook points ``sys.stderr`` at a buffer while the hook
    it wraps runs, to prefix the lines later: a hook that aborts from in there would
    leave the traceback in the buffer, never printed.
    """
    data = (text if text.endswith("\n") else text + "\n").encode(errors="replace")
    try:
        sys.__stderr__.flush()
    except (AttributeError, ValueError, OSError):
        pass
    while data:
        try:
            data = data[os.write(2, data) :]
        except InterruptedError:
            continue
        except OSError:
            return


def abort_job(message: str, *, use_mpi: bool, code: int = 1) -> None:
    """Write ``message`` to standard error, then end every rank with exit code ``code``.

    Args:
        message: what happened, already prefixed with the rank.
        use_mpi: abort through ``MPI_COMM_WORLD`` (all ranks); otherwise only this
            process exits and the launcher (torchrun, srun) ends the others.
        code: the exit code (a rank's own, when the job ends because that rank left).
    """
    code = code if isinstance(code, int) and 0 < code < 256 else 1
    try:
        _write_stderr(message)
        # What this rank must save before it ends (its timeline events); bounded by the
        # alarm below, set first so that a callback that blocks cannot keep the job alive.
        signal.alarm(ABORT_GRACE_S)
        for failure in run_abort_callbacks():
            _write_stderr(f"[hpcddp] while aborting: {failure}")
    finally:
        if use_mpi:
            from ..env.mpi_import import import_mpi

            # MPI_Abort asks the launcher's daemon to end every rank; on a node cut off
            # from the launcher that request can block forever: SIGALRM's default action
            # ends this process anyway (it fires in C, while Abort holds the GIL).
            signal.alarm(ABORT_GRACE_S)
            _tell_hpcddp_run(code)
            import_mpi().COMM_WORLD.Abort(code)
        os._exit(code)


def _tell_hpcddp_run(code: int) -> None:
    """Leave word for ``hpcddp run`` that this rank ends the job (it stops an mpirun that hangs after)."""
    from ..env.settings import run_status_dir

    status, rank = run_status_dir(os.environ), launcher_rank()
    if status is not None and rank is not None:
        from .run_status import mark_aborted

        mark_aborted(status, rank, code)


_exit_code: int | None = None
_exit_recorded = False


def record_exit_code() -> None:
    """Remember the code of ``sys.exit(code)`` on the main thread, for ``exit_code()`` (idempotent).

    Python does not tell exit handlers the code it will exit with; the stall inspector
    passes it on when a rank leaves early, so the job ends with that rank's code.
    """
    global _exit_recorded
    if _exit_recorded:
        return
    _exit_recorded = True
    original = sys.exit

    def exit(status=None):  # noqa: A001 - stands in for sys.exit
        global _exit_code
        if threading.current_thread() is threading.main_thread():
            _exit_code = status if isinstance(status, int) else (0 if status is None else 1)
        original(status)

    exit.__doc__ = original.__doc__
    sys.exit = exit


def exit_code() -> int | None:
    """The code of ``sys.exit`` on the main thread, or None when the script ended without it."""
    return _exit_code


def _report(rank: int, exc_type, exc, tb, where: str) -> str:
    lines = traceback.format_exception(exc_type, exc, tb)
    return f"[hpcddp rank {rank}] uncaught exception{where}:\n" + "".join(lines)


def install_exception_hooks(rank: int, *, use_mpi: bool) -> None:
    """Make an uncaught exception on this rank print its traceback and end the job.

    Chains the hooks already installed: ``sys.excepthook`` for the main thread and
    ``threading.excepthook`` for hpcddp's own threads and for any thread that took
    part in collectives (it submitted one, or stepped an ``AsyncModelAverager``): the
    other ranks would wait for its next collective. The failure of a thread that never
    did is left to the previous hook, as it does not block collectives by itself.

    Args:
        rank: this process's rank, printed before the traceback.
        use_mpi: abort through MPI; see ``abort_job``.
    """
    global _installed
    if _installed:
        return
    _installed = True
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def excepthook(exc_type, exc, tb):
        if previous_hook is sys.__excepthook__:
            abort_job(_report(rank, exc_type, exc, tb, ""), use_mpi=use_mpi)
        # Another hook (torch.distributed's prints the traceback prefixed with the
        # rank) already shows the traceback: add one line, not a second copy.
        try:
            previous_hook(exc_type, exc, tb)
        except Exception:  # noqa: BLE001 - a broken user hook must not stop the abort
            _write_stderr("".join(traceback.format_exception(exc_type, exc, tb)))
        summary = "".join(traceback.format_exception_only(exc_type, exc)).strip()
        abort_job(f"[hpcddp rank {rank}] uncaught exception (traceback above): {summary}", use_mpi=use_mpi)

    def thread_excepthook(args):
        from ..comm.oplog import is_collective_thread

        thread = args.thread
        # sys.exit() ends only its thread, silently, as without hpcddp (Python's own hook ignores it).
        quiet = issubclass(args.exc_type, SystemExit)
        if quiet or thread is None or not (thread.name.startswith("hpcddp-") or is_collective_thread(thread)):
            previous_thread_hook(args)
            return
        where = f" in thread {thread.name}"
        abort_job(_report(rank, args.exc_type, args.exc_value, args.exc_traceback, where), use_mpi=use_mpi)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
