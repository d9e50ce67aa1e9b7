"""A real one-node Slurm cluster: srun bootstrap, sbatch slurm/train.sh with both launchers, preemption and requeue.

The cluster comes from slurm/testing/start_cluster.sh (root, Debian: it installs Slurm and
writes /etc/slurm/slurm.conf), so outside CI these tests run only with HPCDDP_SLURM_TESTS=1.
In CI (CI=true) they always run, and a cluster that cannot start fails them.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from .conftest import ROOT

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
START = os.path.join(ROOT, "slurm", "testing", "start_cluster.sh")
TRAIN_SH = os.path.join(ROOT, "slurm", "train.sh")
LAUNCHERS = ["srun", "mpirun"]
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED")
NUM_STEPS = 12 * 22  # examples/train.py's default 12 epochs of 22 steps


def unavailable(reason):
    if CI:
        pytest.fail(f"CI must run the Slurm tests, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    if not CI and os.environ.get("HPCDDP_SLURM_TESTS") != "1":
        pytest.skip(
            "set HPCDDP_SLURM_TESTS=1 to start a test Slurm cluster on this host (root, Debian; installs Slurm)"
        )
    if os.geteuid() != 0:
        unavailable(f"slurm/testing/start_cluster.sh must run as root, this is uid {os.geteuid()}")
    try:
        result = subprocess.run(["bash", START], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as err:
        unavailable(f"start_cluster.sh did not finish in {err.timeout} s")
    if result.returncode != 0:
        unavailable(f"start_cluster.sh failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")


@pytest.fixture
def slurm_env(slurm_cluster):
    # The Python running the tests on every rank; pip's Open MPI needs these two under srun (see slurm/README.md).
    return {**os.environ, "PYTHON": sys.executable, "PMIX_MCA_psec": "native", "OPAL_PREFIX": sys.prefix}


def scontrol_job(job_id):
    """Return scontrol's fields of a job as a dict, or {} once Slurm has forgotten it."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return {}
    return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)


def submit(env, tmp_path, launcher, *train_args, wait=True, timeout=300):
    """sbatch slurm/train.sh examples/train.py ...; return (job id, return code or None, output path)."""
    output = tmp_path / f"{launcher}.out"
    command = ["sbatch", "--parsable", f"--output={output}", f"--export=ALL,LAUNCHER={launcher}"]
    command += ["--wait"] if wait else []
    command += [TRAIN_SH, f"{ROOT}/examples/train.py", "--quiet", *train_args]
    env = {**env, "HPCDDP_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        job = out.strip().split(";")[0]
        if job:
            subprocess.run(["scancel", job], timeout=30)
        pytest.fail(f"sbatch --wait did not return in {timeout} s (job {job or '?'} cancelled): {err[-2000:]}")
    job = out.strip().split(";")[0]
    assert job.isdigit(), f"sbatch printed {out!r}, stderr {err[-2000:]}"
    return job, proc.returncode, output


@pytest.mark.parametrize("mpi, backend", [("pmix", "mpi"), ("pmi2", "gloo"), ("none", "gloo")])
def test_srun_ranks_are_distinct_with_every_mpi_plugin(slurm_env, mpi, backend):
    code = "import hpcddp; hpcddp.init(); print('rank', hpcddp.rank(), hpcddp.size(), hpcddp.backend(), flush=True)"
    result = subprocess.run(
        ["srun", "-n", "2", f"--mpi={mpi}", "--kill-on-bad-exit=1", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env=slurm_env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank 0 2 {backend}", f"rank 1 2 {backend}"], result.stdout + result.stderr


@pytest.fixture(scope="session")
def uninterrupted():
    """Final parameters of each launcher's uninterrupted run (filled by the sbatch --wait test)."""
    return {}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sbatch_trains_to_95_percent_on_distinct_ranks(slurm_env, tmp_path, launcher, uninterrupted):
    job, rc, output = submit(
        slurm_env, tmp_path, launcher, "--json", str(tmp_path / "m.json"), "--save-final", str(tmp_path / "final.pt")
    )
    log = output.read_text() if output.exists() else "(no output file)"
    assert rc == 0, f"job {job} exited {rc}:\n{log[-5000:]}"
    assert f"launcher {launcher}" in log
    ranks = re.findall(r"^rank (\d+)/(\d+) on \S+, backend (\w+)", log, flags=re.M)
    assert sorted(ranks) == [("0", "2", "mpi"), ("1", "2", "mpi")], log[-5000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == 2 and metrics["completed"] and metrics["step"] == NUM_STEPS, metrics
    assert metrics["test_accuracy"] >= 0.95, metrics
    uninterrupted[launcher] = torch.load(tmp_path / "final.pt")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_usr1_checkpoints_requeues_and_resumes_to_the_same_parameters(slurm_env, tmp_path, launcher, uninterrupted):
    if launcher not in uninterrupted:  # run alone: make the uninterrupted run first
        (tmp_path / "plain").mkdir()
        test_sbatch_trains_to_95_percent_on_distinct_ranks(slurm_env, tmp_path / "plain", launcher, uninterrupted)
    final = tmp_path / "final.pt"
    args = ["--slow", "0.05", "--checkpoint-every", "4", "--save-final", str(final)]
    job, _, output = submit(slurm_env, tmp_path, launcher, *args, wait=False, timeout=60)
    states, last = [], {}
    try:
        first = tmp_path / "checkpoints" / "checkpoint-000004.pt"
        deadline = time.monotonic() + 180
        while not first.exists():
            assert time.monotonic() < deadline, f"job {job} wrote no checkpoint in 180 s: {scontrol_job(job)}"
            assert scontrol_job(job).get("JobState") in ACTIVE, scontrol_job(job)
            time.sleep(0.2)
        # What sbatch --signal=B:USR1@90 does before the time limit: signal the batch shell,
        # which is the launcher (train.sh execs it); srun and mpirun forward it to the ranks.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)
        deadline = time.monotonic() + 240
        while info := scontrol_job(job):  # Slurm forgets a finished job after MinJobAge (5 s)
            states.append((info.get("JobState"), info.get("Restarts")))
            last = info
            if info.get("JobState") not in ACTIVE:
                break
            assert time.monotonic() < deadline, f"job {job} did not finish in 240 s: {info}"
            time.sleep(0.3)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    log = output.read_text()
    assert last.get("JobState") == "COMPLETED" and last.get("ExitCode") == "0:0", f"{last}\n{log[-5000:]}"
    assert int(last.get("Restarts", 0)) >= 1 and ("PENDING", "1") in states, (states, log[-5000:])
    stopped = re.search(r"^stopped at step (\d+), job requeued$", log, flags=re.M)
    assert stopped, log[-5000:]
    step = int(stopped.group(1))
    assert 4 <= step < NUM_STEPS
    assert re.search(r"^rank 0/2 on \S+, backend mpi, restart 1$", log, flags=re.M), log[-5000:]
    assert re.search(rf"^resumed from step {step} \(", log, flags=re.M), log[-5000:]
    assert "done: test accuracy" in log
    expected, got = uninterrupted[launcher], torch.load(final)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after the requeue at step {step}"
