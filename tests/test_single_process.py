"""hpcddp.init() in a plain process: a world of one with no communication."""

import sys
import threading
import time

import pytest
import torch

import hpcddp

pytestmark = pytest.mark.unit


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


def test_horovod_optimizer_is_a_fresh_instance_of_the_users_class(single):
    import hpcddp.horovod as hvd

    model = torch.nn.Linear(3, 1)
    base = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.ones(2, 3)).sum().backward()
    base.step()
    for op in (hvd.Average, hvd.Adasum):  # with one rank Adasum is Horovod's plain optimizer
        optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=op)
        assert isinstance(optimizer, torch.optim.Adam) and type(optimizer).__name__ == "Adam"
        assert optimizer.state_dict()["state"] == {} and optimizer.param_groups[0]["lr"] == 0.5
        optimizer.close()
    t = torch.tensor([1.0, -2.0])
    assert torch.equal(hvd.allreduce(t, op=hvd.Adasum), t)


def test_threads_naming_horovod_operations_per_step_at_once_all_get_their_results(single):
    # Two threads sweeping the table of names at once: one raised KeyError after its allreduce
    # had started (its handle lost; on a job, on one rank only: the ranks out of step).
    import hpcddp.horovod as hvd

    errors, results = [], []

    def steps(thread):
        try:
            for step in range(1000):
                handle = hvd.allreduce_async(torch.full((1,), float(thread)), name=f"t{thread}.{step}", op=hvd.Sum)
                results.append((thread, hvd.synchronize(handle).item()))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, as on a loaded node
    try:
        threads = [threading.Thread(target=steps, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert sorted(results) == [(t, float(t)) for t in range(4) for _ in range(1000)]


def test_a_name_another_thread_is_starting_is_refused(single, monkeypatch):
    # The name was taken only once the launch returned: two threads both started "same" (on a
    # job, two collectives under one name, which Horovod refuses; on gloo they aborted the job).
    import hpcddp.horovod as hvd
    from hpcddp.runtime.state import communicator

    comm = communicator()
    launch = comm.allreduce_async_

    def slow_launch(*args, **kwargs):
        time.sleep(0.2)  # gloo's agreement takes a round trip here
        return launch(*args, **kwargs)

    monkeypatch.setattr(comm, "allreduce_async_", slow_launch)
    outcomes = []

    def start():
        try:
            outcomes.append(hvd.allreduce_async(torch.ones(1), name="same"))
        except ValueError as err:
            outcomes.append(str(err))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    refused = [o for o in outcomes if isinstance(o, str)]
    assert len(refused) == 1 and "'same' is still in flight" in refused[0], outcomes
    for handle in outcomes:
        if not isinstance(handle, str):
            hvd.synchronize(handle)


def test_adasum_combines_in_horovods_pairs():
    from hpcddp.horovod.adasum import combine

    # Orthogonal rows add up; a zero row leaves its partner as it is; equal rows stay.
    eye = torch.eye(4, dtype=torch.float64) * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert combine(eye, torch.float64).tolist() == [1.0, 2.0, 3.0, 4.0]
    rows = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    assert combine(rows, torch.float32).tolist() == [3.0, 4.0]
    assert combine(torch.tensor([[2.0, 1.0]] * 4), torch.float32).tolist() == [2.0, 1.0]
    # [a, b] then [c, d]: a = (1, 0), b = (1, 0) give (1, 0); c = (0, 1), d = (0, 1) give (0, 1); then orthogonal.
    pairs = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    assert combine(pairs, torch.float64).tolist() == [1.0, 1.0]
