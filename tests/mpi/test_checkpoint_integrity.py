"""Checkpoint integrity on every rank: all ranks skip a damaged file and load the same intact one,
which rank 0 reads once for the job; an unwritable directory fails on every rank when the
PreemptionHandler is entered."""

from pathlib import Path

import pytest
import torch

import hpcddp


def shared_dir(tmp_path):
    return Path(hpcddp.broadcast_object(str(tmp_path), root_rank=0))


def test_every_rank_skips_the_damaged_newest_and_loads_the_same_older_one(tmp_path, caplog):
    directory = shared_dir(tmp_path)
    for step in (1, 2):
        hpcddp.save_checkpoint(directory, {"step": step, "w": torch.full((8,), float(step))})
    newest = directory / "checkpoint-000002.pt"
    if hpcddp.rank() == 0:
        newest.write_bytes(newest.read_bytes()[:-100])  # torn
    hpcddp.barrier()
    state = hpcddp.load_checkpoint(directory)
    assert hpcddp.allgather_object(state["step"]) == [1] * hpcddp.size()
    assert f"skipping damaged checkpoint {newest}" in caplog.text


def test_unwritable_directory_fails_on_every_rank_at_start(tmp_path):
    base = shared_dir(tmp_path)
    if hpcddp.rank() == 0:
        (base / "file").write_text("")  # a directory cannot be made below a file, not even by root
    hpcddp.barrier()
    with pytest.raises(ValueError, match="checkpoint directory .* is not writable on rank 0"):
        with hpcddp.PreemptionHandler(checkpoint_dir=base / "file" / "ckpt"):
            pass


def node_views(tmp_path, steps, torn=True):
    """One directory per rank, as each node would see a shared one: rank 1's newest file is torn."""
    directory = tmp_path / f"view-of-rank-{hpcddp.rank()}"
    directory.mkdir()
    for step in steps:
        torch.save({"step": step}, directory / "plain.pt")  # not a checkpoint name: ignored
        from hpcddp.checkpoint.store import _write_atomically

        _write_atomically(directory / f"checkpoint-{step:06d}.pt", {"step": step, "w": torch.full((4,), float(step))})
    if torn and hpcddp.rank() == 1:
        newest = directory / f"checkpoint-{max(steps):06d}.pt"
        newest.write_bytes(newest.read_bytes()[:-50])
    return directory


def test_every_rank_resumes_from_what_rank_0_reads_whatever_the_others_see(tmp_path):
    state = hpcddp.load_checkpoint(node_views(tmp_path, [3, 7]))  # rank 1's newest is torn, rank 0's intact
    assert hpcddp.allgather_object(state["step"]) == [7] * hpcddp.size()
    torch.testing.assert_close(state["w"], torch.full((4,), 7.0), rtol=0, atol=0)


def test_ranks_on_nodes_that_cannot_see_the_directory_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tmp_path differs per rank: "ckpt" is rank 0's directory, unseen by the others
    hpcddp.save_checkpoint("ckpt", {"step": 5, "w": torch.arange(6.0)})
    assert Path("ckpt").is_dir() == (hpcddp.rank() == 0)
    state = hpcddp.load_checkpoint("ckpt", map_location="cpu")
    assert hpcddp.allgather_object(state["step"]) == [5] * hpcddp.size()
    torch.testing.assert_close(state["w"], torch.arange(6.0), rtol=0, atol=0)


def test_rank_0s_listing_decides_the_step(tmp_path):
    steps = [10, 20] if hpcddp.rank() == 0 else [10, 15]  # e.g. a stale directory listing on one node
    state = hpcddp.load_checkpoint(node_views(tmp_path, steps, torn=False))
    assert hpcddp.allgather_object(state["step"]) == [20] * hpcddp.size()


def _read_bytes() -> int:
    """Bytes this process passed through read() and its kin so far (Linux's rchar)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def test_the_checkpoint_is_read_once_per_job(tmp_path):
    directory = shared_dir(tmp_path) / "once"
    hpcddp.save_checkpoint(directory, {"step": 1, "w": torch.zeros(16)})
    hpcddp.load_checkpoint(directory)  # whatever a first load imports is read here, not below
    hpcddp.save_checkpoint(directory, {"step": 2, "w": torch.arange(2_000_000, dtype=torch.float32)})
    size = (directory / "checkpoint-000002.pt").stat().st_size
    hpcddp.barrier()
    before = _read_bytes()
    state = hpcddp.load_checkpoint(directory)
    read = hpcddp.allgather_object(_read_bytes() - before)
    torch.testing.assert_close(state["w"], torch.arange(2_000_000, dtype=torch.float32), rtol=0, atol=0)
    # Each rank read it twice before (checksum, then torch.load): 2x per rank.
    assert sum(read) <= 1.2 * size, f"ranks read {read} bytes of a {size}-byte checkpoint"


def test_a_link_planted_at_the_run_marker_fails_on_every_rank(tmp_path, monkeypatch):
    directory = shared_dir(tmp_path) / "ckpt"
    secret = directory.parent / "secret"
    if hpcddp.rank() == 0:
        directory.mkdir()
        secret.write_text("the-secret-contents")
        (directory / ".hpcddp-run").symlink_to(secret)
    hpcddp.barrier()
    monkeypatch.setenv("HPCDDP_RUN_ID", "5-new")
    with pytest.raises(RuntimeError, match=r"\.hpcddp-run is a symbolic link, which hpcddp will not follow") as e:
        hpcddp.save_checkpoint(directory, {"step": 1})
    assert "the-secret-contents" not in str(e.value) and secret.read_text() == "the-secret-contents"


def test_rng_streams_are_gathered_to_the_writer_only_and_every_rank_resumes_its_own(tmp_path):
    torch.manual_seed(100 + hpcddp.rank())
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own = torch.get_rng_state()
    state = hpcddp.training_state(model, optimizer, epoch=0, batch_in_epoch=0, step=3)
    everyone = hpcddp.allgather_object(own)  # the reference: plain allgather of each rank's stream
    others = [r for r in range(hpcddp.size()) if r != hpcddp.rank()]
    if hpcddp.rank() == 0:
        for r in range(hpcddp.size()):
            torch.testing.assert_close(state["rng"][r]["torch"], everyone[r], rtol=0, atol=0)
    else:
        assert [state["rng"][r] for r in others] == [None] * len(others)
    assert state["world_size"] == hpcddp.size()
    hpcddp.save_checkpoint(shared_dir(tmp_path), state)
    expected = torch.rand(3)  # what this rank draws next
    hpcddp.restore_training_state(hpcddp.load_checkpoint(shared_dir(tmp_path)), model, optimizer)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_an_old_file_without_checksum_that_only_another_rank_cannot_load_fails_on_every_rank(tmp_path):
    directory = shared_dir(tmp_path)
    hpcddp.save_checkpoint(directory, {"step": 1, "w": torch.ones(4)})
    if hpcddp.rank() == 0:  # written by torch.save, as before hpcddp had checksums
        torch.save({"step": 2, "w": torch.ones(1000)}, directory / "checkpoint-000002.pt")
    hpcddp.barrier()

    def map_location(storage, location):
        if hpcddp.rank() == 1 and storage.nbytes() > 1000:
            raise MemoryError("rank 1 is out of memory")
        return storage

    # Every rank holds rank 0's bytes: not damage to skip (resuming silently from step 1).
    expected = (
        r"checkpoint-000002.pt loads on rank 0, but rank 1 cannot load it \(MemoryError"
        if hpcddp.rank() != 1
        else "rank 1 is out of memory"
    )
    with pytest.raises((ValueError, MemoryError), match=expected):
        hpcddp.load_checkpoint(directory, map_location=map_location)


def test_a_directory_rank_0_cannot_list_fails_on_every_rank(tmp_path, monkeypatch):
    directory = shared_dir(tmp_path)
    hpcddp.save_checkpoint(directory, {"step": 1})
    if hpcddp.rank() == 0:

        def refused(self):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "iterdir", refused)
    with pytest.raises(PermissionError, match=r"rank 0 cannot list checkpoint directory .*Permission denied"):
        hpcddp.load_checkpoint(directory)


def test_a_directory_that_rank_0_lacks_and_another_rank_sees_fails_on_every_rank(tmp_path):
    # e.g. rank 0 on a node without the mount: starting from scratch would lose the run
    directory = node_views(tmp_path, [3], torn=False) if hpcddp.rank() == 1 else tmp_path / "not-mounted"
    with pytest.raises(ValueError, match=r"does not exist on rank 0 but does on rank 1: .* shared by every node"):
        hpcddp.load_checkpoint(directory)


def test_a_directory_missing_on_every_rank_is_a_fresh_start(tmp_path):
    assert hpcddp.allgather_object(hpcddp.load_checkpoint(tmp_path / "none")) == [None] * hpcddp.size()


@pytest.mark.parametrize("name", ["mine.pt", "mine"])
def test_a_checkpoint_file_that_only_rank_0_sees_loads_on_every_rank(tmp_path, name):
    path = node_views(tmp_path, [4], torn=False) / "checkpoint-000004.pt"
    if hpcddp.rank() == 0:
        path = path.rename(path.parent / name)
    else:
        path = tmp_path / "nowhere" / name  # another node: no such file
    state = hpcddp.load_checkpoint(path)
    assert hpcddp.allgather_object(state["step"]) == [4] * hpcddp.size()
    torch.testing.assert_close(state["w"], torch.full((4,), 4.0), rtol=0, atol=0)


def test_a_link_planted_at_a_checkpoint_name_is_skipped_on_every_rank(tmp_path, caplog):
    directory = shared_dir(tmp_path) / "ckpt"
    hpcddp.save_checkpoint(directory, {"step": 1, "w": torch.ones(2)})
    planted = directory / "checkpoint-000009.pt"
    if hpcddp.rank() == 0:
        torch.save({"step": 99, "w": torch.zeros(2)}, directory.parent / "elsewhere.pt")
        planted.symlink_to(directory.parent / "elsewhere.pt")
    hpcddp.barrier()
    state = hpcddp.load_checkpoint(directory)
    assert hpcddp.allgather_object(state["step"]) == [1] * hpcddp.size()
    assert f"skipping damaged checkpoint {planted}: it is a symbolic link" in caplog.text
