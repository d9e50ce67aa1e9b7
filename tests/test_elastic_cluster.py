"""Elastic jobs across virtual nodes: a node crashes mid-training, the job goes on with the node left
from its last commit, and grows back to every node when the crashed one returns.

2 virtual nodes x 2 ranks (slurm/testing/virtual_cluster.sh): ``hpcddp run -np 4 --min-np 2
--host-discovery-script`` with a script that lists what the test says is up (as a cloud's or
scheduler's list would: the crashed node drops out a little after the crash, and returns), and
``MIN_NP=2 sbatch --no-kill slurm/train.sh`` in a 2-node allocation (the allocation's nodes; the
crashed one is taken back when it passes the driver's health check again). The job's
parameters are checked against a one-process replay of the steps that counted.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from .cluster_jobs import require_cluster_tests, start, vcluster_state
from .conftest import ROOT
from .elastic_reference import assert_matches_replay, read_steps

pytestmark = pytest.mark.system

VCLUSTER = os.path.join(ROOT, "slurm", "testing", "virtual_cluster.sh")
COMMIT_EVERY = 3
TIME_LIMIT_S = 600


@pytest.fixture(scope="module")
def vcluster_env():
    require_cluster_tests()
    start(VCLUSTER, "up", "--nodes", "2", "--slurm")
    try:
        yield vcluster_state()[1]
    finally:
        subprocess.run(["bash", VCLUSTER, "link", "vnode2", "up"], capture_output=True, timeout=60)
        subprocess.run(["bash", VCLUSTER, "down"], capture_output=True, timeout=120)


def _wait_for(what, predicate, proc, deadline):
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within the time limit")
        time.sleep(0.1)


JOB_ARGS = ["--epochs", "6", "--step-sleep", "0.25", "--commit-every", str(COMMIT_EVERY)]


def _start_mpirun(env, tmp_path, log, output):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("vnode1:2\nvnode2:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    command = [sys.executable, "-m", "hpcddp.cli", "run", "-np", "4", "--min-np", "2", "--max-np", "4"]
    command += ["--host-discovery-script", str(discover), "tests/elastic_job.py", "--log", str(log), *JOB_ARGS]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, lambda up: hosts.write_text("vnode1:2\nvnode2:2\n" if up else "vnode1:2\n")


def _start_sbatch(env, tmp_path, log, output):
    command = ["sbatch", "--wait", "--no-kill", "--nodes=2", "--ntasks-per-node=2", f"--output={output.name}"]
    command += ["--export=ALL,MIN_NP=2,LAUNCHER=srun", os.path.join(ROOT, "slurm", "train.sh")]
    command += [os.path.join(ROOT, "tests", "elastic_job.py"), "--log", str(log), *JOB_ARGS]
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, lambda up: None


@pytest.mark.parametrize("how", ["mpirun", "sbatch"])
def test_a_crashed_node_is_left_behind_and_the_job_grows_back_when_it_returns(vcluster_env, tmp_path, how):
    log = tmp_path / "log"
    output = open(tmp_path / "driver.txt", "w")
    env = {**os.environ, **vcluster_env}
    proc, list_vnode2 = (_start_mpirun if how == "mpirun" else _start_sbatch)(env, tmp_path, log, output)
    deadline = time.monotonic() + TIME_LIMIT_S

    def steps():
        return read_steps(log)

    try:
        _wait_for("step 6 at 4 ranks", lambda: any(s["step"] >= 6 and s["size"] == 4 for s in steps()), proc, deadline)
        crashed_at = time.time()
        subprocess.run(["bash", VCLUSTER, "link", "vnode2", "down"], check=True, timeout=60)
        subprocess.run(["bash", VCLUSTER, "crash", "vnode2"], check=True, timeout=60)
        time.sleep(3)
        list_vnode2(False)  # the node list notices the loss a little later
        _wait_for("a step at 2 ranks", lambda: any(s["size"] == 2 for s in steps()), proc, deadline)
        subprocess.run(["bash", VCLUSTER, "link", "vnode2", "up"], check=True, timeout=60)
        list_vnode2(True)
        returned_at = time.time()
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)])
            if how == "sbatch":
                subprocess.run(["scancel", "--name=hpcddp"], env=env, timeout=30)
        proc.wait()
        output.close()
    driver = (tmp_path / "driver.txt").read_text()
    assert proc.returncode == 0, driver[-5000:]
    counted = assert_matches_replay(log)
    lines = steps()
    launches = {}
    for s in lines:
        launches.setdefault(s["launch"], s["size"])
    sizes = [launches[k] for k in sorted(launches)]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4, (sizes, driver[-3000:])
    first_small = min(s["launch"] for s in lines if s["size"] == 2)
    last_before = max(s["step"] for s in lines if s["launch"] < first_small)
    resumed = min(s["step"] for s in lines if s["launch"] == first_small)
    assert last_before - resumed + 1 <= COMMIT_EVERY, (last_before, resumed)
    recovery = min(s["time"] for s in lines if s["launch"] == first_small) - crashed_at
    first_big = min(s["launch"] for s in lines if s["launch"] > first_small and s["size"] == 4)
    grow = min(s["time"] for s in lines if s["launch"] == first_big) - returned_at
    assert all(counted[s] in launches for s in counted)
    print(
        json.dumps(
            {
                "how": how,
                "sizes": sizes,
                "recovery_s": round(recovery, 1),
                "steps_lost": last_before - resumed + 1,
                "grow_back_s": round(grow, 1),
            }
        )
    )
