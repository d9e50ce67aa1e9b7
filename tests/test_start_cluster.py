"""slurm/testing/start_cluster.sh says "cluster up" only when its own daemons run and answer.

No Slurm is started: the script is sourced (it then only defines its functions) and its
check_cluster runs against pid files of processes started here and fake ``scontrol`` and
``sinfo`` on PATH.
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT

SCRIPT = os.path.join(ROOT, "slurm", "testing", "start_cluster.sh")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or sys.platform != "linux", reason="needs bash on Linux")


@pytest.fixture
def cluster(tmp_path):
    """A fake cluster: log and state folders, fake client commands, daemons as sleep processes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "sinfo"):
        variable = f"FAKE_{name.upper()}"
        (bin_dir / name).write_text(f'#!/bin/sh\nprintf "%s\\n" "${variable}"\n')
        (bin_dir / name).chmod(0o755)
    (tmp_path / "state").mkdir()
    (tmp_path / "log").mkdir()
    pids = []

    def daemon(name, seconds=60):
        """Start a stand-in for daemon NAME that lives SECONDS; its pid file names it."""
        # Started by a shell that exits, as a daemon forks: init reaps it when it ends (a
        # child of this process would stay a zombie, which `kill -0` finds alive).
        started = subprocess.run(
            ["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
        )
        pid = int(started.stdout)
        pids.append(pid)
        (tmp_path / "state" / f"{name}.pid").write_text(f"{pid}\n")
        return pid

    def check(settle=0, ping="Slurmctld(primary) at node1 is UP", state="idle"):
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_TEST_STATE_DIR": str(tmp_path / "state"),
            "SLURM_TEST_LOG_DIR": str(tmp_path / "log"),
            "SLURM_CONF": str(tmp_path / "slurm.conf"),
            "SLURM_TEST_SETTLE": str(settle),
            "FAKE_SCONTROL": ping,
            "FAKE_SINFO": state,
        }
        command = f'source "{SCRIPT}" && check_cluster && echo checked'
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=30)

    cluster.daemon = daemon
    cluster.check = check
    cluster.log_dir = tmp_path / "log"
    yield cluster
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_running_daemons_that_answer_pass(cluster):
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd")
    result = cluster.check()
    assert result.returncode == 0 and result.stdout == "checked\n", result.stderr


def test_a_controller_that_died_fails_with_its_log_although_another_answers(cluster):
    ended = subprocess.Popen(["true"])
    ended.wait()
    (cluster.log_dir.parent / "state" / "slurmctld.pid").write_text(f"{ended.pid}\n")
    cluster.daemon("slurmd")
    (cluster.log_dir / "slurmctld.log").write_text(
        "error: Error binding slurm stream socket: Address already in use\n"
        "fatal: slurm_init_msg_engine_addrname_port error Address already in use\n"
    )
    result = cluster.check()
    assert result.returncode == 1 and "checked" not in result.stdout
    assert "slurmctld is not running" in result.stderr
    assert "fatal: slurm_init_msg_engine_addrname_port error Address already in use" in result.stderr


def test_a_daemon_that_dies_just_after_starting_is_caught(cluster):
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd", seconds=0.3)  # alive at the first look, gone before SLURM_TEST_SETTLE
    result = cluster.check(settle=2)
    assert result.returncode == 1 and "slurmd is not running" in result.stderr


@pytest.mark.parametrize(
    "answers, message",
    [
        ({"ping": "Slurmctld(primary) at node1 is DOWN"}, "slurmctld does not answer: scontrol ping says"),
        ({"state": "down*"}, "is not up: sinfo says 'down*'"),
        ({"state": ""}, "is not up: sinfo says 'nothing'"),
    ],
)
def test_daemons_that_do_not_answer_fail_with_what_they_said(cluster, answers, message):
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd")
    (cluster.log_dir / "slurmd.log").write_text("error: Unable to register: Zero Bytes were transmitted\n")
    result = cluster.check(**answers)
    assert result.returncode == 1 and message in result.stderr, result.stderr
    if "state" in answers:
        assert "Unable to register" in result.stderr
