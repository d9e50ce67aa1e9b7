"""Checkpoints belong to a run and a number of ranks: another run's, or another size's, is refused unless asked for.

The fast tests run in one process (a checkpoint "saved by 2 ranks" is one whose per-rank RNG
list holds two streams, as training_state makes it on 2 ranks); the last one runs
examples/train.py on 1 process and then 2 real MPI ranks.
"""

import os
import subprocess
import sys

import pytest
import torch

import hpcddp
from hpcddp.testing import run_mpi

from .conftest import ROOT

SCRIPT = f"{ROOT}/examples/train.py"


def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def saved_state(tmp_path, monkeypatch, run_id):
    """Save a training state as run ``run_id`` (None: a job naming no run); return the loaded state and the model."""
    if run_id is None:
        monkeypatch.delenv("HPCDDP_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("HPCDDP_RUN_ID", run_id)
    model, optimizer = model_and_optimizer(0)
    hpcddp.save_checkpoint(tmp_path, hpcddp.training_state(model, optimizer, epoch=1, batch_in_epoch=2, step=7))
    return hpcddp.load_checkpoint(tmp_path), model


def assert_same_parameters(model, reference):
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.unit
def test_training_state_records_the_run_and_the_number_of_ranks(tmp_path, monkeypatch):
    state, _ = saved_state(tmp_path, monkeypatch, "1234-20250101T000000Z")
    assert (state["run_id"], state["world_size"], len(state["rng"])) == ("1234-20250101T000000Z", 1, 1)
    state, _ = saved_state(tmp_path / "no-run", monkeypatch, None)
    assert state["run_id"] is None


@pytest.mark.unit
def test_another_runs_checkpoint_is_refused_before_anything_is_loaded(tmp_path, monkeypatch):
    state, _ = saved_state(tmp_path, monkeypatch, "7-old")
    monkeypatch.setenv("HPCDDP_RUN_ID", "7-new")  # the same job number, a new job
    fresh, fresh_optimizer = model_and_optimizer(1)
    untouched, untouched_optimizer = model_and_optimizer(1)
    expected = (
        r"^the checkpoint of step 7 belongs to run '7-old', this job is run '7-new': a run resumes only its own "
        r"checkpoints .*set HPCDDP_RESUME=any-run \(resume='any-run'\) to continue run '7-old' on purpose$"
    )
    with pytest.raises(ValueError, match=expected):
        hpcddp.restore_training_state(state, fresh, fresh_optimizer)
    assert_same_parameters(fresh, untouched)
    momentum = untouched_optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)


@pytest.mark.unit
@pytest.mark.parametrize("how", ["argument", "HPCDDP_RESUME=any-run", "HPCDDP_RESUME=any"])
def test_another_run_resumes_when_asked(tmp_path, monkeypatch, how):
    state, saved_model = saved_state(tmp_path, monkeypatch, "7-old")
    monkeypatch.setenv("HPCDDP_RUN_ID", "7-new")
    if how != "argument":
        monkeypatch.setenv("HPCDDP_RESUME", how.split("=")[1])
    fresh, fresh_optimizer = model_and_optimizer(1)
    progress = hpcddp.restore_training_state(
        state, fresh, fresh_optimizer, resume="any-run" if how == "argument" else None
    )
    assert (progress.epoch, progress.batch_in_epoch, progress.step) == (1, 2, 7)
    assert_same_parameters(fresh, saved_model)


@pytest.mark.unit
@pytest.mark.parametrize("saver, loader", [(None, "7-new"), ("7-old", None), (None, None), ("7", "7")])
def test_a_run_resumes_its_own_and_unnamed_checkpoints_and_a_job_naming_no_run_resumes_any(
    tmp_path, monkeypatch, saver, loader
):
    state, saved_model = saved_state(tmp_path, monkeypatch, saver)
    if loader is None:  # plain mpirun with a directory the user chose: that directory is the user's run
        monkeypatch.delenv("HPCDDP_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("HPCDDP_RUN_ID", loader)
    fresh, fresh_optimizer = model_and_optimizer(1)
    assert hpcddp.restore_training_state(state, fresh, fresh_optimizer).step == 7
    assert_same_parameters(fresh, saved_model)


def two_rank_state(tmp_path, monkeypatch):
    """A state as 2 ranks save it (rank 1 with its own stream); return it and each rank's next torch.rand(3)."""
    state, _ = saved_state(tmp_path, monkeypatch, None)
    streams, draws = [], []
    for seed in (10, 11):
        torch.manual_seed(seed)
        streams.append(torch.get_rng_state())
        draws.append(torch.rand(3))
    state["world_size"] = 2
    state["rng"] = [dict(state["rng"][0], torch=stream) for stream in streams]
    return state, draws


@pytest.mark.unit
def test_another_number_of_ranks_is_refused(tmp_path, monkeypatch):
    state, _ = two_rank_state(tmp_path, monkeypatch)
    fresh, fresh_optimizer = model_and_optimizer(1)
    untouched, _ = model_and_optimizer(1)
    expected = (
        r"^the checkpoint of step 7 was saved by 2 rank\(s\), this job has 1: .*resume on 2 rank\(s\), or set "
        r"HPCDDP_RESUME=any-size \(resume='any-size'\) if the position does not depend on the number of ranks"
    )
    with pytest.raises(ValueError, match=expected):
        hpcddp.restore_training_state(state, fresh, fresh_optimizer)
    with pytest.raises(ValueError, match=expected):
        hpcddp.restore_training_state(state, fresh, fresh_optimizer, resume="any-run")
    assert_same_parameters(fresh, untouched)


@pytest.mark.unit
@pytest.mark.parametrize("rank, size", [(0, 1), (1, 3), (2, 3)])
def test_any_size_continues_the_saved_ranks_streams_and_new_ranks_keep_theirs(tmp_path, monkeypatch, rank, size):
    state, draws = two_rank_state(tmp_path, monkeypatch)
    monkeypatch.setattr("hpcddp.checkpoint.resume.rank_and_size", lambda: (rank, size))
    monkeypatch.setenv("HPCDDP_RESUME", "any-size")
    torch.manual_seed(99)  # what a rank the saving job did not have seeded itself
    own = torch.rand(3)
    torch.manual_seed(99)
    fresh, fresh_optimizer = model_and_optimizer(1)
    torch.manual_seed(99)
    hpcddp.restore_training_state(state, fresh, fresh_optimizer)
    assert torch.equal(torch.rand(3), draws[rank] if rank < 2 else own)


@pytest.mark.unit
def test_resume_must_name_a_known_policy(tmp_path, monkeypatch):
    state, _ = saved_state(tmp_path, monkeypatch, None)
    fresh, _ = model_and_optimizer(1)
    with pytest.raises(ValueError, match=r"^resume must be one of 'strict', 'any-run', 'any-size', 'any', got 'yes'$"):
        hpcddp.restore_training_state(state, fresh, resume="yes")
    monkeypatch.setenv("HPCDDP_RESUME", "force")
    with pytest.raises(ValueError, match=r"HPCDDP_RESUME must be one of strict, any-run, any-size, any, got 'force'"):
        hpcddp.restore_training_state(state, fresh)


# ---- examples/train.py: 1 rank saves, 2 ranks resume ------------------------------------------


@pytest.mark.ranks
def test_a_one_rank_checkpoint_stops_a_two_rank_job_unless_any_size_and_then_ends_as_one_rank_would(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    common = [SCRIPT, "--quiet", "--epochs", "1", "--dtype", "float64"]
    env = {k: v for k, v in os.environ.items() if k not in ("HPCDDP_RUN_ID", "HPCDDP_RESUME")}
    alone = [sys.executable, *common, "--checkpoint-dir", str(checkpoints), "--stop-after-steps", "5"]
    stopped = subprocess.run(alone, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert stopped.returncode == 0 and "stopped at step 5" in stopped.stderr, stopped.stderr[-5000:]

    two = [sys.executable, *common, "--checkpoint-dir", str(checkpoints)]
    refused = run_mpi(2, two, timeout=120, env=env, cwd=ROOT)
    assert refused.returncode != 0
    line = (
        f"cannot resume from {checkpoints}: the checkpoint of step 5 was saved by 1 rank(s), this job has 2: "
        "its RNG streams and its position in the data are per rank"
    )
    assert refused.stdout.count(line) == 2, refused.stdout[-5000:]  # every rank, one line each
    assert "Traceback" not in refused.stdout, refused.stdout[-5000:]

    final = tmp_path / "resumed.pt"
    resumed = run_mpi(2, [*two, "--save-final", str(final)], timeout=120, env={**env, "HPCDDP_RESUME": "any-size"})
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert "resumed from step 5 (epoch 0, batch 5 of 22)" in resumed.stdout, resumed.stdout[-5000:]

    # The position counts global batches, which DistributedSampler deals out alike at any size: the
    # resumed run ends where one process that was never stopped ends (float64: reduction order only).
    reference = tmp_path / "reference.pt"
    plain = subprocess.run(
        [sys.executable, *common, "--save-final", str(reference)], capture_output=True, timeout=120, env=env
    )
    assert plain.returncode == 0, plain.stderr[-5000:]
    expected, got = torch.load(reference), torch.load(final)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12)


@pytest.mark.unit
def test_a_run_does_not_save_over_another_runs_checkpoints(tmp_path, monkeypatch):
    saved_state(tmp_path, monkeypatch, "8-old")
    monkeypatch.setenv("HPCDDP_RUN_ID", "8-new")  # never restored: it would overwrite step 7 and delete the rest
    expected = (
        rf"^checkpoint directory '{tmp_path}' holds the checkpoints of run '8-old', this job is run '8-new': saving "
        r"there would overwrite and delete them \(keep_last\); give this run its own directory, or resume run "
        r"'8-old' on purpose \(HPCDDP_RESUME=any-run\) to continue it there$"
    )
    with pytest.raises(RuntimeError, match=expected):
        hpcddp.save_checkpoint(tmp_path, {"step": 7, "run_id": "8-new"}, keep_last=1)
    assert hpcddp.load_checkpoint(tmp_path)["run_id"] == "8-old"
    monkeypatch.setenv("HPCDDP_RESUME", "any-run")  # continuing run 8-old there on purpose
    hpcddp.save_checkpoint(tmp_path, {"step": 8, "run_id": "8-new"}, keep_last=1)
    assert hpcddp.load_checkpoint(tmp_path)["run_id"] == "8-new"
    monkeypatch.delenv("HPCDDP_RESUME")
    hpcddp.save_checkpoint(tmp_path, {"step": 9, "run_id": "8-new"})  # the directory is 8-new's now


@pytest.mark.unit
def test_a_job_naming_no_run_saves_where_it_is_told(tmp_path, monkeypatch):
    saved_state(tmp_path, monkeypatch, "9-old")
    monkeypatch.delenv("HPCDDP_RUN_ID")  # plain mpirun: the directory the user chose is the user's run
    hpcddp.save_checkpoint(tmp_path, {"step": 8}, keep_last=1)
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 8


@pytest.mark.unit
def test_resume_is_read_like_hpcddp_resume_whatever_its_case():
    from hpcddp.checkpoint.identity import resume_policy

    assert (resume_policy("Any-Run"), resume_policy(" ANY ")) == ("any-run", "any")
