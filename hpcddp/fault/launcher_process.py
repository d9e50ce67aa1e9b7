"""Ending a launcher (mpirun, srun) with everything it started, and what a killed one leaves behind.

Open MPI 5's mpirun (PRRTE) keeps its session directory at ``$TMPDIR/ompi.<pid>`` and
removes it when it exits. Killed outright (SIGKILL after a time limit, a health check
given up on), it leaves the directory, and a later mpirun that happens to get the same
process id stops at start-up with "The PMIx server's listener thread failed to start"
(exit 213) before any rank runs. On a machine that launches many jobs this comes
sooner or later, so whoever started a launcher and has reaped it removes what it left:
the pid is its own child's, no longer in use, so nobody else's directory goes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping

__all__ = ["LAUNCH_FAILED_EXIT_CODE", "remove_session_directory", "session_directory", "stop_launcher"]

#: mpirun's exit code when PRRTE cannot start its PMIx server (e.g. a stale session directory)
LAUNCH_FAILED_EXIT_CODE = 213


def session_directory(pid: int, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """Return where Open MPI 5's mpirun with process id ``pid`` keeps its session directory.

    PRRTE's base directory: ``PRTE_MCA_prte_tmpdir_base``, else the first of TMPDIR,
    TEMP, TMP that is set (even to ""), else /tmp; a relative one is taken from ``cwd``.
    (A base given with ``--prtemca`` or in an MCA file is not seen: its directory stays.)

    Args:
        pid: the mpirun process's id.
        environ: the environment mpirun ran with; os.environ by default.
        cwd: the directory mpirun ran in; this process's by default.
    """
    environ = os.environ if environ is None else environ
    names = ("PRTE_MCA_prte_tmpdir_base", "TMPDIR", "TEMP", "TMP")
    base = next((environ[name] for name in names if name in environ), "/tmp")
    return os.path.join(cwd or os.getcwd(), base or "/", f"ompi.{pid}")


def remove_session_directory(
    proc: subprocess.Popen, environ: Mapping[str, str] | None = None, cwd: str | None = None
) -> bool:
    """Remove what a launcher that has exited left at its session directory; True if something was there.

    Does nothing while ``proc`` has not been reaped (the directory is in use), nor once its
    pid belongs to a live process again (then the directory may be that one's). Harmless
    for srun and other launchers.

    Args:
        proc: the launcher's process (mpirun, or a wrapper that exec'd it).
        environ: the environment it ran with; os.environ by default.
        cwd: the directory it ran in; this process's by default.
    """
    if proc.returncode is None or _alive(proc.pid):
        return False
    path = session_directory(proc.pid, environ, cwd)
    try:
        if os.stat(path).st_uid != os.getuid():
            return False
    except OSError:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def stop_launcher(
    proc: subprocess.Popen, environ: Mapping[str, str] | None = None, grace_s: float = 3.0, cwd: str | None = None
) -> None:
    """End a launcher and every process of its group (``start_new_session=True``), then its leftovers.

    TERM first (mpirun then ends its ranks, which run in process groups of their own),
    KILL after ``grace_s``; returns once the launcher is reaped (or 10 s after the KILL).
    A launcher that leads no group of its own gets the signals alone.

    Args:
        proc: the launcher's process.
        environ: the environment it ran with; os.environ by default.
        grace_s: seconds between TERM and KILL.
        cwd: the directory it ran in; this process's by default.
    """
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    remove_session_directory(proc, environ, cwd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
