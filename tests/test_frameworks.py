"""PyTorch Lightning, accelerate and transformers.Trainer on hpcddp's "mpi" backend (docs/porting/frameworks.md).

Each job (tests/frameworks) trains a tiny model for 16 steps on 2 ranks under mpirun after
``hpcddp.init()``, and again under torchrun over gloo, the frameworks' usual launch, which
never imports hpcddp; every rank of both runs must end with the same parameters, bit for bit.
"""

import pytest
import torch

from . import framework_jobs as jobs

pytestmark = pytest.mark.ranks

# 64 samples over 2 ranks in batches of 4, for 2 epochs (tests/frameworks/_common.py).
NUM_STEPS = 64 // (2 * 4) * 2


def test_lightning_ddp_strategy_on_the_mpi_backend(tmp_path):
    jobs.require("lightning")
    mpi = jobs.run_on_mpi("lightning", tmp_path / "mpi")
    gloo = jobs.run_reference("lightning", tmp_path / "gloo")
    jobs.assert_same_training(mpi, gloo, NUM_STEPS)
    assert [(r["environment"], r["lightning_rank"]) for r in mpi] == [("MPIEnvironment", 0), ("MPIEnvironment", 1)]
    # Logged with sync_dist=True: an all_reduce with AVG of an int64 batch size on the way.
    assert {r["val_loss"] for r in mpi} == {r["val_loss"] for r in gloo} and len({r["val_loss"] for r in mpi}) == 1


def test_accelerate_training_loop_on_the_mpi_backend(tmp_path):
    jobs.require("accelerate")
    mpi = jobs.run_on_mpi("accelerate", tmp_path / "mpi")
    gloo = jobs.run_reference("accelerate", tmp_path / "gloo")
    jobs.assert_same_training(mpi, gloo, NUM_STEPS)
    assert [(r["accelerate_backend"], r["num_processes"]) for r in mpi] == [("mpi", 2)] * 2
    for info in mpi:
        # gather_for_metrics over uneven shards: the 10 predictions in order, the padding dropped.
        gathered, local = torch.tensor(info["gathered"]), torch.tensor(info["local"])
        assert gathered.shape == (10,)
        torch.testing.assert_close(gathered, local, rtol=1e-6, atol=1e-7)
        assert info["gathered"] == gloo[0]["gathered"]


def test_transformers_trainer_on_the_mpi_backend(tmp_path):
    jobs.require("transformers")
    mpi = jobs.run_on_mpi("trainer", tmp_path / "mpi")
    gloo = jobs.run_reference("trainer", tmp_path / "gloo")
    jobs.assert_same_training(mpi, gloo, NUM_STEPS)
    assert [r["eval_loss"] for r in mpi] == [gloo[0]["eval_loss"]] * 2
