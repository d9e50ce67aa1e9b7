"""Files hpcddp opens by a fixed name never follow a symbolic link planted there.

Whoever may write into a checkpoint directory (a group-shared project directory) could
otherwise make a job overwrite, or read and quote in its errors, any file that job can
reach: the run marker, the owner file, the status files of ``hpcddp run``, the elastic
commits. Each refuses the link in one line naming it, and leaves its target untouched.
"""

import errno
import json
import os
import re
import socket

import pytest
import torch

import hpcddp
from hpcddp.checkpoint import check_checkpoint_dir, find_checkpoints
from hpcddp.checkpoint.identity import RUN_FILE
from hpcddp.checkpoint.owner import OWNER_FILE
from hpcddp.elastic.commits import CommitStore
from hpcddp.fault.run_status import aborted_ranks, mark_aborted, mark_started, unfinished_ranks

pytestmark = pytest.mark.unit

SECRET = "the-secret-contents\n"


def refusal(path) -> str:
    return rf"^\[Errno {errno.ELOOP}\] {re.escape(str(path))} is a symbolic link, which hpcddp will not follow.*: remove it$"


@pytest.fixture
def secret(tmp_path):
    """A file the job can write, which a link planted by someone else points to."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return path


def plant(link, secret, kind):
    """A link to the secret, to a directory, or to nothing."""
    target = {"file": secret, "directory": secret.parent, "dangling": secret.parent / "nothing-here"}[kind]
    link.symlink_to(target)


@pytest.mark.parametrize("holds_checkpoints", [False, True])
@pytest.mark.parametrize("kind", ["file", "directory", "dangling"])
def test_a_link_at_the_run_marker_is_refused_and_its_target_neither_written_nor_quoted(
    tmp_path, secret, monkeypatch, kind, holds_checkpoints
):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if holds_checkpoints:
        monkeypatch.delenv("HPCDDP_RUN_ID", raising=False)
        hpcddp.save_checkpoint(directory, {"step": 1})
    plant(directory / RUN_FILE, secret, kind)
    monkeypatch.setenv("HPCDDP_RUN_ID", "5-new")
    with pytest.raises(OSError, match=refusal(directory / RUN_FILE)) as raised:
        hpcddp.save_checkpoint(directory, {"step": 2})
    assert "the-secret-contents" not in str(raised.value)
    assert secret.read_text() == SECRET
    assert [p.name for p in find_checkpoints(directory)] == (["checkpoint-000001.pt"] if holds_checkpoints else [])
    assert (directory / RUN_FILE).is_symlink()


@pytest.mark.parametrize("kind", ["file", "directory", "dangling"])
def test_a_link_at_the_owner_file_is_refused_and_its_target_neither_read_nor_replaced(tmp_path, caplog, kind):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"job": "the-secret-job", "host": "elsewhere", "pid": 1, "started": None}))
    plant(directory / OWNER_FILE, secret, kind)
    with pytest.raises(OSError, match=refusal(directory / OWNER_FILE)):
        hpcddp.save_checkpoint(directory, {"step": 2})
    with pytest.raises(ValueError, match=refusal(directory / OWNER_FILE)):
        check_checkpoint_dir(directory)
    assert "the-secret-job" not in caplog.text
    assert (directory / OWNER_FILE).is_symlink() and find_checkpoints(directory) == []
    assert hpcddp.load_checkpoint(directory) is None  # reading disturbs nobody: a warning only
    assert "symbolic link" in caplog.text and "the-secret-job" not in caplog.text


def test_a_run_marker_that_names_no_plausible_run_is_not_quoted(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    hpcddp.save_checkpoint(directory, {"step": 1})
    (directory / RUN_FILE).write_text("line one of something else\nline two\n")
    monkeypatch.setenv("HPCDDP_RUN_ID", "5-new")
    unnamed = r"holds the checkpoints of another run \(its \.hpcddp-run holds no run name\), this job is run '5-new'"
    with pytest.raises(RuntimeError, match=unnamed) as e:
        hpcddp.save_checkpoint(directory, {"step": 2})
    assert "line one" not in str(e.value)


def test_status_files_of_hpcddp_run_never_follow_a_link(tmp_path, secret):
    status = tmp_path / "status"
    status.mkdir()
    node = socket.gethostname()
    for name in (f"{node}.ranks", f"{node}.aborted"):
        (status / name).symlink_to(secret)
    mark_started(str(status), 0)  # refused: nothing is written through the link
    mark_aborted(str(status), 2, 7)
    assert secret.read_text() == SECRET
    assert unfinished_ranks(str(status)) == {} and aborted_ranks(str(status)) == {}  # a link's target is not read
    for name in (f"{node}.ranks", f"{node}.aborted"):
        (status / name).unlink()
    (status / "other.ranks").symlink_to(secret)
    (status / "other.aborted").symlink_to(secret)
    mark_started(str(status), 0)
    mark_aborted(str(status), 2, 7)
    assert not (status / f"{node}.ranks").is_symlink() and (status / f"{node}.aborted").read_text() == "2 7\n"
    assert unfinished_ranks(str(status)) == {0: node} and aborted_ranks(str(status)) == {2: 7}


def test_an_elastic_commit_that_is_a_link_is_refused(tmp_path):
    store = CommitStore("run", root=str(tmp_path / "shm"), host="h")
    store.write(1, {"w": torch.ones(2)})
    elsewhere = tmp_path / "elsewhere.pt"
    torch.save({"serial": 9, "snapshot": {"w": torch.zeros(2)}}, elsewhere)
    planted = os.path.join(store.directory, "commit-000000000009.pt")
    os.symlink(elsewhere, planted)
    with pytest.raises(OSError, match=refusal(planted)):
        store.read()
