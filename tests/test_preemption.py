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
from hpcddp.env.settings import read_stop_wait
from hpcddp.fault.stop_signals import STOP_SIGNALS, hold_stop_signals
from hpcddp.testing import run_command, run_mpi, run_script

from .conftest import ROOT

SCRIPT = f"{ROOT}/examples/train.py"
EPOCHS = 2  # 44 steps of 64 samples
NUM_STEPS = 44
# Dropout draws from each rank's own RNG: the resume is exact only if every rank's
# RNG state comes back with the checkpoint.
TRAIN_ARGS = ["--quiet", "--epochs", str(EPOCHS), "--dropout", "0.2"]


# ---- PreemptionHandler in one process -------------------------------------------------------


@pytest.mark.unit
def test_a_signal_only_sets_the_flag_until_should_stop_is_asked():
    with hpcddp.PreemptionHandler() as preemption:
        assert not preemption.should_stop()
        signal.raise_signal(signal.SIGUSR1)
        assert preemption.requested and preemption.received == signal.SIGUSR1
        assert preemption.should_stop() and preemption.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.unit
def test_check_every_asks_only_every_nth_call():
    with hpcddp.PreemptionHandler(check_every=3) as preemption:
        signal.raise_signal(signal.SIGTERM)
        assert [preemption.should_stop() for _ in range(4)] == [False, False, True, True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.unit
def test_requeue_outside_slurm_is_a_no_op(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert hpcddp.PreemptionHandler().requeue() is False


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_check_every_must_be_positive():
    with pytest.raises(ValueError, match="check_every must be an int >= 1, got 0"):
        hpcddp.PreemptionHandler(check_every=0)


# ---- a stop signal before the handler is entered ---------------------------------------------


@pytest.fixture
def default_stop_handlers():
    """The stop signals' handlers are the default ones before and after the test."""
    for signum in STOP_SIGNALS:
        assert signal.getsignal(signum) is signal.SIG_DFL
    yield
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


@pytest.mark.unit
def test_a_signal_held_before_the_handler_is_its_first_stop(default_stop_handlers):
    hold_stop_signals(60)
    signal.raise_signal(signal.SIGTERM)  # still here: held
    with hpcddp.PreemptionHandler() as preemption:
        assert preemption.received == signal.SIGTERM
        assert preemption.should_stop()
    # the first handler ends the holding: afterwards a stop signal does what its handler says
    assert [signal.getsignal(s) for s in STOP_SIGNALS] == [signal.SIG_DFL, signal.SIG_DFL]


@pytest.mark.unit
def test_nothing_is_held_without_a_signal_and_a_handler_of_the_script_stays(default_stop_handlers):
    def own(signum, frame):
        pass

    signal.signal(signal.SIGTERM, own)
    hold_stop_signals(60)
    assert signal.getsignal(signal.SIGTERM) is own
    assert getattr(signal.getsignal(signal.SIGUSR1), "holds_stop_signals", False)
    with hpcddp.PreemptionHandler() as preemption:
        assert not preemption.should_stop()
    assert signal.getsignal(signal.SIGTERM) is own and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.unit
def test_a_handler_installed_from_c_stays(default_stop_handlers):
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # the stack dump a stuck job is asked for; Python's table still says default
    try:
        hold_stop_signals(60)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # not replaced
        assert getattr(signal.getsignal(signal.SIGTERM), "holds_stop_signals", False)
    finally:
        faulthandler.unregister(signal.SIGUSR1)


@pytest.mark.unit
def test_a_child_forked_from_a_rank_gets_the_default_handlers(default_stop_handlers):
    hold_stop_signals(60)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        os.write(write, b"1" if all(signal.getsignal(s) is signal.SIG_DFL for s in STOP_SIGNALS) else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    os.close(read)


@pytest.mark.unit
def test_shutdown_ends_the_holding(world_of_one):
    assert getattr(signal.getsignal(signal.SIGUSR1), "holds_stop_signals", False)
    hpcddp.shutdown()
    assert [signal.getsignal(s) for s in STOP_SIGNALS] == [signal.SIG_DFL, signal.SIG_DFL]


@pytest.mark.unit
def test_stop_wait_setting():
    assert read_stop_wait({}) == 25.0
    assert read_stop_wait({"HPCDDP_STOP_WAIT": "0"}) == 0.0
    with pytest.raises(ValueError) as info:
        read_stop_wait({"HPCDDP_STOP_WAIT": "soon"})
    assert str(info.value) == (
        "environment variable HPCDDP_STOP_WAIT must be a number of seconds >= 0 (0 holds no signal), got 'soon'"
    )


# init(), then "loading data" while a stop signal reaches rank 1 only; then the loop's handler.
STOP_WHILE_LOADING = """
import os, signal, sys, time
import hpcddp
hpcddp.init()
if hpcddp.rank() == 1:
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(1)  # loading data, building the model
with hpcddp.PreemptionHandler() as preemption:
    first = preemption.should_stop()
    if first and hpcddp.rank() == 0:
        open(sys.argv[2], "w").write("saved")
    print("RESULT", hpcddp.rank(), first, preemption.received, flush=True)
hpcddp.shutdown()
"""


def results(output):
    return sorted(line.split()[1:] for line in output.splitlines() if line.startswith("RESULT "))


@pytest.mark.ranks
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_while_the_job_starts_stops_every_rank_at_its_first_check(tmp_path, name):
    script = tmp_path / "job.py"
    script.write_text(STOP_WHILE_LOADING)
    saved = tmp_path / "saved"
    result = run_mpi(2, [sys.executable, str(script), name, str(saved)], timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]  # was: rank 1 killed by the signal
    number = str(int(getattr(signal, name)))
    assert results(result.stdout) == [["0", "True", "0"], ["1", "True", number]], result.stdout[-5000:]
    assert saved.read_text() == "saved"
    assert f"hpcddp: {name} before any PreemptionHandler was entered: held for the next one" in result.stdout


@pytest.mark.ranks
def test_under_hpcddp_run_a_signal_is_held_from_interpreter_start(tmp_path):
    script = tmp_path / "job.py"
    # Before hpcddp (and torch) are even imported: only hpcddp run's sitecustomize has run.
    script.write_text(
        'import os, signal, sys\nif os.environ["RANK"] == "1":\n    os.kill(os.getpid(), signal.SIGUSR1)\n'
        + STOP_WHILE_LOADING.replace(
            "if hpcddp.rank() == 1:\n    os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n", ""
        )
    )
    saved = tmp_path / "saved"
    command = [sys.executable, "-m", "hpcddp.cli", "run", "-np", "2", str(script), "SIGUSR1", str(saved)]
    result = run_command(command, 180, cwd=ROOT)
    assert not result.timed_out and result.returncode == 0, result.stdout[-5000:]
    assert results(result.stdout) == [["0", "True", "0"], ["1", "True", str(int(signal.SIGUSR1))]], result.stdout
    assert saved.read_text() == "saved"


@pytest.mark.ranks
def test_a_script_without_a_handler_still_ends_on_sigterm(tmp_path):
    source = """
    import os, signal, sys, time
    import hpcddp
    hpcddp.init()
    start = time.monotonic()
    if hpcddp.rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    while time.monotonic() - start < 60:  # training, with no PreemptionHandler
        print("ALIVE", hpcddp.rank(), round(time.monotonic() - start, 2), flush=True)
        time.sleep(0.2)
    print("ENDED ON ITS OWN", flush=True)
    """
    began = time.monotonic()
    result = run_script(2, source, tmp_path, timeout=180, env={"HPCDDP_STOP_WAIT": "2"}, cwd=ROOT)
    took = time.monotonic() - began
    assert not result.timed_out, result.stdout[-5000:]
    assert result.returncode != 0 and "ENDED ON ITS OWN" not in result.stdout, result.stdout[-5000:]
    assert "exited on signal 15 (Terminated)" in " ".join(result.stdout.split()), result.stdout[-5000:]
    assert "hpcddp: no PreemptionHandler took SIGTERM within 2 s (HPCDDP_STOP_WAIT): ending as SIGTERM does" in (
        result.stdout
    )
    # held for the 2 s it may wait for a handler, then ended by it: well before the script's 60 s
    alive = [float(line.split()[2]) for line in result.stdout.splitlines() if line.startswith("ALIVE 1 ")]
    assert alive and 1.5 <= max(alive) < 10, alive
    assert took < 60, took


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


@pytest.mark.ranks
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


@pytest.mark.ranks
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    checkpoints = tmp_path / "ckpt"
    # One rank only: the other must learn of it through should_stop(), or it would wait forever.
    rc, output, metrics = run_and_signal(tmp_path, checkpoints, lambda mpirun: children(mpirun)[-1:], signal.SIGTERM)
    assert rc == 0, output[-5000:]
    assert metrics is not None and not metrics["completed"], output[-5000:]
    assert 4 <= metrics["step"] < NUM_STEPS, metrics
    assert (checkpoints / f"checkpoint-{metrics['step']:06d}.pt").exists()
    assert hpcddp.load_checkpoint(checkpoints)["step"] == metrics["step"]
