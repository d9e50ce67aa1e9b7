"""Preemption without Slurm: a signal mid-training, a checkpoint, a resume, the same final parameters bitwise."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hpcddp
from hpcddp.cli.launch import mpirun_command
from hpcddp.testing import run_mpi

from .conftest import ROOT

SCRIPT = f"{ROOT}/examples/train.py"
EPOCHS = 2  # 44 steps of 64 samples
NUM_STEPS = 44
# Dropout draws from each rank's own RNG: the resume is exact only if every rank's
# RNG state comes back with the checkpoint.
TRAIN_ARGS = ["--quiet", "--epochs", str(EPOCHS), "--dropout", "0.2"]


# ---- PreemptionHandler in one process -------------------------------------------------------


def test_a_signal_only_sets_the_flag_until_should_stop_is_asked():
    with hpcddp.PreemptionHandler() as preemption:
        assert not preemption.should_stop()
        signal.raise_signal(signal.SIGUSR1)
        assert preemption.requested and preemption.received == signal.SIGUSR1
        assert preemption.should_stop() and preemption.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_check_every_asks_only_every_nth_call():
    with hpcddp.PreemptionHandler(check_every=3) as preemption:
        signal.raise_signal(signal.SIGTERM)
        assert [preemption.should_stop() for _ in range(4)] == [False, False, True, True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_requeue_outside_slurm_is_a_no_op(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert hpcddp.PreemptionHandler().requeue() is False


def test_requeue_reports_a_failing_scontrol(monkeypatch, tmp_path, caplog):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho \'Requested operation is presently disabled\' >&2\nexit 1\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert hpcddp.PreemptionHandler().requeue() is False
    assert (tmp_path / "args").read_text().split() == ["requeue", "42"]
    assert "presently disabled" in caplog.text and "sbatch --requeue" in caplog.text


def test_requeue_is_not_tried_for_a_job_submitted_without_requeue(monkeypatch, tmp_path, caplog):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
        'if [ "$1" = show ]; then echo "JobId=42 JobName=x Requeue=0 Restarts=0"; fi\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert hpcddp.PreemptionHandler().requeue() is False
    assert (tmp_path / "calls").read_text().splitlines() == ["show job -o 42"]
    assert "without --requeue (Requeue=0)" in caplog.text


def test_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every must be an int >= 1, got 0"):
        hpcddp.PreemptionHandler(check_every=0)


# ---- examples/train.py on 2 MPI ranks --------------------------------------------------------


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def run_and_signal(tmp_path, checkpoints, signal_target, signum, timeout=300):
    """Start 2 ranks, wait for checkpoint-000004.pt, send ``signum``, return (rc, output, metrics)."""
    out = tmp_path / "stopped.json"
    args = [sys.executable, SCRIPT, *TRAIN_ARGS, "--json", str(out)]
    args += ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "4", "--slow", "0.1"]
    proc = subprocess.Popen(
        mpirun_command(2, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not (checkpoints / "checkpoint-000004.pt").exists():
            assert proc.poll() is None, proc.communicate()[0][-5000:]
            assert time.monotonic() < deadline, "no checkpoint at step 4 in time"
            time.sleep(0.05)
        for pid in signal_target(proc.pid):
            os.kill(pid, signum)
        output, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, output, json.loads(out.read_text()) if out.exists() else None


def uninterrupted_parameters(tmp_path):
    final = tmp_path / "uninterrupted.pt"
    result = run_mpi(
        2,
        [sys.executable, SCRIPT, *TRAIN_ARGS, "--save-final", str(final)],
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-5000:]
    return torch.load(final)


def test_sigusr1_to_mpirun_checkpoints_and_the_resumed_run_ends_bitwise_equal(tmp_path):
    checkpoints = tmp_path / "ckpt"
    rc, output, metrics = run_and_signal(tmp_path, checkpoints, lambda mpirun: [mpirun], signal.SIGUSR1)
    assert rc == 0, output[-5000:]
    assert metrics is not None and not metrics["completed"], output[-5000:]
    stopped = metrics["step"]
    assert 4 <= stopped < NUM_STEPS, metrics
    assert f"stopped at step {stopped}" in output and "after SIGUSR1" in output
    assert (checkpoints / f"checkpoint-{stopped:06d}.pt").exists()

    final = tmp_path / "resumed.pt"
    args = [sys.executable, SCRIPT, *TRAIN_ARGS, "--checkpoint-dir", str(checkpoints), "--save-final", str(final)]
    resumed = run_mpi(2, args, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"resumed from step {stopped} " in resumed.stdout
    expected = uninterrupted_parameters(tmp_path)
    got = torch.load(final)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name} differs after resuming from step {stopped}"
    # Resuming with a different batch size would train on other samples: refused in one line.
    other = run_mpi(2, [*args[:-2], "--batch-size", "32"], timeout=300, cwd=ROOT)
    assert other.returncode != 0
    assert "--batch-size 32 differs from the 64 the checkpoint" in other.stdout, other.stdout[-3000:]


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    checkpoints = tmp_path / "ckpt"
    # One rank only: the other must learn of it through should_stop(), or it would wait forever.
    rc, output, metrics = run_and_signal(tmp_path, checkpoints, lambda mpirun: children(mpirun)[-1:], signal.SIGTERM)
    assert rc == 0, output[-5000:]
    assert metrics is not None and not metrics["completed"], output[-5000:]
    assert 4 <= metrics["step"] < NUM_STEPS, metrics
    assert (checkpoints / f"checkpoint-{metrics['step']:06d}.pt").exists()
    assert hpcddp.load_checkpoint(checkpoints)["step"] == metrics["step"]
