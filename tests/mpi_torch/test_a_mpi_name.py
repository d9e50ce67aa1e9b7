"""init_process_group("mpi") from the tutorials reaches hpcddp's backend (torch's wheels have no MPI). Runs first."""

import torch
import torch.distributed as dist

import hpcddp


def test_init_process_group_mpi_reaches_hpcddp():
    assert not dist.is_initialized()
    assert dist.is_mpi_available()
    dist.init_process_group(backend="mpi")
    try:
        assert dist.get_backend() == "mpi"
        assert (dist.get_rank(), dist.get_world_size()) == (hpcddp.rank(), hpcddp.size())
        tensor = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64)
        dist.all_reduce(tensor)
        n = dist.get_world_size()
        torch.testing.assert_close(tensor, torch.full((3,), n * (n + 1) / 2, dtype=torch.float64), rtol=0, atol=0)
        evens = list(range(0, n, 2))
        group = dist.new_group(evens, backend="mpi")
        if dist.get_rank() in evens:
            value = torch.ones(1)
            dist.all_reduce(value, group=group)
            assert value.item() == len(evens)
        else:
            assert group == dist.GroupMember.NON_GROUP_MEMBER
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_init_process_group_hpcddp_needs_no_store(monkeypatch):
    # No rendezvous: MASTER_ADDR/MASTER_PORT would only be read by a gloo/NCCL group made later.
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    dist.init_process_group("hpcddp")
    try:
        assert dist.get_backend() == "hpcddp"
        assert (dist.get_rank(), dist.get_world_size()) == (hpcddp.rank(), hpcddp.size())
        objects = [None] * dist.get_world_size()
        dist.all_gather_object(objects, ("rank", dist.get_rank()))
        assert objects == [("rank", r) for r in range(hpcddp.size())]
    finally:
        dist.destroy_process_group()
