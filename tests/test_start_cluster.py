"""slurm/testing/start_cluster.sh says "cluster up" only when its own daemons run, hold its ports and answer.

No Slurm is started: the script is sourced (it then only defines its functions) and its
checks run against pid files of processes started here, which listen on ports as the daemons
do, and fake ``scontrol`` and ``sinfo`` on PATH. A Slurm of this host's own (a site's, on
Slurm's default ports) must neither stop the test cluster nor be taken for it.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .cluster_jobs import ONE_NODE_CONF
from .conftest import ROOT

SCRIPT = os.path.join(ROOT, "slurm", "testing", "start_cluster.sh")

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(shutil.which("bash") is None or sys.platform != "linux", reason="needs bash on Linux"),
]


# A stand-in daemon: listens on a port of its own (0: one the kernel picks), writes the port to a
# file, and lives SECONDS.
LISTENER = """
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(sock.getsockname()[1]))
import os; os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(float(sys.argv[3]))
"""


@pytest.fixture
def cluster(tmp_path):
    """A fake cluster: log and state folders, fake client commands, daemons as listening processes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text('#!/bin/sh\nprintf "%s\\n" "$FAKE_SINFO"\n')
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '    ping) printf "%s\\n" "$FAKE_SCONTROL" ;;\n'
        '    show) printf "ClusterName             = %s\\nSlurmctldPort           = %s\\n" "$FAKE_CLUSTER" "$FAKE_PORT" ;;\n'
        "esac\n"
    )
    for name in ("scontrol", "sinfo"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "state").mkdir()
    (tmp_path / "log").mkdir()
    pids = []
    ports = {}

    def listen(seconds=60):
        """Start a process that listens on a free port; return (its pid, the port)."""
        port_file = tmp_path / f"port-{len(pids)}"
        # Started by a shell that exits, as a daemon forks: init reaps it when it ends (a
        # child of this process would stay a zombie, which `kill -0` finds alive).
        started = subprocess.run(
            ["sh", "-c", f'"$0" -c "$1" 0 {port_file} {seconds} >/dev/null 2>&1 & echo $!', sys.executable, LISTENER],
            capture_output=True,
            text=True,
            check=True,
        )
        pid = int(started.stdout)
        pids.append(pid)
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert time.monotonic() < deadline, "the stand-in daemon wrote no port in 20 s"
            time.sleep(0.02)
        return pid, int(port_file.read_text())

    def daemon(name, seconds=60):
        """Start a stand-in for daemon NAME that listens on its port and lives SECONDS; its pid file names it."""
        pid, port = listen(seconds)
        ports[name] = port
        (tmp_path / "state" / f"{name}.pid").write_text(f"{pid}\n")
        return pid

    def check(settle=0, ping="Slurmctld(primary) at node1 is UP", state="idle", name="hpcddp", **port_of):
        """Run check_cluster; ``port_of`` gives a daemon (slurmctld, slurmd) another port than its stand-in's."""
        ctld_port = port_of.get("slurmctld", ports.get("slurmctld", 1))
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SLURM_TEST_STATE_DIR": str(tmp_path / "state"),
            "SLURM_TEST_LOG_DIR": str(tmp_path / "log"),
            "SLURM_TEST_CONF": str(tmp_path / "slurm.conf"),
            "SLURM_TEST_SETTLE": str(settle),
            "SLURM_TEST_CTLD_PORT": str(ctld_port),
            "SLURM_TEST_SLURMD_PORT": str(port_of.get("slurmd", ports.get("slurmd", 1))),
            "FAKE_SCONTROL": ping,
            "FAKE_SINFO": state,
            "FAKE_CLUSTER": name,
            "FAKE_PORT": str(ctld_port),
        }
        return source_and_run("check_cluster", env)

    cluster.listen = listen
    cluster.ports = ports
    cluster.daemon = daemon
    cluster.check = check
    cluster.log_dir = tmp_path / "log"
    cluster.state_dir = tmp_path / "state"
    yield cluster
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def source_and_run(function, env):
    """Source start_cluster.sh (which then only defines its functions) and run one of them."""
    command = f'source "{SCRIPT}" && {function} && echo checked'
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=30)


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
    result = cluster.check(settle=1)  # whole seconds; 2 made this test 5 s
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


def one_line(result):
    """The one line that a failed check printed."""
    assert result.returncode == 1 and "checked" not in result.stdout, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "daemon, variable", [("slurmctld", "SLURM_TEST_CTLD_PORT"), ("slurmd", "SLURM_TEST_SLURMD_PORT")]
)
def test_another_process_on_a_daemons_port_fails_in_one_line_that_names_it(cluster, daemon, variable):
    # A site's slurmctld or slurmd on the port: ours lost it, and the other one answers for it.
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd")
    other, port = cluster.listen()
    line = one_line(cluster.check(**{daemon: port}))
    assert line.startswith(f"start_cluster.sh: {variable}={port} is taken by pid {other} ({sys.executable} -c "), line
    assert line.endswith(f", not by this cluster's {daemon}: stop that process, or set {variable} to a free port"), line


def test_a_port_taken_before_the_start_fails_in_one_line_that_names_it(cluster):
    other, port = cluster.listen()
    env = {**os.environ, "SLURM_TEST_STATE_DIR": str(cluster.state_dir), "SLURM_TEST_CTLD_PORT": str(port)}
    line = one_line(source_and_run("check_ports", env))
    assert line.startswith(f"start_cluster.sh: SLURM_TEST_CTLD_PORT={port} is taken by pid {other} ("), line
    assert line.endswith(
        "not by this cluster's slurmctld: stop that process, or set SLURM_TEST_CTLD_PORT to a free port"
    )


def test_ports_that_its_own_daemons_hold_pass_the_check_before_the_start(cluster):
    # start_cluster.sh on a cluster already up: its daemons hold the ports.
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd")
    result = cluster.check()
    assert result.returncode == 0, result.stderr
    env = {**os.environ, "SLURM_TEST_STATE_DIR": str(cluster.state_dir)}
    for name, variable in (("slurmctld", "SLURM_TEST_CTLD_PORT"), ("slurmd", "SLURM_TEST_SLURMD_PORT")):
        env[variable] = str(cluster.ports[name])
    result = source_and_run("check_ports", env)
    assert result.returncode == 0 and result.stdout == "checked\n", result.stderr


def test_a_daemon_that_does_not_listen_on_its_port_fails(cluster):
    # Its pid file names a live process that holds no port: not the daemon this cluster started.
    cluster.daemon("slurmctld")
    slurmd = cluster.daemon("slurmd")
    gone, free = cluster.listen()
    os.kill(gone, signal.SIGKILL)
    result = cluster.check(slurmd=free)
    assert result.returncode == 1 and "checked" not in result.stdout
    assert f"slurmd (pid {slurmd}) does not listen on SLURM_TEST_SLURMD_PORT={free}" in result.stderr, result.stderr


def test_the_controller_of_another_cluster_is_not_taken_for_this_one(cluster):
    cluster.daemon("slurmctld")
    cluster.daemon("slurmd")
    result = cluster.check(name="site")
    assert result.returncode == 1 and "checked" not in result.stdout
    assert "is cluster 'site' on port" in result.stderr and "not this one (hpcddp on" in result.stderr, result.stderr


def test_the_cluster_has_a_slurm_conf_and_ports_of_its_own():
    # What a site's Slurm on this host holds: /etc/slurm/slurm.conf, ports 6817 and 6818.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_TEST_")}
    env["SLURM_CONF"] = "/etc/slurm/slurm.conf"
    result = source_and_run('echo "$SLURM_TEST_CONF $SLURM_CONF" && render_conf', env)
    assert result.returncode == 0, result.stderr
    first, *conf = result.stdout.splitlines()
    assert first == f"{ONE_NODE_CONF} {ONE_NODE_CONF}" and ONE_NODE_CONF != "/etc/slurm/slurm.conf"
    settings = dict(line.split("=", 1) for line in conf if "=" in line and not line.startswith("#"))
    assert settings["ClusterName"] == "hpcddp"
    assert int(settings["SlurmctldPort"]) not in (6817, 6818) and int(settings["SlurmdPort"]) not in (6817, 6818)
    assert settings["SlurmctldPort"] != settings["SlurmdPort"]
