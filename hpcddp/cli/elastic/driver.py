"""The elastic driver: run a job on the hosts it has, and start it again when hosts fail or change.

``hpcddp run -np 4 --min-np 2 ...`` runs this in place of a single launch. Each start
is one mpirun (or srun) over the hosts available then; its ranks connect to the
driver (``hpcddp.elastic.monitor``). When a rank's process dies, or a node goes silent,
the driver stops the job, blacklists the hosts that fail a health check, and starts the
job again on the rest (at least ``min_np`` ranks) while the new ranks resume from the
last commit that survived on some node (``hpcddp.elastic.commits``). When a discovery
script adds or drops hosts, the ranks are told; they leave at their next commit and the
driver starts them again on the new hosts.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...elastic.commits import CommitStore
from ...env.elastic import COMMIT_DIR_VARIABLE, DRIVER_VARIABLE, LAUNCH_VARIABLE, RUN_VARIABLE, TOKEN_VARIABLE
from ...fault.launcher_process import stop_launcher
from ...fault.supervise import shell_exit_code
from .hosts import Host, HostPool
from .launchers import JobLauncher
from .log import log
from .monitor import DriverServer, RankRecord
from .watch import HostWatch, describe, silent_hosts

__all__ = ["ElasticConfig", "ElasticDriver"]

#: failures in a row without a new commit between them before the driver gives up
MAX_FAILURES_WITHOUT_PROGRESS = 3
_POLL_S = 0.1
_DISCOVERY_INTERVAL_S = 1.0
_RESTART_GRACE_S = 20.0
#: longest error text of a rank that the driver quotes in its line
_ERROR_TEXT_CHARS = 300


@dataclass(kw_only=True)
class ElasticConfig:
    """How an elastic job may grow and shrink (``hpcddp run`` options of the same names)."""

    min_np: int
    """Fewest ranks the job may run with (--min-np)."""

    max_np: int | None = None
    """Most ranks it may run with (--max-np); None: every slot available."""

    reset_limit: int | None = None
    """How many times the job may be started again (--reset-limit); None: no limit."""

    elastic_timeout: float = 600.0
    """Seconds to wait for ``min_np`` slots before giving up (--elastic-timeout)."""

    beat_timeout: float = 5.0
    """Seconds without a beat from every rank on a host before the host is checked."""

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ValueError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np is not None and self.max_np < self.min_np:
            raise ValueError(f"--max-np must be >= --min-np ({self.min_np}), got {self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit must be >= 0, got {self.reset_limit}")


@dataclass
class _Outcome:
    kind: str  # finished, error, stopped, restart, failed
    code: int = 0
    failed_hosts: frozenset[str] = frozenset()
    commit: int = -1


class ElasticDriver:
    """Supervise an elastic job (see the module's docstring).

    Args:
        config: the elastic limits.
        pool: the hosts.
        launcher: how a start reaches them.
        program: the command every rank runs.
    """

    def __init__(self, config: ElasticConfig, pool: HostPool, launcher: JobLauncher, program: Sequence[str]) -> None:
        self.config = config
        self.pool = pool
        self.launcher = launcher
        self.program = list(program)
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
        self._token = secrets.token_hex(16)
        self._stop_signal: int | None = None
        self._proc: subprocess.Popen | None = None
        self._launch_environ: dict[str, str] | None = None

    def run(self) -> int:
        """Run the job to its end and return its exit code."""
        # Ranks on this host alone reach the driver over loopback: no other host may even try a hello.
        server = DriverServer(self._token, loopback_only=self.pool.is_local())
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            code = self._supervise(server)
            if self._stop_signal is not None:
                # The shell's code for a job ended by a signal, whatever mpirun made of it (1).
                name = signal.Signals(self._stop_signal).name
                log(f"stopped by {name}: the job is not started again (exit {128 + self._stop_signal})")
                return 128 + self._stop_signal
            return code
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            server.close()
            self._remove_commits()

    def _remove_commits(self) -> None:
        """Drop this host's commits of the run: no start will read them (a job that gave up, was
        stopped or failed left them in /dev/shm, which is memory, until the next reboot)."""
        root = self.launcher.environ.get(COMMIT_DIR_VARIABLE, "").strip() or None
        shutil.rmtree(CommitStore(self.run_id, root).run_dir, ignore_errors=True)

    def _supervise(self, server: DriverServer) -> int:
        launch, failures, last_commit = 0, 0, -1
        while True:
            try:
                hosts = self._wait_for_slots(first=launch == 0)
            except ValueError as err:  # the discovery script cannot be used at all
                log(str(err))
                return 2
            if hosts is None:
                return 1
            outcome = self._run_launch(server, launch, hosts)
            if outcome.kind in ("finished", "error", "stopped"):
                return outcome.code
            if outcome.failed_hosts:
                self.pool.fail(sorted(outcome.failed_hosts))
                log(f"blacklisted {', '.join(sorted(outcome.failed_hosts))}")
            if outcome.kind == "failed":
                failures = 0 if outcome.commit > last_commit else failures + 1
                if failures >= MAX_FAILURES_WITHOUT_PROGRESS:
                    log(f"{failures} failures in a row without a new commit: giving up (exit {outcome.code or 1})")
                    return outcome.code or 1
            last_commit = max(last_commit, outcome.commit)
            launch += 1
            if self.config.reset_limit is not None and launch > self.config.reset_limit:
                log(f"--reset-limit {self.config.reset_limit} reached: giving up")
                return outcome.code or 1

    def _wait_for_slots(self, first: bool = False) -> list[Host] | None:
        """Return the hosts of the next start (slots trimmed to max_np), or None after elastic_timeout.

        A discovery script that fails or prints what is not ``host:slots`` before the first start
        raises ValueError; later it counts as no hosts until it works again (a node's outage
        may take the script's source down with it).
        """
        deadline = time.monotonic() + self.config.elastic_timeout
        said = False
        while self._stop_signal is None:
            self.pool.recheck(self.launcher.failed_hosts)
            try:
                hosts = self.pool.discover()
            except (RuntimeError, ValueError) as err:
                if first:
                    raise ValueError(str(err)) from None
                if not said:
                    log(f"{err}: waiting for it to work")
                hosts = []
            if sum(h.slots for h in hosts) >= self.config.min_np:
                return self._assign(hosts)
            if not said:
                log(f"waiting for {self.config.min_np} slots (have {sum(h.slots for h in hosts)})")
                said = True
            if time.monotonic() > deadline:
                log(f"fewer than --min-np {self.config.min_np} slots for {self.config.elastic_timeout:g} s: giving up")
                return None
            time.sleep(_DISCOVERY_INTERVAL_S)
        return None

    def _assign(self, hosts: list[Host]) -> list[Host]:
        left = self.config.max_np if self.config.max_np is not None else sum(h.slots for h in hosts)
        assigned = []
        for host in hosts:
            take = min(host.slots, left)
            if take > 0:
                assigned.append(Host(host.name, take))
                left -= take
        return assigned

    def _run_launch(self, server: DriverServer, launch: int, hosts: list[Host]) -> _Outcome:
        num_proc = sum(h.slots for h in hosts)
        server.begin_launch(launch, num_proc)
        variables = {
            DRIVER_VARIABLE: f"{','.join(server.addresses)}:{server.port}",
            TOKEN_VARIABLE: self._token,
            RUN_VARIABLE: self.run_id,
            LAUNCH_VARIABLE: str(launch),
        }
        command, environ = self.launcher.command(hosts, self.program, variables)
        log(f"start {launch}: {num_proc} ranks on {', '.join(map(str, hosts))}")
        no_room = server.room_for(num_proc)
        if no_room:
            log(no_room)
        self._launch_environ = environ
        self._proc = proc = subprocess.Popen(command, env=environ, start_new_session=True)
        names = {h.name for h in hosts}
        watch = HostWatch(self.pool, names, self.config.max_np, self.launcher)
        restart_since = None
        checked: dict[str, float] = {}
        try:
            while proc.poll() is None:
                time.sleep(_POLL_S)
                if self._stop_signal is not None:
                    return _Outcome("stopped", self._wait_stopped(proc))
                records = server.records()
                done = any(r.ended == "done" for r in records.values())
                if not done and any(r.ended == "lost" for r in records.values()):
                    time.sleep(0.5)  # a rank that failed says so before its abort takes the others
                    records = server.records()
                    if any(r.ended == "error" for r in records.values()):
                        _log_script_error(records)
                        return self._stop(proc, "error", frozenset(), records)
                    log(f"lost rank(s) {describe(records, 'lost')}: stopping the job")
                    return self._after_failure(proc, names, records)
                now = time.monotonic()
                silent = {
                    h
                    for h in silent_hosts(records, self.config.beat_timeout)
                    if now - checked.get(h, -1e9) > self.config.beat_timeout
                }
                if silent:
                    checked.update(dict.fromkeys(silent, now))
                    failed = self.launcher.failed_hosts(sorted(silent))
                    if failed:
                        log(f"no word from the ranks on {', '.join(sorted(failed))}, which fail a health check")
                        return self._stop(proc, "failed", failed, records)
                    log(
                        f"no word from the ranks on {', '.join(sorted(silent))} for {self.config.beat_timeout:g} s, "
                        "but the hosts pass a health check: the job goes on"
                    )
                if restart_since is None and any(r.ended == "restart" for r in records.values()):
                    restart_since = time.monotonic()
                if restart_since is not None and time.monotonic() - restart_since > _RESTART_GRACE_S:
                    return self._stop(proc, "restart", frozenset(), records)
                update = watch.poll()
                if update:
                    server.notify(time.time(), update)
            return self._after_exit(server, proc.returncode, names, launch)
        finally:
            self._end(proc)
            self._proc = None

    def _after_exit(self, server: DriverServer, code: int, names: set[str], launch: int = 0) -> _Outcome:
        deadline = time.monotonic() + 2.0
        records = server.records()
        while time.monotonic() < deadline and any(r.ended is None for r in records.values()):
            time.sleep(_POLL_S)
            records = server.records()
        commit = _newest_commit(records)
        ended = [r.ended for r in records.values()]
        code = shell_exit_code(code)
        if self._stop_signal is not None:
            return _Outcome("stopped", code)
        if ended and all(e == "done" for e in ended):
            return _Outcome("finished", code, commit=commit)
        if "error" in ended:
            _log_script_error(records)
            return _Outcome("error", code or 1, commit=commit)
        if "restart" in ended:
            return _Outcome("restart", code, commit=commit)
        if not records and code == 0:
            return _Outcome("finished", 0)  # a script that never used hvd.elastic.run, and ended well
        if "done" in ended:
            # The training function returned on a rank, so every collective of it completed: the job
            # is over (as in Horovod, where one worker's success ends the job). A start again would
            # find no commit (the finished rank removed them) and train from the beginning.
            log(
                f"rank(s) {describe(records, None, 'lost')} ended without finishing after rank(s) "
                f"{describe(records, 'done')} finished: the job is over, exit {code or 1}"
            )
            return _Outcome("finished", code or 1, commit=commit)
        if records:
            log(f"the job exited {code} with rank(s) {describe(records, None, 'lost')} unfinished")
        failed = self._check_hosts(names)
        # A rank killed by a signal (the OOM killer, a user's kill) did not fail by itself, and a
        # script that reached hvd.elastic.run in an earlier start does again: start it again
        # (three failures in a row without a commit end the job).
        if not records and not failed and code <= 128 and launch == 0:
            # Every host works, so the script itself failed before it reached hvd.elastic.run.
            log(f"the job exited {code} before any rank reached hvd.elastic.run: not starting it again")
            return _Outcome("error", code or 1)
        return _Outcome("failed", code or 1, failed, commit)

    def _check_hosts(self, names: set[str]) -> frozenset[str]:
        started = time.monotonic()
        failed = frozenset(self.launcher.failed_hosts(sorted(names)))
        log(
            f"health check of {', '.join(sorted(names))} in {time.monotonic() - started:.1f} s: "
            + (f"{', '.join(sorted(failed))} failed" if failed else "every host works")
        )
        return failed

    def _after_failure(self, proc: subprocess.Popen, names: set[str], records: dict[int, RankRecord]) -> _Outcome:
        self._end(proc)  # before the health check: the hosts' ranks are gone when it runs
        return self._stop(proc, "failed", self._check_hosts(names), records)

    def _stop(self, proc, kind: str, failed, records: dict[int, RankRecord]) -> _Outcome:
        self._end(proc)
        return _Outcome(kind, 1, frozenset(failed), _newest_commit(records))

    def _end(self, proc: subprocess.Popen) -> None:
        stop_launcher(proc, self._launch_environ)

    def _wait_stopped(self, proc: subprocess.Popen) -> int:
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._end(proc)
            code = proc.wait()
        return shell_exit_code(code)

    def _on_signal(self, signum, _frame) -> None:
        # A scheduler's or a user's stop ends the elastic job: pass it on, start nothing again.
        self._stop_signal = signum
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signum)
            except ProcessLookupError:
                pass


def _log_script_error(records: dict[int, RankRecord]) -> None:
    failed = [r for r in sorted(records.values(), key=lambda r: r.rank) if r.ended == "error"]
    # One line of bounded length: an exception's message may span lines or be huge.
    texts = list(dict.fromkeys(" ".join(r.text.split()) for r in failed if r.text))
    why = texts[0] if texts else "an error in the script"
    if len(why) > _ERROR_TEXT_CHARS:
        why = why[:_ERROR_TEXT_CHARS] + "..."
    if len(texts) > 1:
        why += f"; and {len(texts) - 1} other message(s)"
    log(f"rank(s) {describe(records, 'error')} failed ({why}): the job ends without a restart (it would fail again)")


def _newest_commit(records: dict[int, RankRecord]) -> int:
    return max((r.commit for r in records.values()), default=-1)
