"""hpcddp.init() in a plain process: a world of one with no communication."""

import pytest
import torch

import hpcddp


@pytest.fixture
def single(world_of_one):
    """Shorter name for the shared fixture in this file."""


def test_world_of_one(single):
    assert (hpcddp.rank(), hpcddp.size(), hpcddp.local_rank(), hpcddp.local_size(), hpcddp.node_rank()) == (
        0,
        1,
        0,
        1,
        0,
    )
    assert hpcddp.backend() == "local"
    assert hpcddp.device() == torch.device("cpu")
    t = torch.arange(4.0)
    assert torch.equal(hpcddp.allreduce(t), t)
    assert torch.equal(hpcddp.allgather(t), t)
    assert hpcddp.allgather_object("x") == ["x"]


def test_world_of_one_refuses_what_every_backend_refuses(single):
    with pytest.raises(TypeError, match="op='average' needs a floating-point tensor, got torch.int64: use op='sum'"):
        hpcddp.allreduce(torch.ones(2, dtype=torch.int64))


def test_world_of_one_exports_a_rendezvous_for_torch_distributed(single):
    import os

    import torch.distributed as dist

    assert os.environ["MASTER_ADDR"] and int(os.environ["MASTER_PORT"]) > 0
    dist.init_process_group("gloo", rank=0, world_size=1)  # reads MASTER_ADDR/MASTER_PORT
    try:
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_threads_follow_the_cpus_of_the_rank(single):
    import os

    if os.environ.get("OMP_NUM_THREADS"):
        pytest.skip("OMP_NUM_THREADS is set, so torch's thread count is the user's")
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))


def test_calls_before_init_say_what_to_do():
    hpcddp.shutdown()
    with pytest.raises(RuntimeError, match=r"call hpcddp.init\(\) first"):
        hpcddp.rank()


def test_bad_backend_names_the_choices():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'mpi', 'nccl', 'gloo', got 'tcp'"):
        hpcddp.init(backend="tcp")


def test_nccl_without_cuda_says_so(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        hpcddp.init(backend="nccl")


def test_gloo_in_a_single_process_works(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hpcddp.init(backend="gloo")
    try:
        assert hpcddp.backend() == "gloo"
        assert torch.equal(hpcddp.allreduce(torch.ones(3), op="sum"), torch.ones(3))
    finally:
        hpcddp.shutdown()
