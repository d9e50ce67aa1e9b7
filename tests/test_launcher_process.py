"""A killed mpirun's session directory: Open MPI leaves it, a later mpirun with that pid fails, hpcddp removes it.

Each test gives mpirun a TMPDIR of its own, so what it checks is Open MPI's real
behaviour and nothing on this machine's /tmp is touched.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hpcddp.cli.launch import mpirun_command
from hpcddp.fault.launcher_process import remove_session_directory, stop_launcher

pytestmark = [pytest.mark.ranks, pytest.mark.skipif(sys.platform != "linux", reason="Open MPI 5 on Linux")]

# A rank that ends by itself when mpirun is gone (a killed mpirun leaves its ranks running).
_RANK = (
    "import os, sys, time\n"
    "open(sys.argv[1] + '/' + str(os.getpid()), 'w').close()\n"
    "parent = os.getppid()\n"
    "for _ in range(600):\n"
    "    if os.getppid() != parent: break\n"
    "    time.sleep(0.1)\n"
)


def _start(tmp_path, num_ranks: int) -> tuple[subprocess.Popen, dict[str, str], str]:
    base = tmp_path / "tmp"
    pids = tmp_path / "pids"
    base.mkdir()
    pids.mkdir()
    env = {**os.environ, "TMPDIR": str(base)}
    command = mpirun_command(num_ranks, [sys.executable, "-c", _RANK, str(pids)], environ=env)
    proc = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    session = base / f"ompi.{proc.pid}"
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < num_ranks:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
        time.sleep(0.1)
    assert session.is_dir(), f"mpirun keeps no session directory at {session}: {os.listdir(base)}"
    return proc, env, str(session)


def _rank_pids(tmp_path) -> list[int]:
    return [int(name) for name in os.listdir(tmp_path / "pids")]


def _gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_mpirun_leaves_its_session_directory_which_is_removed_once_reaped(tmp_path):
    proc, env, session = _start(tmp_path, 1)
    assert not remove_session_directory(proc, env), "removed while mpirun still ran"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.isdir(session), "Open MPI removed its session directory although killed"
    assert remove_session_directory(proc, env)
    assert not os.path.exists(session)
    assert _gone(_rank_pids(tmp_path))


def test_stop_launcher_ends_the_ranks_and_leaves_no_session_directory(tmp_path):
    proc, env, session = _start(tmp_path, 2)
    stop_launcher(proc, env, grace_s=0.0)  # straight to KILL: the case Open MPI cannot clean up
    assert proc.returncode is not None
    assert not os.path.exists(session)
    assert _gone(_rank_pids(tmp_path))


def _leave_stale_directories(base, count: int) -> None:
    """Make what a killed mpirun leaves (directory and rendezvous file) for the next ``count`` pids."""
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    last = _last_pid()
    rendezvous = f"pmix.{socket.gethostname()}.tool"
    for step in range(1, count + 1):
        pid = last + step
        pid = pid if pid <= pid_max else pid - pid_max + 300  # the kernel wraps to 300
        directory = os.path.join(base, f"ompi.{pid}")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, rendezvous), "w") as file:
            file.write("stale")


def _last_pid() -> int:
    """The pid the kernel gave last (a child started now gets one just above)."""
    try:
        return int(open("/proc/sys/kernel/ns_last_pid").read())
    except OSError:
        child = subprocess.Popen(["true"])
        child.wait()
        return child.pid


def test_hpcddp_run_explains_a_start_failed_on_a_stale_session_directory(tmp_path):
    base = tmp_path / "tmp"
    base.mkdir()
    env = {**os.environ, "TMPDIR": str(base)}
    for _ in range(3):  # the pid mpirun gets lies within the next few thousand, unless the machine is busy
        _leave_stale_directories(base, 3000)
        run = subprocess.run(
            [sys.executable, "-m", "hpcddp.cli", "run", "-np", "1", sys.executable, "-c", "pass"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if run.returncode != 0:
            break
    assert run.returncode == 213, run.stdout + run.stderr
    assert "The PMIx server's listener thread failed to start" in run.stdout + run.stderr
    assert "an mpirun killed earlier may have left" in run.stderr and "run the command again" in run.stderr


def test_hpcddp_run_stops_an_mpirun_that_outlives_a_ranks_abort(monkeypatch, tmp_path, capsys):
    # As mpirun after MPI_Abort when a node is cut off: the rank left word, the launcher hangs on.
    from hpcddp.fault import supervise as supervise_module

    monkeypatch.setattr(supervise_module, "LAUNCHER_ABORT_GRACE_S", 1.0)
    monkeypatch.chdir(tmp_path)
    mpirun = tmp_path / "mpirun"
    mpirun.write_text(
        f"#!{sys.executable}\n"
        "import os, pathlib, time\n"
        "pathlib.Path(os.environ['HPCDDP_RUN_STATUS'], 'vnode9.aborted').write_text('3 7\\n')\n"
        "time.sleep(60)\n"
    )
    mpirun.chmod(0o755)
    started = time.monotonic()
    code = supervise_module.supervise([str(mpirun)], dict(os.environ))
    assert code == 7
    assert time.monotonic() - started < 15
    assert "rank 3 ended the job (exit 7) over 1 s ago, but mpirun has not exited" in capsys.readouterr().err
