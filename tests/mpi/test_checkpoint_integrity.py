"""Checkpoint integrity on every rank: all ranks skip a damaged file and load the same intact one;
an unwritable directory fails on every rank when the PreemptionHandler is entered."""

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
