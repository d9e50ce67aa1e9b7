"""hpcddp.checkpoint.store in one process: atomic writes, keep_last, newest-complete selection, exact RNG round trip."""

import errno
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import hpcddp
from hpcddp.checkpoint import check_checkpoint_dir, find_checkpoints

from .conftest import ROOT

pytestmark = pytest.mark.unit


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")


def small_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_names_the_file_by_step_and_loads_it_back(tmp_path):
    path = hpcddp.save_checkpoint(tmp_path / "ckpt", {"step": 123, "w": torch.arange(3)})
    assert path == tmp_path / "ckpt" / "checkpoint-000123.pt"
    state = hpcddp.load_checkpoint(tmp_path / "ckpt")
    assert state["step"] == 123 and torch.equal(state["w"], torch.arange(3))
    assert hpcddp.load_checkpoint(path)["step"] == 123


def test_an_exception_while_writing_leaves_no_file_behind(tmp_path):
    hpcddp.save_checkpoint(tmp_path, {"step": 1})
    with pytest.raises(RuntimeError, match="disk full"):
        # weights_only=False: by default the value would be refused before the write this test breaks
        hpcddp.save_checkpoint(tmp_path, {"step": 2, "bad": Unpicklable()}, weights_only=False)
    assert sorted(os.listdir(tmp_path)) == [".hpcddp-owner", "checkpoint-000001.pt"]  # the owner: this job
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 1


def test_keep_last_deletes_the_oldest(tmp_path):
    for step in (5, 10, 15, 20):
        hpcddp.save_checkpoint(tmp_path, {"step": step}, keep_last=2)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["checkpoint-000015.pt", "checkpoint-000020.pt"]


def test_newest_complete_checkpoint_wins_and_temporary_files_are_ignored(tmp_path):
    for step in (9, 100, 1000000):  # numeric order, also past the 6-digit padding
        hpcddp.save_checkpoint(tmp_path, {"step": step})
    # What a save killed mid-write leaves behind, and unrelated files.
    (tmp_path / ".checkpoint-2000000.pt.abc123.tmp").write_bytes(b"partial")
    (tmp_path / "checkpoint-latest.pt").write_bytes(b"not ours")
    (tmp_path / "checkpoint-3000000.pt").mkdir()
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 1000000


def test_missing_directory_or_no_checkpoint_gives_none(tmp_path):
    assert hpcddp.load_checkpoint(tmp_path / "nowhere") is None
    assert hpcddp.load_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hpcddp.load_checkpoint(tmp_path / "checkpoint-000001.pt")


@pytest.mark.parametrize("kwargs, message", [({"keep_last": 0}, "keep_last must be >= 1"), ({}, "step must be an int")])
def test_bad_arguments_name_the_knob(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hpcddp.save_checkpoint(tmp_path, {"no": "step"}, **kwargs)


def test_training_state_round_trip_restores_model_optimizer_position_and_rng(tmp_path):
    model, optimizer = small_model_and_optimizer()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    state = hpcddp.training_state(model, optimizer, epoch=2, batch_in_epoch=7, step=51, extra={"loss": torch.ones(2)})
    expected = (random.random(), np.random.standard_normal(3), torch.rand(3))
    hpcddp.save_checkpoint(tmp_path, state)

    fresh = torch.nn.Linear(4, 3)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    progress = hpcddp.restore_training_state(hpcddp.load_checkpoint(tmp_path), fresh, fresh_optimizer)

    assert (progress.epoch, progress.batch_in_epoch, progress.step) == (2, 7, 51)
    assert torch.equal(progress.extra["loss"], torch.ones(2))
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value)
    momentum = [s["momentum_buffer"] for s in optimizer.state.values()]
    restored = [s["momentum_buffer"] for s in fresh_optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, restored, strict=True))
    assert random.random() == expected[0]
    assert np.array_equal(np.random.standard_normal(3), expected[1])
    assert torch.equal(torch.rand(3), expected[2])


def test_restore_rejects_what_training_state_did_not_make():
    model, optimizer = small_model_and_optimizer()
    with pytest.raises(ValueError, match="must come from hpcddp.training_state"):
        hpcddp.restore_training_state({"model": model.state_dict()}, model, optimizer)


# ---- integrity: checksums, fallback to the newest intact checkpoint, a writable directory ------------


def save_two(tmp_path):
    for step in (1, 2):
        hpcddp.save_checkpoint(tmp_path, {"step": step, "w": torch.full((64,), float(step))})
    return find_checkpoints(tmp_path)


def flip_a_weight_byte(path, value):
    data = bytearray(path.read_bytes())
    at = data.index(torch.full((64,), value).numpy().tobytes())
    data[at + 3] ^= 0x7F  # the exponent byte of the first float
    path.write_bytes(bytes(data))


def test_flipped_byte_is_caught_and_the_previous_checkpoint_loaded(tmp_path, caplog):
    older, newest = save_two(tmp_path)
    flip_a_weight_byte(newest, 2.0)
    # What torch.load alone would hand back: a silently wrong weight.
    assert torch.load(newest, weights_only=True)["w"][0] != 2.0
    state = hpcddp.load_checkpoint(tmp_path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    assert f"skipping damaged checkpoint {newest}: its SHA-256 checksum does not match" in caplog.text
    with pytest.raises(ValueError, match=f"checkpoint {newest} is damaged: its SHA-256 checksum"):
        hpcddp.load_checkpoint(newest)


def test_truncated_checkpoint_is_skipped_naming_the_file(tmp_path, caplog):
    older, newest = save_two(tmp_path)
    newest.write_bytes(newest.read_bytes()[:-300])
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 1
    assert f"skipping damaged checkpoint {newest}" in caplog.text and "does not load" in caplog.text


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    for path in save_two(tmp_path):
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="every checkpoint in .* is damaged: checkpoint-000002.pt .*checkpoint-000001"):
        hpcddp.load_checkpoint(tmp_path)


def test_checkpoint_without_checksum_still_loads(tmp_path):
    torch.save({"step": 7}, tmp_path / "checkpoint-000007.pt")  # as hpcddp wrote them before checksums
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 7


def test_unwritable_checkpoint_directory_fails_when_the_handler_is_entered(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"checkpoint directory '.*file/ckpt' is not writable on rank 0 \(.*"):
        with hpcddp.PreemptionHandler(checkpoint_dir=tmp_path / "file" / "ckpt"):
            pass

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    with pytest.raises(ValueError, match=r"'.*ro' is not writable on rank 0 \(OSError: \[Errno 30\] Read-only"):
        hpcddp.checkpoint.check_checkpoint_dir(tmp_path / "ro")


def test_a_full_disk_names_the_checkpoint_and_keeps_the_older_one(tmp_path):
    full = tmp_path / "small-disk"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        hpcddp.save_checkpoint(full, {"step": 1, "w": torch.ones(1000)})
        with pytest.raises(OSError, match=r"No space left on device while writing checkpoint .*checkpoint-000002\.pt"):
            hpcddp.save_checkpoint(full, {"step": 2, "w": torch.ones(1_000_000)})
        assert hpcddp.load_checkpoint(full)["step"] == 1
        assert sorted(p.name for p in full.iterdir()) == [".hpcddp-owner", "checkpoint-000001.pt"]  # no temporary
    finally:
        subprocess.run(["umount", str(full)], check=False)


def test_a_directory_another_running_job_saves_into_is_refused_until_that_job_ends(tmp_path, caplog, monkeypatch):
    from hpcddp.checkpoint import owner as owner_module
    from hpcddp.checkpoint.owner import _start_time

    # Each refusal first waits out the grace an exiting owner gets (2 s): three of them made this test 6 s.
    monkeypatch.setattr(owner_module, "_EXIT_GRACE_S", 0.2)
    other = subprocess.Popen(["sleep", "60"])  # rank 0 of the other job
    try:
        owner = {
            "job": "mpi:other-job",
            "host": os.uname().nodename,
            "pid": other.pid,
            "started": _start_time(other.pid),
        }
        (tmp_path / ".hpcddp-owner").write_text(json.dumps(owner))
        expected = (
            rf"checkpoint directory '{tmp_path}' belongs to another job \(mpi:other-job, rank 0 on .*pid {other.pid}\)"
        )
        with pytest.raises(RuntimeError, match=expected):
            hpcddp.save_checkpoint(tmp_path, {"step": 2})
        hpcddp.save_checkpoint(tmp_path / "final.pt", {"step": 1})  # a named file claims nothing
        assert hpcddp.load_checkpoint(tmp_path) is None  # reading is allowed (with a warning)
        assert "which another job still writes" in caplog.text
        with pytest.raises(ValueError, match=expected):
            check_checkpoint_dir(tmp_path)
        assert find_checkpoints(tmp_path) == []  # nothing written by save_checkpoint(tmp_path)
    finally:
        other.kill()
        other.wait()
    hpcddp.save_checkpoint(tmp_path, {"step": 2})  # that job ended: this one takes the directory over
    assert hpcddp.load_checkpoint(tmp_path)["step"] == 2
    assert json.loads((tmp_path / ".hpcddp-owner").read_text())["pid"] == os.getpid()


# ---- what the default load cannot read, a full disk while claiming, another model's checkpoint ----------


def test_a_value_the_default_load_cannot_read_is_refused_before_anything_is_written(tmp_path):
    model, optimizer = small_model_and_optimizer()
    extra = {"best": np.float64(0.25), "history": {"loss": [1.0, np.float32(2.0)]}}
    state = hpcddp.training_state(model, optimizer, epoch=0, batch_in_epoch=0, step=4, extra=extra)
    with pytest.raises(TypeError, match=r"^extra\.best is a numpy\.float64, which load_checkpoint"):
        hpcddp.save_checkpoint(tmp_path / "ckpt", state)
    assert not (tmp_path / "ckpt").exists()  # not even the directory or its owner file
    state["extra"]["best"] = float(state["extra"]["best"])
    with pytest.raises(TypeError, match=r"^extra\.history\.loss\[1\] is a numpy\.float32.*\.item\(\)"):
        hpcddp.save_checkpoint(tmp_path / "ckpt", state)
    state["extra"]["history"]["loss"][1] = 2.0
    hpcddp.save_checkpoint(tmp_path / "ckpt", state)
    assert hpcddp.load_checkpoint(tmp_path / "ckpt")["extra"] == {"best": 0.25, "history": {"loss": [1.0, 2.0]}}


def test_arbitrary_objects_are_saved_when_asked_and_load_with_weights_only_false(tmp_path):
    state = {"step": 3, "when": np.datetime64("2025-01-01"), "ok": {1: (b"x", None, torch.Size([2]), {3.5j})}}
    hpcddp.save_checkpoint(tmp_path, state, weights_only=False)
    assert hpcddp.load_checkpoint(tmp_path, weights_only=False)["when"] == state["when"]
    del state["when"]
    hpcddp.save_checkpoint(tmp_path, state)  # bytes, None, complex, sets, torch.Size: the default load reads them
    assert hpcddp.load_checkpoint(tmp_path)["ok"] == state["ok"]


class FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def __getattr__(self, name):
        return getattr(self.fh, name)


def test_a_full_disk_while_claiming_a_directory_names_it_and_leaves_no_owner_file(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *args, **kwargs: FullDisk(fdopen(fd, *args, **kwargs)))
    full = rf"^\[Errno 28\] No space left on device while claiming checkpoint directory '{directory}' .*: free space"
    with pytest.raises(OSError, match=full):
        hpcddp.save_checkpoint(directory, {"step": 1})
    assert os.listdir(directory) == []  # no empty owner file, no temporary file
    with pytest.raises(ValueError, match=full.replace(r"^\[Errno 28\] ", "")):
        check_checkpoint_dir(directory)
    assert os.listdir(directory) == []
    monkeypatch.undo()
    hpcddp.save_checkpoint(directory, {"step": 1})
    assert json.loads((directory / ".hpcddp-owner").read_text())["pid"] == os.getpid()


def two_layers(out_features):
    torch.manual_seed(out_features)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, out_features))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def snapshot(model, optimizer):
    return [t.clone() for t in model.state_dict().values()], [
        s["momentum_buffer"].clone() for s in optimizer.state.values()
    ]


def assert_unchanged(model, optimizer, before):
    after = snapshot(model, optimizer)
    for a, b in zip(after[0] + after[1], before[0] + before[1], strict=True):
        assert torch.equal(a, b)


def test_another_models_checkpoint_is_refused_before_the_model_or_optimizer_changes():
    other, other_optimizer = two_layers(3)
    state = hpcddp.training_state(other, other_optimizer, epoch=0, batch_in_epoch=0, step=1)
    model, optimizer = two_layers(2)
    before = snapshot(model, optimizer)
    expected = (
        r"^the checkpoint's model does not fit this model \(2\.weight: shape \[3, 8\] in the checkpoint, \[2, 8\] "
        r"here; 2\.bias: shape \[3\] in the checkpoint, \[2\] here\): .*nothing was restored"
    )
    with pytest.raises(ValueError, match=expected):
        hpcddp.restore_training_state(state, model, optimizer)
    assert_unchanged(model, optimizer, before)  # the first layer fits, and was not loaded either

    same, _ = two_layers(2)
    first_layer_only = torch.optim.SGD(same[0].parameters(), lr=0.1)
    state = hpcddp.training_state(same, first_layer_only, epoch=0, batch_in_epoch=0, step=1)
    expected = r"^the checkpoint's optimizer does not fit this optimizer \(parameter group 0 holds 2 parameter\(s\)"
    with pytest.raises(ValueError, match=expected):
        hpcddp.restore_training_state(state, model, optimizer)
    assert_unchanged(model, optimizer, before)

    del state["model"]["2.bias"]
    state["model"]["3.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"\(2\.bias: missing from the checkpoint; 3\.weight: not in this model\)"):
        hpcddp.restore_training_state(state, model, optimizer)
    assert_unchanged(model, optimizer, before)


# A job in a process of its own: the directories are cleaned up when it exits.
CHECK_SAVE_AND_EXIT = """
import sys
from pathlib import Path

import hpcddp
from hpcddp.checkpoint import check_checkpoint_dir

root = Path(sys.argv[1])
with hpcddp.PreemptionHandler(checkpoint_dir=root / "fresh" / "checkpoints" / "run-a"):
    pass  # a job stopped before its first save
check_checkpoint_dir(root / "checkpoints" / "run-b")
hpcddp.save_checkpoint(root / "checkpoints" / "run-b", {"step": 1})
check_checkpoint_dir(root / "checkpoints" / "run-c")
check_checkpoint_dir(root / "existing")
"""


def test_a_job_that_saved_nothing_leaves_no_empty_checkpoint_directory(tmp_path):
    (tmp_path / "existing").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", CHECK_SAVE_AND_EXIT, str(tmp_path)], env=env, check=True, timeout=120)
    # The directories made for run-a, its parents too, are gone; run-c's, beside a saved run, too.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "existing"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["run-b"]
    assert [p.name for p in find_checkpoints(tmp_path / "checkpoints" / "run-b")] == ["checkpoint-000001.pt"]
    assert not (tmp_path / "checkpoints" / "run-b" / ".hpcddp-owner").exists()
    assert os.listdir(tmp_path / "existing") == []  # empty, but not made by the job: kept
