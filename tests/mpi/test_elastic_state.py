"""hvd.elastic's state objects under mpirun: sync takes rank 0's state, every rank agrees on host updates.

References: rank 0's values as plain mpi4py broadcasts them, and each rank's own flags
gathered with mpi4py, never hpcddp's collectives.
"""

import copy

import pytest
import torch
from mpi4py import MPI

import hpcddp.horovod as hvd
from hpcddp.elastic.protocol import HostUpdate


def _rank_state():
    r = hvd.rank()
    torch.manual_seed(100 + r)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    sampler = hvd.elastic.ElasticSampler(list(range(40)), seed=1)
    sampler.record_batch(0, r + 1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=r, note=f"rank {r}")
    return state


def test_sync_gives_every_rank_rank_0s_model_optimizer_sampler_and_objects():
    state = _rank_state()
    comm = MPI.COMM_WORLD
    expected = comm.bcast(
        (
            {k: v.clone() for k, v in state.model.state_dict().items()},
            state.optimizer.state_dict(),
            state.sampler.state_dict(),
            (state.epoch, state.note),
        ),
        root=0,
    )
    state.sync()
    model_state, optimizer_state, sampler_state, objects = expected
    for name, value in state.model.state_dict().items():
        assert torch.equal(value, model_state[name]), name
    synced = state.optimizer.state_dict()
    assert synced["param_groups"][0]["lr"] == optimizer_state["param_groups"][0]["lr"]
    for key, slots in optimizer_state["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(synced["state"][key][slot]), torch.as_tensor(value)), (key, slot)
    assert state.sampler.state_dict() == sampler_state
    assert (state.epoch, state.note) == objects
    # The sampler re-sharded rank 0's position over every rank: together they cover what is left, once.
    shards = comm.allgather(list(state.sampler))
    left = comm.allgather(state.sampler.remaining_indices)
    assert left == [left[0]] * hvd.size() and len(left[0]) == 40 - sampler_state["processed_num"]
    assert set(sum(shards, [])) == set(left[0]) and len(shards[0]) * hvd.size() - len(left[0]) < hvd.size()


@pytest.mark.parametrize("told", ["rank 0", "another rank"])
def test_every_rank_raises_at_the_same_commit_when_rank_0_heard_of_new_hosts(told):
    comm = MPI.COMM_WORLD
    state = hvd.elastic.ObjectState(step=0)
    hears = hvd.rank() == (0 if told == "rank 0" else hvd.size() - 1)
    if hears:
        state.on_hosts_updated(123.0, HostUpdate.added)
    raised = []
    for _ in range(2):
        try:
            state.commit()
            raised.append(None)
        except hvd.HostsUpdatedInterrupt as interrupt:
            raised.append(interrupt.skip_sync)
    everyone = comm.allgather(raised)
    expected = [False, None] if told == "rank 0" else [None, None]
    assert everyone == [expected] * hvd.size()


def test_run_resets_in_process_and_every_rank_goes_on_from_the_same_commit():
    comm = MPI.COMM_WORLD
    state = hvd.elastic.ObjectState(step=0, total=0.0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        while state.step < 6:
            state.step += 1
            state.total += float(hvd.allreduce(torch.tensor([float(state.step)]), op=hvd.Sum))
            if state.step % 2 == 0:
                state.commit()
            if state.step == 5 and not resets:
                raise hvd.HorovodInternalError("a collective failed")
        return state.total

    total = train(state)
    n = hvd.size()
    # Steps 1-4 counted, 5 was undone (back to the commit at 4), then 5 and 6 again.
    assert total == n * sum(range(1, 7))
    assert resets == [n]
    assert comm.allgather(total) == [total] * n


def _local_and_averaged_grads(model, x):
    """This rank's gradient of ``model`` on ``x``, and its average over the ranks as mpi4py computes it."""
    reference = copy.deepcopy(model)
    reference(x).square().sum().backward()
    local = [p.grad.clone() for p in reference.parameters()]
    return [torch.from_numpy(MPI.COMM_WORLD.allreduce(g.numpy())) / hvd.size() for g in local]


@pytest.mark.parametrize("loop", ["zero_grad first", "backward first"])
@pytest.mark.parametrize(
    "options", [{}, {"compression": hvd.Compression.fp16}, {"op": hvd.Adasum}], ids=["average", "fp16", "adasum"]
)
def test_an_optimizer_kept_across_shutdown_and_init_reduces_over_the_new_communicator(loop, options):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **options
    )
    generator = torch.Generator().manual_seed(hvd.rank())
    for reset in (False, True, True):
        if reset:  # what hvd.elastic.run does after a HorovodInternalError, in the same processes
            hvd.shutdown()
            hvd.init()
        x = torch.randn(5, 4, generator=generator)
        if loop == "zero_grad first":
            optimizer.zero_grad()
        expected = [p.detach() - 0.1 * g for p, g in zip(model.parameters(), _local_and_averaged_grads(model, x))]
        model(x).square().sum().backward()
        optimizer.step()
        if loop == "backward first":
            optimizer.zero_grad()
        if "op" not in options:  # Adasum combines the ranks' steps otherwise; the ranks still agree
            tolerance = 1e-3 if options else 1e-6
            for p, e in zip(model.parameters(), expected):
                torch.testing.assert_close(p.detach(), e, atol=tolerance, rtol=tolerance)
        gathered = MPI.COMM_WORLD.allgather([p.detach().clone() for p in model.parameters()])
        for theirs in gathered:
            for p, q in zip(model.parameters(), theirs):
                assert torch.equal(p.detach(), q)
    optimizer.close()
