"""Run the launcher (mpirun, srun) as ``hpcddp run``'s child and report how the job really ended.

``exec`` would hand the terminal straight to the launcher, but then nobody could tell
that Open MPI 5.0's mpirun exits 0 after losing a node (see ``hpcddp.fault.run_status``),
nor say that a Ctrl-C stopped the job. Signals that schedulers and users send to
``hpcddp run`` (TERM, USR1, USR2, HUP; INT when it does not come from the terminal)
are passed on to the launcher, which passes them to the ranks.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from ..env.settings import RUN_STATUS_VARIABLE
from ..observe.stragglers import run_status_lines
from .launcher_process import LAUNCH_FAILED_EXIT_CODE, remove_session_directory, session_directory, stop_launcher
from .run_status import aborted_ranks, started_ranks, unfinished_ranks

__all__ = ["INTERRUPTED_EXIT_CODE", "shell_exit_code", "supervise"]

#: the shell's code for a job ended by Ctrl-C (128 + SIGINT)
INTERRUPTED_EXIT_CODE = 130
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
#: how long mpirun may take to end the job after a rank aborted it (a rank gives MPI_Abort 10 s)
LAUNCHER_ABORT_GRACE_S = 30.0
_MPIRUN_NAMES = ("mpirun", "mpiexec", "prterun")


def _terminal_delivers_sigint() -> bool:
    """True when Ctrl-C reaches the launcher by itself (we are the terminal's foreground group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _status_directory() -> str | None:
    try:
        return tempfile.mkdtemp(prefix=".hpcddp-run-", dir=os.getcwd())
    except OSError:  # a read-only working directory: run without the check
        return None


def supervise(command: Sequence[str], environ: Mapping[str, str]) -> int:
    """Run ``command`` (a launcher) to its end and return the exit code the job deserves.

    The launcher's own code, except: 130 (with a line saying so) after Ctrl-C, and 1
    when the launcher claims success although ranks that started never finished.

    Args:
        command: the launcher command line.
        environ: its environment.
    """
    launcher = os.path.basename(command[0])
    status = _status_directory()
    environ = {**environ, **({RUN_STATUS_VARIABLE: status} if status else {})}
    interrupted = False
    try:
        proc = subprocess.Popen(list(command), env=environ)
    except OSError as err:
        _remove(status)
        sys.stderr.write(f"[hpcddp run] cannot start {command[0]}: {err.strerror}\n")
        return 127

    def forward(signum, _frame):
        proc.send_signal(signum)

    def interrupt(signum, _frame):
        nonlocal interrupted
        interrupted = True
        if not _terminal_delivers_sigint():
            proc.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        code = _wait(proc, launcher, status, environ)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        missing = unfinished_ranks(status) if status else {}
        started = started_ranks(status) if status else 0
        stragglers = run_status_lines(status) if status else []
        _remove(status)
        remove_session_directory(proc, environ)
    if any(line.startswith("straggler:") for line in stragglers):
        # The job's last straggler report again, where the end of its output is read (quiet when balanced).
        sys.stderr.write("".join(f"[hpcddp run] last report: {line}\n" for line in stragglers))
    if interrupted:
        sys.stderr.write("[hpcddp run] interrupted (Ctrl-C): the job was stopped\n")
        return INTERRUPTED_EXIT_CODE
    if code == 0 and missing:
        hosts = sorted(set(missing.values()))
        sys.stderr.write(
            f"[hpcddp run] {launcher} exited 0, but rank(s) {', '.join(map(str, missing))} "
            f"on {', '.join(hosts)} never finished: they were killed (a node lost or cut off?); exiting 1\n"
        )
        return 1
    if code == LAUNCH_FAILED_EXIT_CODE and not started and launcher in _MPIRUN_NAMES:
        sys.stderr.write(
            f'[hpcddp run] {launcher} exited {code} and no rank reported a start; if it said "The PMIx '
            "server's listener thread failed to start\", an mpirun killed earlier may have left "
            f"{session_directory(proc.pid, environ)} (same process id), which is gone now: run the command again\n"
        )
    return shell_exit_code(code)


def _wait(proc: subprocess.Popen, launcher: str, status: str | None, environ: Mapping[str, str]) -> int:
    """Wait for the launcher; stop an mpirun that outlives a rank's abort of the job by LAUNCHER_ABORT_GRACE_S.

    After MPI_Abort, mpirun ends every rank it reaches, then waits on the daemon of a
    node cut off from it, in TCP retransmissions (many minutes): the ranks are gone,
    the job would hang until its time limit and a requeue would come too late. (srun
    leaves unreachable nodes to Slurm, which ends the step on its own schedule.)
    """
    if status is None or launcher not in _MPIRUN_NAMES:
        return proc.wait()
    aborted_at = None
    with _exit_watch(proc) as exited:
        while not exited(1.0):
            if aborted_at is None:
                aborted_at = time.monotonic() if aborted_ranks(status) else None
            elif time.monotonic() - aborted_at > LAUNCHER_ABORT_GRACE_S:
                rank, code = next(iter(aborted_ranks(status).items()))
                sys.stderr.write(
                    f"[hpcddp run] rank {rank} ended the job (exit {code}) over {LAUNCHER_ABORT_GRACE_S:g} s ago, "
                    f"but {launcher} has not exited (it waits on a node it cannot reach): stopping it\n"
                )
                stop_launcher(proc, environ)
                return code
    return proc.wait()


@contextlib.contextmanager
def _exit_watch(proc: subprocess.Popen):
    """Yield ``exited(timeout_s) -> bool``, which returns as soon as ``proc`` exits (a pidfd where Linux has one)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is None:

        def exited(timeout_s: float) -> bool:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True

        yield exited
        return
    try:
        yield lambda timeout_s: bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
        os.close(pidfd)


def shell_exit_code(code: int) -> int:
    """Return a process's exit status as a shell reports it: 128 + N for a death by signal N (Popen's -N)."""
    return code if code >= 0 else 128 - code


def _remove(directory: str | None) -> None:
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
