"""Checkpoints belong to a run, not to a job number: slurm/train.sh on the one-node Slurm cluster.

Job numbers come again (a rebuilt controller), so a new job with an old job's number
must train from scratch, even when its first start already counts a restart (requeued
before the batch script ran), while a requeue of one job (same job record, which carries
the run in its Comment) resumes its own run; a job handed another run's checkpoint
directory stops unless told to continue that run. Gated like test_slurm.py.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from . import test_slurm
from .cluster_jobs import TRAIN_SH, one_node_environment, outcome, preempt_together, submit

pytestmark = pytest.mark.system

# test_slurm.py's fixtures: the one-node cluster (started once), and the environment for sbatch.
slurm_cluster = test_slurm.slurm_cluster
slurm_env = test_slurm.slurm_env

STEPS_PER_EPOCH = 22  # examples/train.py: 1440 digits, global batch 64


def runs_in(log, job):
    """The (run id, restart count) of every start of ``job`` in its log, from train.sh's header lines."""
    return re.findall(rf"^hpcddp: ===== run (\S+), job {job} restart (\d+), ", log, flags=re.M)


def clean(env, **extra):
    """``env`` without a run or resume setting of the test's own, plus ``extra``."""
    return {**{k: v for k, v in env.items() if k not in ("HPCDDP_RUN_ID", "HPCDDP_RESUME")}, **extra}


def step_and_run(checkpoint):
    state = torch.load(checkpoint, weights_only=True)
    return state["step"], state["run_id"]


def slurm_comment(job, env):
    """The job's Comment as Slurm holds it (scontrol's multi-line form keeps its spaces)."""
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, env=env)
    assert shown.returncode == 0, shown.stderr
    comment = re.search(r"^ *Comment=(.*) $", shown.stdout, flags=re.M)
    return comment.group(1) if comment else None


def assert_trained_from_scratch_then_resumed_its_own_run(log, tmp_path, run):
    """No resume before the USR1 stop, then one resume from the step it stopped at, to the end of ``run``."""
    stopped = re.search(r"^stopped at step (\d+)$", log, flags=re.M)
    assert stopped and "resumed from" not in log[: stopped.start()], log[-5000:]
    resumed = re.findall(r"^resumed from step (\d+) ", log, flags=re.M)
    assert resumed == [stopped.group(1)] and 4 <= int(stopped.group(1)) < 2 * STEPS_PER_EPOCH, log[-5000:]
    assert json.loads((tmp_path / "new.json").read_text())["step"] == 2 * STEPS_PER_EPOCH
    checkpoint = tmp_path / "checkpoints" / run / "checkpoint-000044.pt"
    assert step_and_run(checkpoint) == (2 * STEPS_PER_EPOCH, run)


@pytest.fixture(scope="module")
def old_run(slurm_cluster, tmp_path_factory):
    """A finished run of 2 epochs (its id and directory), as an old job leaves it behind."""
    tmp_path = tmp_path_factory.mktemp("old")
    env = clean(one_node_environment())  # as slurm_env
    old, rc, output = submit(env, tmp_path, "srun", "--epochs", "2", name="old", checkpoints=False)
    assert rc == 0, output.read_text()[-5000:]
    ((run, _),) = runs_in(output.read_text(), old)
    assert step_and_run(tmp_path / "checkpoints" / run / "checkpoint-000044.pt") == (2 * STEPS_PER_EPOCH, run)
    return run, tmp_path / "checkpoints" / run


def submit_new_job_under_an_old_jobs_files(env, tmp_path, old_run):
    """Submit the job of the first test below, held, give it the old job's files, release it."""
    checkpoints = tmp_path / "checkpoints"
    old_run, old_dir = old_run
    # Slurm 22.05's sbatch cannot choose a job number (no --jobid), so the new job is held
    # while the old job's files are given its number, as a rebuilt controller would leave
    # them: train.sh's pointer naming the old run, and the per-job-number directory that
    # train.sh used before runs (which the new job resumed from, training nothing).
    args = ["--epochs", "2", "--slow", "0.05", "--checkpoint-every", "4", "--json", str(tmp_path / "new.json")]
    job, _, output = submit(
        env, tmp_path, "srun", *args, wait=False, timeout=60, sbatch_args=["--hold"], name="new", checkpoints=False
    )
    try:
        shutil.copytree(old_dir, checkpoints / old_run)
        (checkpoints / f".hpcddp-job-{job}").write_text(f"{old_run}\n")
        shutil.copytree(old_dir, checkpoints / job)
    finally:
        subprocess.run(["scontrol", "release", job], check=True, timeout=30, env=env)
    return job, output


def submit_job_requeued_before_train_sh_under_an_old_jobs_files(env, tmp_path, old_run):
    """Submit the job of the second test below, held, give it the old job's files, release it."""
    checkpoints = tmp_path / "checkpoints"
    old_run, old_dir = old_run
    # A node lost in the prolog: Slurm requeues the job before its batch script ran, so
    # train.sh's first start already counts restart 1. The wrapper has train.sh's #SBATCH
    # lines and requeues itself at its first start, before it runs train.sh.
    with open(TRAIN_SH) as script:
        directives = "".join(line for line in script if line.startswith("#SBATCH"))
    wrapper = tmp_path / "requeued_before_train_sh.sh"
    wrapper.write_text(
        f"#!/usr/bin/env bash\n{directives}set -euo pipefail\n"
        'if ((${SLURM_RESTART_COUNT:-0} == 0)); then\n    scontrol requeue "$SLURM_JOB_ID"\n    sleep 300\nfi\n'
        f'exec {shlex.quote(TRAIN_SH)} "$@"\n'
    )
    args = ["--epochs", "2", "--slow", "0.05", "--checkpoint-every", "4", "--json", str(tmp_path / "new.json")]
    job, _, output = submit(
        env,
        tmp_path,
        "srun",
        *args,
        wait=False,
        timeout=60,
        sbatch_args=["--hold", "--comment=user-note"],
        name="new",
        checkpoints=False,
        batch=str(wrapper),
    )
    try:  # the old job's run and its pointer, under the new job's number
        shutil.copytree(old_dir, checkpoints / old_run)
        (checkpoints / f".hpcddp-job-{job}").write_text(f"{old_run}\n")
    finally:
        subprocess.run(["scontrol", "release", job], check=True, timeout=30, env=env)
    return job, output


@pytest.fixture(scope="module")
def reused_number_jobs(old_run, tmp_path_factory):
    """The jobs of the two tests below, run at the same time: (its directory, job, preempt_and_wait's result or error).

    Each is preempted once and requeued, about 50 s mostly spent waiting for Slurm; two 2-task
    jobs fit the cluster's 8 CPUs together. Each test asserts on its own job only.
    """
    env = clean(one_node_environment())  # as slurm_env
    scenarios = {
        "reused_number": submit_new_job_under_an_old_jobs_files,
        "requeued_before_train_sh": submit_job_requeued_before_train_sh_under_an_old_jobs_files,
    }
    jobs = {}
    try:
        for name, submit_held in scenarios.items():
            tmp_path = tmp_path_factory.mktemp(name)
            job, output = submit_held(env, tmp_path, old_run)
            jobs[name] = (tmp_path, job, output, f"{job}-*/checkpoint-000004.pt")
        outcomes = preempt_together(env, jobs)
    finally:
        for _, job, _, _ in jobs.values():
            subprocess.run(["scancel", job], timeout=30, env=env)
    return {name: (tmp_path, job, outcomes[name]) for name, (tmp_path, job, _, _) in jobs.items()}


def test_a_job_whose_number_an_old_job_had_trains_from_scratch_and_resumes_its_own_run_after_a_requeue(
    reused_number_jobs, old_run
):
    # The job: submit_new_job_under_an_old_jobs_files, run beside the next test's.
    tmp_path, job, result = reused_number_jobs["reused_number"]
    last, states, log = outcome(result)
    checkpoints = tmp_path / "checkpoints"
    old_run, old_dir = old_run

    assert last.get("JobState") == "COMPLETED" and int(last.get("Restarts", 0)) >= 1, f"{last} {states}\n{log[-5000:]}"
    (run, restarts), *requeued = runs_in(log, job)
    assert run.startswith(f"{job}-") and run != old_run and restarts == "0", log[-5000:]
    assert requeued and all(start == (run, str(i + 1)) for i, start in enumerate(requeued)), log[-5000:]
    assert_trained_from_scratch_then_resumed_its_own_run(log, tmp_path, run)
    assert (checkpoints / f".hpcddp-job-{job}").read_text() == f"{run}\n"
    # scontrol_job splits `scontrol show job -o` at spaces: Slurm's record of the job names the run.
    assert last.get("Comment") == f"hpcddp-run={run}", last


def test_a_reused_job_number_requeued_before_train_sh_ran_starts_a_new_run_that_its_own_requeue_resumes(
    reused_number_jobs, old_run
):
    # The job: submit_job_requeued_before_train_sh_under_an_old_jobs_files, run beside the previous test's.
    tmp_path, job, result = reused_number_jobs["requeued_before_train_sh"]
    last, states, log = outcome(result)
    checkpoints = tmp_path / "checkpoints"
    old_run, old_dir = old_run

    assert last.get("JobState") == "COMPLETED" and int(last.get("Restarts", 0)) >= 2, f"{last} {states}\n{log[-5000:]}"
    (run, restarts), *requeued = runs_in(log, job)
    assert run.startswith(f"{job}-") and run != old_run and restarts == "1", log[-5000:]
    why = f"hpcddp: restart 1 of job {job}, but its Slurm record has no hpcddp-run= in Comment (a reused job number"
    why += f", or requeued before this script first ran): starting a new run, not run {old_run} that"
    assert why in log, log[-5000:]
    # hpcddp's own `scontrol requeue` (after USR1): the same record, so the same run, resumed.
    assert requeued and all(start == (run, str(i + 2)) for i, start in enumerate(requeued)), log[-5000:]
    assert_trained_from_scratch_then_resumed_its_own_run(log, tmp_path, run)
    assert sorted(p.name for p in (checkpoints / old_run).iterdir()) == sorted(p.name for p in old_dir.iterdir())
    # The user's comment is kept; scontrol_job splits `scontrol show job -o` at spaces.
    assert last.get("Comment") == "user-note" and last.get("hpcddp-run") == run, last


def test_train_sh_by_hand_under_a_job_record_without_a_run_marks_a_new_run_in_it_and_a_restart_resumes_it(
    slurm_env, tmp_path
):
    # The reviewer's way of reusing a number, cheaply: train.sh run by hand as restart 1 of a
    # real (held) job whose record has the user's comment but no run, beside an old pointer.
    # SLURM_CONF stays: it names the test cluster (a job's own SLURM_* settings are what is dropped).
    env = {k: v for k, v in clean(slurm_env).items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    held = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--comment=note from  user", "--output=/dev/null", "--wrap", "sleep 1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=tmp_path,
    )
    job = held.stdout.strip().split(";")[0]
    assert held.returncode == 0 and job.isdigit(), held.stderr
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nprint("probe sees run", os.environ["HPCDDP_RUN_ID"])\n')

    def start(restarts):
        run_env = {**env, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "1"}
        result = subprocess.run(
            ["bash", TRAIN_SH, str(probe)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**run_env, "LAUNCHER": "mpirun", "PYTHON": sys.executable},
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        (run, _), *_ = runs_in(result.stdout, job)
        assert f"probe sees run {run}" in result.stdout, result.stdout
        return run, result.stderr

    try:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / f".hpcddp-job-{job}").write_text("old-run\n")
        run, stderr = start(1)
        assert run.startswith(f"{job}-") and "not run old-run that" in stderr, stderr
        assert slurm_comment(job, env) == f"note from  user hpcddp-run={run}"
        assert (tmp_path / "checkpoints" / f".hpcddp-job-{job}").read_text() == f"{run}\n"
        assert start(2) == (run, "")  # a requeue: the record names the run
    finally:
        subprocess.run(["scancel", job], timeout=30, env=env)


def test_a_new_job_given_an_old_runs_checkpoint_dir_stops_unless_it_asks_to_continue_that_run(slurm_env, tmp_path):
    # HPCDDP_CHECKPOINT_DIR exported in the submitting shell reaches every later job.
    env = clean(slurm_env)
    first, rc, output = submit(env, tmp_path, "mpirun", "--epochs", "1", name="first")
    assert rc == 0, output.read_text()[-5000:]
    ((run, _),) = runs_in(output.read_text(), first)

    second, rc, output = submit(env, tmp_path, "mpirun", "--epochs", "2", name="second")
    log = output.read_text()
    assert rc != 0, log[-5000:]
    ((new_run, _),) = runs_in(log, second)
    refusal = (
        f"cannot resume from {tmp_path / 'checkpoints'}: the checkpoint of step {STEPS_PER_EPOCH} belongs to run "
        f"'{run}', this job is run '{new_run}': a run resumes only its own checkpoints"
    )
    assert log.count(refusal) == 2, log[-5000:]  # each rank, one line
    assert "Traceback" not in log, log[-5000:]

    metrics = tmp_path / "third.json"
    env = {**env, "HPCDDP_RESUME": "any-run"}
    third, rc, output = submit(env, tmp_path, "mpirun", "--epochs", "2", "--json", str(metrics), name="third")
    log = output.read_text()
    assert rc == 0, log[-5000:]
    assert re.search(rf"^resumed from step {STEPS_PER_EPOCH} \(", log, flags=re.M), log[-5000:]
    assert json.loads(metrics.read_text())["step"] == 2 * STEPS_PER_EPOCH
    ((third_run, _),) = runs_in(log, third)
    assert step_and_run(tmp_path / "checkpoints" / "checkpoint-000044.pt") == (2 * STEPS_PER_EPOCH, third_run)
