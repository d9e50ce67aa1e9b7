"""Submitting and watching jobs on the test clusters (one-node Slurm, virtual multi-node cluster)."""

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from .conftest import ROOT

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TRAIN_SH = os.path.join(ROOT, "slurm", "train.sh")
TRAIN_PY = os.path.join(ROOT, "examples", "train.py")
# The one-node cluster's own slurm.conf (SLURM_TEST_CONF in slurm/testing/common.sh), not the
# default /etc/slurm/slurm.conf that a site's Slurm on this host may read.
ONE_NODE_CONF = os.environ.get("SLURM_TEST_CONF", "/etc/hpcddp-slurm/slurm.conf")
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED")


def unavailable(reason):
    """Skip, or fail in CI, where the test clusters must run."""
    if CI:
        pytest.fail(f"CI must run the cluster tests, but {reason}")
    pytest.skip(reason)


def require_cluster_tests():
    """Skip unless the cluster tests may start daemons and namespaces on this host (CI, or opted in)."""
    if not CI and os.environ.get("HPCDDP_SLURM_TESTS") != "1":
        pytest.skip("set HPCDDP_SLURM_TESTS=1 to start test clusters on this host (root, Debian; installs Slurm)")
    if os.geteuid() != 0:
        unavailable(f"the test clusters must be started as root, this is uid {os.geteuid()}")


def start(script, *args, timeout=600):
    """Run a cluster start script; skip (fail in CI) with its output if it fails."""
    try:
        result = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        unavailable(f"{os.path.basename(script)} did not finish in {err.timeout} s")
    if result.returncode != 0:
        name = os.path.basename(script)
        unavailable(f"{name} failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")


def vcluster_state():
    """Return the virtual cluster's state directory and the variables its ``env`` file exports."""
    state = os.environ.get("VCLUSTER_STATE", "/run/hpcddp-vcluster")
    env = {}
    with open(os.path.join(state, "env")) as f:
        for line in f.read().splitlines():
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").partition("=")
                env[name] = value.strip("'")
    return state, env


def slurm_environment(extra=None):
    """The environment for srun/sbatch: the test's Python on every rank, pip's Open MPI under srun."""
    env = {**os.environ, "PYTHON": sys.executable, "PMIX_MCA_psec": "native", "OPAL_PREFIX": sys.prefix}
    return {**env, **(extra or {})}


def one_node_environment(extra=None):
    """slurm_environment() for the one-node cluster: its SLURM_CONF, whatever another test exported."""
    return slurm_environment({"SLURM_CONF": ONE_NODE_CONF, **(extra or {})})


def scontrol_job(job_id, env=None):
    """Return scontrol's fields of a job as a dict, or {} once Slurm has forgotten it."""
    result = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, env=env
    )
    if result.returncode != 0:
        return {}
    return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)


def submit(
    env,
    tmp_path,
    launcher,
    *train_args,
    wait=True,
    timeout=300,
    sbatch_args=(),
    name=None,
    checkpoints=True,
    script=None,
    batch=TRAIN_SH,
):
    """sbatch slurm/train.sh examples/train.py --quiet ... (or ``script`` ...); return (job id, return code or None, output path).

    ``batch`` replaces slurm/train.sh as the batch script (a wrapper that runs it). The job runs in ``tmp_path``; with ``checkpoints`` it saves into ``tmp_path/checkpoints``
    (HPCDDP_CHECKPOINT_DIR), without it into train.sh's default, ``tmp_path/checkpoints/<run id>``.
    """
    output = tmp_path / f"{name or launcher}.out"
    command = ["sbatch", "--parsable", f"--output={output}", f"--export=ALL,LAUNCHER={launcher}", *sbatch_args]
    command += ["--wait"] if wait else []
    command += [batch, *([script] if script else [TRAIN_PY, "--quiet"]), *train_args]
    env = {k: v for k, v in env.items() if k != "HPCDDP_CHECKPOINT_DIR"}
    if checkpoints:
        env["HPCDDP_CHECKPOINT_DIR"] = str(tmp_path / "checkpoints")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        job = out.strip().split(";")[0]
        if job:
            subprocess.run(["scancel", job], timeout=30, env=env)
        pytest.fail(f"sbatch --wait did not return in {timeout} s (job {job or '?'} cancelled): {err[-2000:]}")
    job = out.strip().split(";")[0]
    assert job.isdigit(), f"sbatch printed {out!r}, stderr {err[-2000:]}"
    return job, proc.returncode, output


def preempt_and_wait(env, tmp_path, job, output, first_checkpoint="checkpoint-000004.pt"):
    """Send the job's batch shell USR1 once it checkpointed, and follow it through requeue to its end.

    ``first_checkpoint`` is a glob under ``tmp_path/checkpoints`` ("*/checkpoint-000004.pt" for
    train.sh's per-run directories). Returns (the job's last scontrol fields, the (state,
    restarts) pairs seen, its log).
    """
    states, last = [], {}
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "checkpoints").glob(first_checkpoint)):
            assert time.monotonic() < deadline, f"job {job} wrote no checkpoint in 180 s: {scontrol_job(job, env)}"
            assert scontrol_job(job, env).get("JobState") in ACTIVE, scontrol_job(job, env)
            time.sleep(0.2)
        # What sbatch --signal=B:USR1@90 does before the time limit: signal the batch shell,
        # which is the launcher (train.sh execs it); srun and mpirun forward it to the ranks.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30, env=env)
        deadline = time.monotonic() + 240
        while info := scontrol_job(job, env):  # Slurm forgets a finished job after MinJobAge (5 s)
            states.append((info.get("JobState"), info.get("Restarts")))
            last = info
            if info.get("JobState") not in ACTIVE:
                break
            assert time.monotonic() < deadline, f"job {job} did not finish in 240 s: {info}"
            time.sleep(0.3)
    finally:
        subprocess.run(["scancel", job], timeout=30, env=env)
    return last, states, output.read_text()


def preempt_together(env, jobs, timeout=480):
    """``preempt_and_wait`` for several submitted jobs at once, one thread each.

    A preempted job spends most of its time waiting for Slurm (the requeue waits out the
    credential expiry, then a scheduler pass) and for its ranks to start, so jobs that fit
    the cluster together are followed together. ``jobs`` maps a name to preempt_and_wait's
    (tmp_path, job, output, first_checkpoint). Returns, by name, preempt_and_wait's result or
    what it raised (for ``outcome`` to raise in the test the job belongs to). Every job is
    cancelled before this returns, and no thread outlives it.
    """
    outcomes = {}

    def follow(name, tmp_path, job, output, first_checkpoint):
        try:
            outcomes[name] = preempt_and_wait(env, tmp_path, job, output, first_checkpoint)
        except BaseException as err:  # pytest.fail's Failed too: re-raised by outcome()
            outcomes[name] = err

    threads = [
        threading.Thread(target=follow, args=(name, *args), name=f"preempt {name}", daemon=True)
        for name, args in jobs.items()
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        for _, job, _, _ in jobs.values():
            subprocess.run(["scancel", job], timeout=30, env=env)
        for thread in threads:  # a cancelled job ends its thread's wait at the next poll
            thread.join(90)
    stuck = [thread.name for thread in threads if thread.is_alive()]
    assert not stuck, f"{stuck} still waiting {timeout} s after their jobs started, and after scancel"
    return outcomes


def outcome(value):
    """A job's result from ``preempt_together``, or raise what following it raised."""
    if isinstance(value, BaseException):
        raise value
    return value


def assert_resumed_to_the_same_parameters(last, states, log, expected, final_path, num_steps, world_size):
    """The job was requeued once, resumed from the step it stopped at, and ended where an uninterrupted run ends."""
    assert last.get("JobState") == "COMPLETED" and last.get("ExitCode") == "0:0", f"{last}\n{log[-5000:]}"
    assert int(last.get("Restarts", 0)) >= 1 and ("PENDING", "1") in states, (states, log[-5000:])
    stopped = re.search(r"^stopped at step (\d+)$", log, flags=re.M)  # requeued: Restarts and PENDING above
    assert stopped, log[-5000:]
    step = int(stopped.group(1))
    assert 4 <= step < num_steps
    assert re.search(rf"^rank 0/{world_size} on \S+, backend \w+, restart 1$", log, flags=re.M), log[-5000:]
    assert re.search(rf"^resumed from step {step} \(", log, flags=re.M), log[-5000:]
    assert "done: test accuracy" in log
    got = torch.load(final_path)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after the requeue at step {step}"
    return step
