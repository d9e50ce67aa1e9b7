"""Checkpoints belong to a run, not to a job number: slurm/train.sh on the one-node Slurm cluster.

Job numbers come again (a rebuilt controller), so a new job with an old job's number
must train from scratch, while a requeue of one job (same number, SLURM_RESTART_COUNT
>= 1) resumes its own run; a job handed another run's checkpoint directory stops unless
told to continue that run. Gated like test_slurm.py.
"""

import json
import re
import shutil
import subprocess

import torch

from . import test_slurm
from .cluster_jobs import preempt_and_wait, submit

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


def test_a_job_whose_number_an_old_job_had_trains_from_scratch_and_resumes_its_own_run_after_a_requeue(
    slurm_env, tmp_path
):
    env, checkpoints = clean(slurm_env), tmp_path / "checkpoints"
    old, rc, output = submit(env, tmp_path, "srun", "--epochs", "2", name="old", checkpoints=False)
    assert rc == 0, output.read_text()[-5000:]
    ((old_run, _),) = runs_in(output.read_text(), old)
    assert step_and_run(checkpoints / old_run / "checkpoint-000044.pt") == (2 * STEPS_PER_EPOCH, old_run)

    # Slurm 22.05's sbatch cannot choose a job number (no --jobid), so the new job is held
    # while the old job's files are given its number, as a rebuilt controller would leave
    # them: train.sh's pointer naming the old run, and the per-job-number directory that
    # train.sh used before runs (which the new job resumed from, training nothing).
    args = ["--epochs", "2", "--slow", "0.05", "--checkpoint-every", "4", "--json", str(tmp_path / "new.json")]
    job, _, output = submit(
        env, tmp_path, "srun", *args, wait=False, timeout=60, sbatch_args=["--hold"], name="new", checkpoints=False
    )
    try:
        (checkpoints / f".hpcddp-job-{job}").write_text(f"{old_run}\n")
        shutil.copytree(checkpoints / old_run, checkpoints / job)
    finally:
        subprocess.run(["scontrol", "release", job], check=True, timeout=30, env=env)
    last, states, log = preempt_and_wait(env, tmp_path, job, output, first_checkpoint=f"{job}-*/checkpoint-000004.pt")

    assert last.get("JobState") == "COMPLETED" and int(last.get("Restarts", 0)) >= 1, f"{last} {states}\n{log[-5000:]}"
    (run, restarts), *requeued = runs_in(log, job)
    assert run.startswith(f"{job}-") and run != old_run and restarts == "0", log[-5000:]
    assert requeued and all(start == (run, str(i + 1)) for i, start in enumerate(requeued)), log[-5000:]
    # From scratch first (no resume before the stop), then from its own step after the requeue.
    stopped = re.search(r"^stopped at step (\d+)$", log, flags=re.M)
    assert stopped and "resumed from" not in log[: stopped.start()], log[-5000:]
    resumed = re.findall(r"^resumed from step (\d+) ", log, flags=re.M)
    assert resumed == [stopped.group(1)] and 4 <= int(stopped.group(1)) < 2 * STEPS_PER_EPOCH, log[-5000:]
    assert json.loads((tmp_path / "new.json").read_text())["step"] == 2 * STEPS_PER_EPOCH
    assert step_and_run(checkpoints / run / "checkpoint-000044.pt") == (2 * STEPS_PER_EPOCH, run)
    assert (checkpoints / f".hpcddp-job-{job}").read_text() == f"{run}\n"


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
