"""hpcddp.horovod under mpirun: Horovod's API gives the results Horovod defines, computed by hpcddp."""

import pytest
import torch
import torch.nn.functional as F

import hpcddp
import hpcddp.horovod as hvd

from .test_failures_join import make_model, make_sgd, num_batches, rank_data
from .test_training_loops import assert_ranks_agree


def test_layout_matches_hpcddp():
    hvd.init()  # already initialised: a no-op, as in Horovod
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (hpcddp.rank(), hpcddp.size())
    assert (hvd.local_rank(), hvd.local_size()) == (hpcddp.local_rank(), hpcddp.local_size())
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)  # one host
    assert hvd.mpi_enabled() and hvd.mpi_threads_supported()


def test_allreduce_ops_scaling_and_compression():
    n, r = hvd.size(), hvd.rank()
    t = torch.full((5,), float(r + 1))
    mean = (n + 1) / 2
    torch.testing.assert_close(hvd.allreduce(t), torch.full((5,), mean))
    torch.testing.assert_close(hvd.allreduce(t, average=False), torch.full((5,), n * mean))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Sum), torch.full((5,), n * mean))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Max), torch.full((5,), float(n)))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Min), torch.full((5,), 1.0))
    scaled = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)
    torch.testing.assert_close(scaled, torch.full((5,), 6 * n * mean))
    assert torch.equal(t, torch.full((5,), float(r + 1))), "allreduce must leave its input alone"
    half = hvd.allreduce(t, compression=hvd.Compression.fp16)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, torch.full((5,), mean))
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(t, average=True, op=hvd.Sum)


def test_in_place_and_async_forms():
    n, r = hvd.size(), hvd.rank()
    t = torch.full((3,), float(r))
    out = hvd.allreduce_(t, op=hvd.Sum)
    assert out is t and torch.equal(t, torch.full((3,), float(sum(range(n)))))
    src = torch.full((2,), float(r))
    handle = hvd.allreduce_async(src, name="metric")
    result = hvd.synchronize(handle)
    assert hvd.poll(handle)
    torch.testing.assert_close(result, torch.full((2,), (n - 1) / 2))
    inplace = torch.full((2,), float(r))
    assert hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Max)) is inplace
    assert torch.equal(inplace, torch.full((2,), float(n - 1)))


def test_broadcast_allgather_and_objects():
    n, r = hvd.size(), hvd.rank()
    t = torch.full((4,), float(r))
    assert torch.equal(hvd.broadcast(t, root_rank=n - 1), torch.full((4,), float(n - 1)))
    assert torch.equal(t, torch.full((4,), float(r)))
    hvd.broadcast_(t, root_rank=0)
    assert torch.equal(t, torch.zeros(4))
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), 1)), torch.tensor([1]))
    rows = hvd.allgather(torch.full((r + 1, 2), r))
    assert rows.shape == (n * (n + 1) // 2, 2)
    assert rows[:, 0].tolist() == [k for k in range(n) for _ in range(k + 1)]
    assert hvd.broadcast_object({"rank": r}, root_rank=1) == {"rank": 1}
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]


def test_integer_average_rounds_down_and_in_place_works_on_parameters():
    n, r = hvd.size(), hvd.rank()
    ints = torch.full((3,), r, dtype=torch.int64)
    assert torch.equal(hvd.allreduce(ints), torch.full((3,), sum(range(n)) // n, dtype=torch.int64))
    weight = torch.nn.Parameter(torch.full((2,), float(r)))
    assert hvd.allreduce_(weight, op=hvd.Sum, prescale_factor=2.0) is weight
    assert torch.equal(weight.detach(), torch.full((2,), 2.0 * sum(range(n))))


def test_collectives_are_differentiable_as_horovods():
    r = hvd.rank()
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x * 2) * torch.arange(3.0)).sum().backward()
    # d/dx of mean_r(2x_r) . w, reduced the same way: 2w
    torch.testing.assert_close(x.grad, 2 * torch.arange(3.0))
    rows = torch.ones(r + 1, 2, requires_grad=True)
    gathered = hvd.allgather(rows)
    weights = torch.arange(float(gathered.numel())).reshape(gathered.shape)
    (gathered * weights).sum().backward()
    offset = sum(k + 1 for k in range(r))
    # every rank's loss touches my rows: Horovod averages the gradient over ranks
    torch.testing.assert_close(rows.grad, weights[offset : offset + r + 1])
    root = torch.ones(4, requires_grad=True)
    hvd.broadcast(root * (r + 1), root_rank=0).sum().backward()
    torch.testing.assert_close(root.grad, torch.full((4,), 1.0) if r == 0 else torch.zeros(4))


def test_build_queries_barrier_and_unsupported_options():
    assert hvd.mpi_built() and hvd.gloo_built() and not hvd.gloo_enabled()
    assert isinstance(hvd.nccl_built(), int) and not hvd.rocm_built()
    hvd.barrier()
    with pytest.raises(TypeError, match="process_set must be a ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set="other")


def test_broadcast_parameters_takes_a_list_of_tensors():
    tensors = [torch.full((2,), float(hvd.rank())), torch.full((3,), float(hvd.rank()) + 1)]
    hvd.broadcast_parameters(tensors, root_rank=hvd.size() - 1, process_set=hvd.global_process_set)
    assert torch.equal(tensors[0], torch.full((2,), float(hvd.size() - 1)))
    assert torch.equal(tensors[1], torch.full((3,), float(hvd.size())))


def test_timeline_switches_on_and_off(tmp_path):
    path = hvd.broadcast_object(str(tmp_path / "hvd_timeline.json"), root_rank=0)
    hvd.start_timeline(path)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(make_sgd(model.parameters()), named_parameters=model.named_parameters())
    _train(model, optimizer, rank_data(1))
    hvd.stop_timeline()
    optimizer.close()
    del optimizer
    if hvd.rank() == 0:
        import json

        names = {e["name"] for e in json.load(open(path))["traceEvents"]}
        assert {"forward", "backward", "step", "allreduce", "bucket 0"} <= names


def _train(model, optimizer, data):
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def noisy_data(rank):
    generator = torch.Generator().manual_seed(rank)
    return [(x + torch.randn(x.shape, generator=generator), y) for x, y in rank_data(1)]  # three batches


def union_reference(halves, reduce_sum):
    """One process, every rank's batches: step t applies the mean (or sum) of the ranks' gradients."""
    model = make_model()
    optimizer = make_sgd(model.parameters())
    data = [noisy_data(r) for r in range(hvd.size())]
    for step in range(len(data[0])):
        optimizer.zero_grad()
        loss = sum(F.cross_entropy(model(x[h]), y[h]) for x, y in (d[step] for d in data) for h in halves)
        (loss if reduce_sum else loss / hvd.size()).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"gradient_predivide_factor": 2.0},
        {"op": hvd.Sum},
        {"compression": hvd.Compression.fp16},
        {"backward_passes_per_step": 2},
    ],
    ids=["average", "predivide", "sum", "fp16", "accumulate"],
)
def test_distributed_optimizer_matches_training_on_the_union_of_the_data(options):
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        make_sgd(model.parameters()), named_parameters=model.named_parameters(), **options
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    halves = (slice(0, 3), slice(3, 6)) if options.get("backward_passes_per_step") == 2 else (slice(None),)
    for x, y in noisy_data(hvd.rank()):
        optimizer.zero_grad()
        for half in halves:
            F.cross_entropy(model(x[half]), y[half]).backward()
        optimizer.step()
    expected = union_reference(halves, reduce_sum=options.get("op") is hvd.Sum)
    tolerance = 1e-3 if "compression" in options else 1e-5
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)
    optimizer.close()
    del optimizer


def test_bad_arguments_name_the_knob():
    model = make_model()
    with pytest.raises(ValueError, match="compression must be hvd.Compression"):
        hvd.DistributedOptimizer(make_sgd(model.parameters()), compression="zip")

    class Custom(hvd.Compressor):
        pass

    with pytest.raises(ValueError, match="custom compressors are not supported"):
        hvd.DistributedOptimizer(make_sgd(model.parameters()), compression=Custom)
    with pytest.raises(ValueError, match="gradient_predivide_factor=2.0 needs op=hvd.Average"):
        hvd.DistributedOptimizer(make_sgd(model.parameters()), op=hvd.Sum, gradient_predivide_factor=2.0)


def test_unused_parameters_get_zero_gradients_and_passes_can_change():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 2), "unused": torch.nn.Linear(4, 2)})
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model["used"](torch.ones(3, 4)).sum().backward()
    optimizer.step()
    assert model["unused"].weight.grad is not None and not model["unused"].weight.grad.any()  # zeros, as Horovod
    optimizer.set_backward_passes_per_step(2)
    assert optimizer.backward_passes_per_step == 2
    with pytest.raises(ValueError, match="backward_passes_per_step must be an integer >= 1, got 0"):
        optimizer.set_backward_passes_per_step(0)
    optimizer.close()
    del optimizer


def test_join_averages_over_all_ranks_and_returns_the_last_rank():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(make_sgd(model.parameters()), named_parameters=model.named_parameters())
    _train(model, optimizer, rank_data(hvd.rank()))
    last = hvd.join()
    counts = [num_batches(r) for r in range(hvd.size())]
    assert counts[last] == max(counts)
    # Horovod's rule: joined ranks add zeros and the average still divides by size().
    expected = make_model()
    reference = make_sgd(expected.parameters())
    data = [rank_data(r) for r in range(hvd.size())]
    for step in range(max(counts)):
        reference.zero_grad()
        loss = sum(F.cross_entropy(expected(x), y) for d in data if step < len(d) for x, y in [d[step]])
        (loss / hvd.size()).backward()
        reference.step()
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    optimizer.close()
    del optimizer


def _assign_grads(model, step):
    """Gradients from torch.autograd.grad, assigned by hand (no hook sees them); return them as numpy."""
    generator = torch.Generator().manual_seed(100 * hvd.rank() + step)
    x, y = torch.randn(6, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    for param, grad in zip(params, grads):
        param.grad = grad
    return [g.numpy().copy() for g in grads]


@pytest.mark.parametrize("synchronize", ["in step", "explicit"])
def test_gradients_assigned_by_hand_are_averaged_as_horovods_missing_parameters(synchronize):
    import numpy as np

    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for step in range(3):
        optimizer.zero_grad()
        local = _assign_grads(model, step)
        expected = [np.mean(arrays, axis=0) for arrays in zip(*hpcddp.allgather_object(local))]
        if synchronize == "explicit":
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        for param, mean in zip(model.parameters(), expected):
            np.testing.assert_allclose(param.grad.numpy(), mean, rtol=1e-6, atol=1e-7)
    optimizer.close()
    del optimizer
    assert_ranks_agree(model)
