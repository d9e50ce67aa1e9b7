"""How the elastic driver starts the job on a set of hosts, and checks that a host still works.

mpirun gets the hosts as ``-H host:slots,...``; srun (inside a Slurm allocation, whose
job must survive a node's loss: ``sbatch --no-kill``) gets them as ``--nodelist``. A host
is healthy when the same launcher can run ``true`` on it within a few seconds: that needs
the node up, its launcher daemon able to start and its network to reach this host, which
is what the job needs.

Every check is a launcher process on the driver's host, so at most ``HEALTH_CONCURRENCY``
run at once (512 mpiruns started together time out on the driver's own load, and every
healthy host would be blacklisted), and each has ``HEALTH_TIMEOUT_S`` from its own start,
not from the first one's. A check that times out, or whose launcher cannot even be started
(this host out of processes or file descriptors), tells nothing about the host: it is
tried once more after the others, and only a second timeout fails the host (a node that
hangs must not hang the restart, so it cannot stay "unknown" for ever). A check that cannot
be started the second time either still tells nothing about the host, which is not failed
(the trouble is this host's): the driver says so in one line.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence

from ...fault.launcher_process import stop_launcher
from ..launch import FORWARDED_PREFIXES, LaunchConfig, build_launch_command, mpirun_command
from .hosts import Host
from .log import log

__all__ = ["HEALTH_CONCURRENCY", "HEALTH_TIMEOUT_S", "JobLauncher"]

#: how long a host may take to run ``true`` through the launcher, from its own check's start
HEALTH_TIMEOUT_S = 8.0
#: health checks (launcher processes on the driver's host) running at once
HEALTH_CONCURRENCY = 32
_CHECK_POLL_S = 0.05


class JobLauncher:
    """Start a program on hosts with mpirun or srun.

    Args:
        launcher: "mpirun" or "srun".
        env: ``NAME`` / ``NAME=VALUE`` items for every rank (``hpcddp run -x``).
        environ: the environment to start from.
        single_host: the job runs on this host alone (no -H, --hostfile or allocation): mpirun
            starts it as ``hpcddp run -np N`` does, oversubscribed when the ranks outnumber the
            cores and bound to cores otherwise.
    """

    def __init__(
        self, launcher: str, env: Sequence[str], environ: Mapping[str, str], single_host: bool = False
    ) -> None:
        if launcher not in ("mpirun", "srun"):
            raise ValueError(f"launcher must be 'mpirun' or 'srun' for an elastic job, got {launcher!r}")
        self.launcher = launcher
        self._env = tuple(env)
        self._environ = dict(environ)
        self.single_host = single_host and launcher == "mpirun"
        self._start_error = ""  # why the last health check could not be started

    @property
    def environ(self) -> dict[str, str]:
        """The environment the job starts from."""
        return self._environ

    def command(
        self, hosts: Sequence[Host], program: Sequence[str], variables: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """Return ``(argv, environment)`` that start ``program`` on every slot of ``hosts``.

        Args:
            hosts: where the ranks run.
            program: the command every rank runs.
            variables: ``HPCDDP_*`` variables for every rank; they travel in the launcher's
                environment, never on its command line (the driver's token is among them).
        """
        assert all(name.startswith(FORWARDED_PREFIXES) for name in variables)
        num_proc = sum(host.slots for host in hosts)
        # Open MPI's mpirun forwards HPCDDP_* by name (-x NAME); MPICH's mpirun and srun pass on every
        # variable. A value on the command line is readable by every process of this host (/proc/<pid>/cmdline).
        environ = {**self._environ, **variables}
        if self.launcher == "mpirun":
            # On this host alone, no -H: mpirun_command then oversubscribes or binds as for a plain run
            # (-H localhost:3 on 2 cores fails to bind).
            spec = None if self.single_host else ",".join(str(host) for host in hosts)
            config = LaunchConfig(num_proc=num_proc, hosts=spec, launcher="mpirun", env=self._env)
            return build_launch_command(config, program, environ)
        config = LaunchConfig(num_proc=num_proc, launcher="srun", env=self._env)
        command, environ = build_launch_command(config, program, environ)
        # srun takes no per-rank -x: the step inherits the environment built above. --overlap: the
        # previous start's step may still be "completing" on a lost node (Slurm waits for the node
        # to be declared down), holding the CPUs of the nodes left.
        nodes = ",".join(host.name for host in hosts)
        placement = [f"--nodelist={nodes}", f"--nodes={len(hosts)}", "--distribution=block", "--overlap"]
        return command[:1] + placement + command[1:], environ

    def failed_hosts(
        self, hosts: Sequence[str], timeout: float = HEALTH_TIMEOUT_S, concurrency: int = HEALTH_CONCURRENCY
    ) -> set[str]:
        """Return the hosts among ``hosts`` that cannot run ``true`` through the launcher (see the module's docstring).

        Args:
            hosts: the hosts to check.
            timeout: seconds each check may take, from its own start.
            concurrency: checks running at once.
        """
        failed, timed_out, not_started = self._check_all(hosts, timeout, concurrency)
        if timed_out or not_started:
            again_failed, timed_out, not_started = self._check_all(
                sorted(timed_out | not_started), timeout, concurrency
            )
            failed |= again_failed | timed_out
        if not_started:
            log(
                f"could not start the health check of {', '.join(sorted(not_started))} twice ({self._start_error}): "
                "counted as working (this host is short of processes or open files)"
            )
        return failed

    def _check_all(self, hosts: Sequence[str], timeout: float, concurrency: int) -> tuple[set[str], set[str], set[str]]:
        """Run the checks of ``hosts``, ``concurrency`` at a time; return (failed, timed out, not started)."""
        waiting = list(reversed(hosts))
        running: dict[str, tuple[subprocess.Popen, float]] = {}
        failed: set[str] = set()
        timed_out: set[str] = set()
        not_started: set[str] = set()
        while waiting or running:
            while waiting and len(running) < max(1, concurrency):
                host = waiting.pop()
                proc = self._start_check(host)
                if proc is None:
                    not_started.add(host)
                else:
                    running[host] = (proc, time.monotonic())
            time.sleep(_CHECK_POLL_S)
            now = time.monotonic()
            for host, (proc, started) in list(running.items()):
                # Looked at before the clock: a check that ended while this loop was slow passed.
                code = proc.poll()
                if code is None and now - started < timeout:
                    continue
                del running[host]
                if code is None:
                    # Only `true` runs: no grace, or each host still hanging adds one.
                    stop_launcher(proc, self._environ, grace_s=0.0)
                    timed_out.add(host)
                elif code != 0:
                    failed.add(host)
        return failed, timed_out, not_started

    def _start_check(self, host: str) -> subprocess.Popen | None:
        if self.launcher == "mpirun":
            command = mpirun_command(1, ["true"], hosts=f"{host}:1", environ=self._environ)
        else:
            srun = shutil.which("srun") or "srun"
            command = [srun, f"--nodelist={host}", "--nodes=1", "--ntasks=1", "--overlap", "--immediate=5", "true"]
        try:
            return subprocess.Popen(
                command, env=self._environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
        except OSError as err:
            self._start_error = err.strerror or str(err)
            return None
