"""``hpcddp run --min-np`` on this host: a lost rank is started again from the last commit; a failing script is not."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcddp.testing import run_command

from .conftest import ROOT
from .elastic_reference import assert_matches_replay, read_steps

pytestmark = pytest.mark.ranks

TIME_LIMIT_S = 300
HPCDDP = [sys.executable, "-m", "hpcddp.cli"]


def test_a_killed_rank_is_started_again_and_the_job_ends_where_the_replay_ends(tmp_path):
    log = tmp_path / "log"
    command = [*HPCDDP, "run", "-np", "2", "--min-np", "1", "tests/elastic_job.py", "--log", str(log)]
    result = run_command([*command, "--epochs", "2", "--die-at", "5", "--commit-every", "2"], TIME_LIMIT_S, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "elastic" in result.stdout and "start 1: 2 ranks on localhost:2" in result.stdout, result.stdout[-3000:]
    counted = assert_matches_replay(log)
    steps = read_steps(log)
    # Killed after step 5, committed at step 4: one step ran again, in the second start.
    assert max(s["step"] for s in steps if s["launch"] == 0) == 5
    assert min(s["step"] for s in steps if s["launch"] == 1) == 5 and counted[5] == 1
    assert all(s["resets"] == [2] for s in steps if s["launch"] == 1)  # the reset callbacks ran once, at size 2


@pytest.mark.parametrize("where", ["in the training function", "before hvd.elastic.run"])
def test_a_failing_script_ends_the_elastic_job_without_starting_it_again(tmp_path, where):
    script = tmp_path / "fails.py"
    body = "raise ValueError('a bug in the script')" if where == "before hvd.elastic.run" else "pass"
    script.write_text(
        "import hpcddp.horovod as hvd\n"
        "hvd.init()\n"
        f"{body}\n"
        "state = hvd.elastic.ObjectState(step=0)\n\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    raise ValueError('a bug in the script')\n\n"
        "train(state)\n"
    )
    result = run_command([*HPCDDP, "run", "-np", "2", "--min-np", "1", str(script)], TIME_LIMIT_S, cwd=ROOT)
    assert result.returncode != 0
    assert "ValueError: a bug in the script" in result.stdout
    assert "start 0:" in result.stdout and "start 1:" not in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--min-np", "3", "--max-np", "2"], "--max-np must be >= --min-np (3), got 2"),
        (["--min-np", "0"], "--min-np must be >= 1, got 0"),
        (["--min-np", "1", "--dry-run"], "--dry-run shows one launch; an elastic job has many: drop --dry-run"),
    ],
)
def test_elastic_options_are_checked_in_one_line(options, message):
    result = run_command([*HPCDDP, "run", "-np", "2", *options, "tests/elastic_job.py"], 120, cwd=ROOT)
    assert result.returncode == 2 and message in result.stdout, result.stdout


def test_a_rank_killed_before_hvd_elastic_run_is_started_again(tmp_path):
    # A signal (the OOM killer, a user's kill -9) before the ranks reach hvd.elastic.run is
    # no bug in the script: the job starts again (it ended at start 0, exit 137).
    script = tmp_path / "killed.py"
    script.write_text(
        "import os, signal\n"
        "import hpcddp.horovod as hvd\n"
        "hvd.init()\n"
        "if os.environ['HPCDDP_ELASTIC_LAUNCH'] == '0' and hvd.rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "state = hvd.elastic.ObjectState(step=0)\n\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    state.step += 1\n"
        "    state.commit()\n\n"
        "train(state)\n"
    )
    result = run_command([*HPCDDP, "run", "-np", "2", "--min-np", "1", str(script)], TIME_LIMIT_S, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "start 1: 2 ranks on localhost:2" in result.stdout, result.stdout[-3000:]


def test_a_job_that_gives_up_leaves_no_commit_behind_on_this_host(tmp_path):
    commits = tmp_path / "shm"
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal\n"
        "import hpcddp.horovod as hvd\n"
        "hvd.init()\n"
        "state = hvd.elastic.ObjectState(step=0)\n\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    while state.step < 3:\n"
        "        state.step += 1\n"
        "        state.commit()\n"
        "        if state.step == 2 and hvd.rank() == 1:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n\n"
        "train(state)\n"
    )
    command = [*HPCDDP, "run", "-np", "2", "--min-np", "1", "--reset-limit", "0", str(script)]
    result = run_command(command, TIME_LIMIT_S, cwd=ROOT, env={"HPCDDP_ELASTIC_COMMIT_DIR": str(commits)})
    assert result.returncode != 0 and "--reset-limit 0 reached" in result.stdout, result.stdout[-3000:]
    assert list((commits / f"hpcddp-elastic-{os.getuid()}").iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_hpcddp_run_stops_the_elastic_job_with_the_shells_code(tmp_path, signum):
    marker = tmp_path / "started"
    program = [sys.executable, "-c", f"import time; open({str(marker)!r}, 'w').close(); time.sleep(120)"]
    proc = subprocess.Popen(
        [*HPCDDP, "run", "-np", "2", "--min-np", "1", *program],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, out[-3000:]
    assert "start 1:" not in out and f"stopped by {signal.Signals(signum).name}" in out, out[-3000:]


def test_no_command_line_holds_the_token_and_a_second_hello_for_a_live_rank_changes_nothing(tmp_path):
    # Rank 0 plays a process that read the token: it says hello as rank 1, whose own connection
    # is live, then closes, as a rank that died would. The job must go on at its first start.
    report = tmp_path / "report.json"
    script = tmp_path / "forges.py"
    script.write_text(
        "import glob, json, os, socket, time\n"
        "import hpcddp.horovod as hvd\n"
        "from hpcddp.elastic.session import worker_session\n"
        "from hpcddp.env.network import list_interfaces\n"
        "hvd.init()\n"
        "worker_session()\n"
        "hvd.barrier()\n"
        "token = os.environ['HPCDDP_ELASTIC_TOKEN']\n"
        "addresses, port = os.environ['HPCDDP_ELASTIC_DRIVER'].rsplit(':', 1)\n"
        "if hvd.rank() == 0:\n"
        "    time.sleep(1)  # the driver reads rank 1's hello\n"
        "    holders = []\n"
        "    for path in glob.glob('/proc/[0-9]*/cmdline'):\n"
        "        try:\n"
        "            if token.encode() in open(path, 'rb').read():\n"
        "                holders.append(open(path, 'rb').read().replace(b'\\0', b' ').decode())\n"
        "        except OSError:\n"
        "            pass\n"
        "    outward = []\n"
        "    for i in list_interfaces():\n"
        "        if not i.is_loopback:\n"
        "            try:\n"
        "                socket.create_connection((i.address, int(port)), timeout=5).close()\n"
        "                outward.append(i.address)\n"
        "            except OSError:\n"
        "                pass\n"
        "    hello = {'hello': token, 'rank': 1, 'size': 2, 'host': 'forger', 'launch': 0}\n"
        "    with socket.create_connection(('127.0.0.1', int(port)), timeout=10) as forger:\n"
        "        forger.sendall(json.dumps(hello).encode() + b'\\n')\n"
        "        time.sleep(0.5)\n"
        "    time.sleep(2)  # the driver would have stopped the job by now\n"
        "    json.dump({'holders': holders, 'addresses': addresses, 'outward': outward}, open(os.environ['REPORT'], 'w'))\n"
        "hvd.barrier()\n"
    )
    result = run_command(
        [*HPCDDP, "run", "-np", "2", "--min-np", "1", str(script)], TIME_LIMIT_S, cwd=ROOT, env={"REPORT": str(report)}
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "refused a second hello for rank 1 from 127.0.0.1:" in result.stdout, result.stdout[-3000:]
    assert "lost rank" not in result.stdout and "start 1:" not in result.stdout, result.stdout[-3000:]
    found = json.loads(report.read_text())
    assert found["holders"] == []
    assert found["addresses"] == "127.0.0.1" and found["outward"] == []
