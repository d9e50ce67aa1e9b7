"""Launch a command, or a pytest suite, on N MPI ranks with a time limit (the test suite and CI).

A failing rank must fail the run and nothing may hang: ``run_mpi`` puts mpirun in
its own process group and kills the whole group when the time limit passes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence

from ..cli.launch import mpirun_command
from ..fault.launcher_process import remove_session_directory

__all__ = ["MPIRunResult", "assert_pytest_passed", "run_command", "run_mpi", "run_pytest_on_ranks", "run_script"]


class MPIRunResult(subprocess.CompletedProcess):
    """A finished mpirun: ``returncode``, ``stdout`` (stderr merged), ``timed_out``."""

    timed_out: bool = False


def run_mpi(
    num_ranks: int,
    args: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    hostfile: str | None = None,
    bind: bool = True,
) -> MPIRunResult:
    """Run ``args`` on ``num_ranks`` ranks under mpirun and return its result.

    Args:
        num_ranks: how many ranks to start.
        args: the program and its arguments (``[sys.executable, "-m", "pytest", ...]``).
        timeout: seconds before every rank is killed and the run counts as failed.
        env: extra environment variables for the ranks (and mpirun).
        cwd: working directory.
        hostfile: an mpirun hostfile; None runs every rank on this host.
        bind: bind the ranks to cores on one host (``hpcddp.cli.launch.mpirun_command``).
    """
    command = mpirun_command(num_ranks, list(args), env=env, hostfile=hostfile, bind=bind)
    full_env = {**os.environ, **(env or {})}
    deadline = time.monotonic() + timeout
    result = _run_once(command, timeout, full_env, cwd)
    for _ in range(_LAUNCHER_RETRIES):
        if not _launcher_failed_to_start(result) or deadline - time.monotonic() < 30:
            break
        result = _run_once(command, deadline - time.monotonic(), full_env, cwd)
        result.stdout = "[hpcddp.testing] mpirun failed to start its PMIx listener; launched again\n" + result.stdout
    return result


# Open MPI 5's launcher fails before any rank starts when an mpirun killed earlier left its
# session directory for the same process id (see hpcddp.fault.launcher_process; this
# harness removes what its own launches leave, not what others did). The failed mpirun
# removes that directory, no rank ran, so a second launch is the same test, not a retry
# of a flaky one.
_LAUNCHER_RETRIES = 2
_LAUNCHER_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def _launcher_failed_to_start(result: MPIRunResult) -> bool:
    return result.returncode != 0 and any(text in result.stdout for text in _LAUNCHER_START_FAILURES)


def _run_once(command: list[str], timeout: float, full_env: Mapping[str, str], cwd: str | None) -> MPIRunResult:
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        out = _stop(proc)
        out += f"\n[hpcddp.testing] killed after {timeout} s: {' '.join(command)}\n"
    except BaseException:  # Ctrl-C: the job runs in a session of its own, so it must be ended here
        _stop(proc)
        raise
    finally:
        remove_session_directory(proc, full_env, cwd)
    result = MPIRunResult(command, 124 if timed_out else proc.returncode, out, None)
    result.timed_out = timed_out
    return result


def run_command(
    args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: str | None = None
) -> MPIRunResult:
    """Run another launcher's command (torchrun, ``hpcddp run``, sbatch --wait) with a time limit.

    As ``run_mpi``: stderr merged into stdout, and when the limit passes the whole
    process group (the launcher and every process it started) is ended.

    Args:
        args: the command and its arguments.
        timeout: seconds before everything it started is killed and the run counts as failed.
        env: extra environment variables.
        cwd: working directory.
    """
    return _run_once(list(args), timeout, {**os.environ, **(env or {})}, cwd)


def run_script(
    num_ranks: int,
    source: str,
    directory: str | os.PathLike,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    bind: bool = True,
) -> MPIRunResult:
    """Write ``source`` (dedented) to ``directory/job.py`` and run it on ``num_ranks`` ranks, unbuffered.

    Args:
        num_ranks: how many ranks to start.
        source: the Python program every rank runs.
        directory: where the script is written (a test's ``tmp_path``).
        timeout: seconds before every rank is killed.
        env: extra environment variables for the ranks.
        cwd: working directory.
        bind: bind the ranks to cores on one host.
    """
    script = os.path.join(directory, "job.py")
    with open(script, "w") as file:
        file.write(textwrap.dedent(source))
    env = {"PYTHONUNBUFFERED": "1", **(env or {})}
    return run_mpi(num_ranks, [sys.executable, script], timeout=timeout, env=env, cwd=cwd, bind=bind)


def run_pytest_on_ranks(
    num_ranks: int,
    paths: Sequence[str],
    timeout: float,
    cwd: str | None = None,
    hostfile: str | None = None,
    env: Mapping[str, str] | None = None,
) -> MPIRunResult:
    """Run pytest on ``paths`` on every rank of one mpirun job, with the ``hpcddp.testing.ranks`` plugin.

    Args:
        num_ranks: how many ranks to start.
        paths: test files or directories, run by every rank.
        timeout: seconds before every rank is killed.
        cwd: working directory (the repository root).
        hostfile: an mpirun hostfile; None runs every rank on this host.
        env: more environment variables for the ranks.
    """
    command = [sys.executable, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider"]
    command += ["-p", "hpcddp.testing.ranks", *paths]
    env = {"HPCDDP_MPI_TESTS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_mpi(num_ranks, command, timeout=timeout, env=env, cwd=cwd, hostfile=hostfile)


def assert_pytest_passed(result: MPIRunResult) -> None:
    """Raise AssertionError, with the end of the job's output, unless a ``run_pytest_on_ranks`` job passed.

    Args:
        result: what ``run_pytest_on_ranks`` returned.
    """
    ranks = result.args[result.args.index("-np") + 1] if "-np" in result.args else "?"
    assert result.returncode == 0, (
        f"pytest on {ranks} ranks failed (exit {result.returncode}):\n{result.stdout[-20000:]}"
    )
    assert re.search(r"\d+ passed", result.stdout), f"pytest on {ranks} ranks passed nothing:\n{result.stdout[-5000:]}"


def _stop(proc: subprocess.Popen) -> str:
    """End mpirun and its ranks; return what they printed.

    SIGTERM first: mpirun then kills its ranks, which run in process groups of their
    own; a SIGKILL to mpirun alone would leave them running.
    """
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out
