"""DistributedOptimizer in one process, against a fake communicator of two identical ranks."""

import pytest
import torch
import torch.nn.functional as F

import hpcddp
from hpcddp.comm.base import Communicator, ReduceOp, completed
from hpcddp.comm.local import LocalCommunicator
from hpcddp.ddp.optimizer import DistributedOptimizer
from hpcddp.ddp.reducer import Phase

pytestmark = pytest.mark.unit


class TwinRanks(Communicator):
    """Pretends a second rank holds exactly the same tensors: a sum doubles them."""

    name = "twin"

    def __init__(self):
        super().__init__(rank=0, size=2)
        self.calls = []

    def allreduce_async_(self, tensor, op, *, check=None, label="", step=None):
        self.calls.append((tensor.numel(), tensor.dtype))
        assert op is ReduceOp.SUM
        return completed(tensor.mul_(2))

    def broadcast_async_(self, tensor, root, *, check=None, label="", step=None):
        return completed(tensor)

    def allgather_async(self, tensor, *, check=None, label="", step=None):
        return completed(torch.cat([tensor, tensor]))

    def broadcast_object(self, obj, root):
        return obj

    def allgather_object(self, obj):
        return [obj, obj]

    def gather_object(self, obj, root):
        return [obj, obj]

    def barrier(self):
        pass


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)
    )
    return model, torch.randn(16, 10), torch.randint(0, 3, (16,))


def wrap(model, comm=None, **kwargs):
    return DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        communicator=comm or TwinRanks(),
        **kwargs,
    )


def plain_step(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_average_of_identical_ranks_equals_a_local_step():
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    optimizer = wrap(model, bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain_step(reference, x, y)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a)


def test_first_pass_reduces_at_its_end_then_buckets_launch_during_backward_in_order():
    model, x, y = model_and_data()
    comm = TwinRanks()
    optimizer = wrap(model, comm, bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    # The first pass learns how often each parameter accumulates: it reduces at its end.
    F.cross_entropy(model(x), y).backward()
    assert len(comm.calls) == len(optimizer.buckets) >= 3
    assert optimizer.times.bucket_launch[0] > optimizer.times.backward_end
    optimizer.step()
    comm.calls.clear()
    F.cross_entropy(model(x), y).backward()
    assert len(comm.calls) == len(optimizer.buckets) >= 3
    expected = [b.buffer.numel() for b in optimizer.buckets]
    assert [numel for numel, _ in comm.calls] == expected
    times = optimizer.times
    assert times.bucket_launch == sorted(times.bucket_launch)
    assert times.bucket_launch[0] < times.backward_end


def test_gradients_are_bucket_views():
    model, x, y = model_and_data()
    optimizer = wrap(model)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for bucket in optimizer.buckets:
        for param, view in zip(bucket.params, bucket.views):
            assert param.grad.data_ptr() == view.data_ptr()


def test_model_zero_grad_set_to_none_is_recovered():
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    optimizer = wrap(model)
    model.zero_grad(set_to_none=True)  # torch's default drops our views
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain_step(reference, x, y)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a)


def test_backward_passes_per_step_reduces_once_every_k():
    model, x, y = model_and_data()
    comm = TwinRanks()
    optimizer = wrap(model, comm, backward_passes_per_step=3)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    assert comm.calls == []
    F.cross_entropy(model(x), y).backward()
    assert len(comm.calls) == len(optimizer.buckets)
    optimizer.step()


def test_no_sync_defers_to_the_next_pass():
    model, x, y = model_and_data()
    comm = TwinRanks()
    optimizer = wrap(model, comm)
    with optimizer.no_sync():
        F.cross_entropy(model(x), y).backward()
    assert comm.calls == []
    F.cross_entropy(model(x), y).backward()
    assert len(comm.calls) == len(optimizer.buckets)


def test_step_reduces_what_accumulated_even_before_k_passes():
    model, x, y = model_and_data()
    comm = TwinRanks()
    optimizer = wrap(model, comm, backward_passes_per_step=4)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert len(comm.calls) == len(optimizer.buckets)


def test_second_backward_before_step_accumulates_onto_the_averaged_gradients_as_ddp():
    # DDP's rule: a second pass without zero_grad adds its average to the first one's
    # (GradScaler skipping a step, then model.zero_grad() or a second loss).
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    wrap(model)
    for net in (model, reference):
        F.cross_entropy(net(x), y).backward()
        F.cross_entropy(net(x[:8]), y[:8]).backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    model.zero_grad()  # set to None behind the optimizer's back: the next pass starts afresh
    reference.zero_grad()
    for net in (model, reference):
        F.cross_entropy(net(x), y).backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


def test_gradients_are_averaged_when_backward_returns():
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    optimizer = wrap(model)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    # Twin ranks: the average of two identical gradients is the gradient itself,
    # already in place before step() (GradScaler.unscale_ and clipping read it there).
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    optimizer.step()


def test_world_of_one_installs_nothing():
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    optimizer = wrap(model, LocalCommunicator())
    assert optimizer.buckets == []
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    plain_step(reference, x, y)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a)


def test_state_dict_round_trip_and_param_groups():
    model, x, y = model_and_data()
    optimizer = wrap(model)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert isinstance(optimizer, torch.optim.Optimizer)
    state = optimizer.state_dict()
    optimizer.param_groups[0]["lr"] = 0.5
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a finite number > 0, got 0"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb must be a finite number > 0, got -1"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb must be a finite number > 0, got inf"),
        ({"first_bucket_mb": 0}, "first_bucket_mb must be a finite number > 0, got 0"),
        ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor must be a finite number > 0, got 0.0"),
        ({"op": "sum", "gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0 only applies to op='average'"),
        ({"backward_passes_per_step": 0}, "backward_passes_per_step must be an integer >= 1, got 0"),
        ({"backward_passes_per_step": 1.5}, "backward_passes_per_step must be an integer >= 1, got 1.5"),
        ({"compression": "int4"}, "compression must be one of None, 'fp16', 'bf16', 'powersgd', 'int8', "),
        ({"op": "median"}, "op must be one of"),
        ({"op": "max"}, "op must be 'average' or 'sum' for gradients, got 'max'"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, message):
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        wrap(model, **kwargs)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: hpcddp.PowerSGD(matrix_approximation_rank=0),
            "PowerSGD matrix_approximation_rank must be an integer >= 1, got 0",
        ),
        (
            lambda: hpcddp.PowerSGD(start_powerSGD_iter=-1),
            "PowerSGD start_powerSGD_iter must be an integer >= 0, got -1",
        ),
        (
            lambda: hpcddp.PowerSGD(min_compression_rate=float("nan")),
            "PowerSGD min_compression_rate must be a finite number > 0, got nan",
        ),
        (lambda: hpcddp.Int8(block_size=30), "Int8 block_size must be a positive multiple of 4, got 30"),
    ],
)
def test_bad_compression_settings_name_the_setting(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_parameter_listed_twice_is_refused():
    model, _, _ = model_and_data()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="lists one parameter twice"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named + [("again", named[0][1])], communicator=TwinRanks()
        )
    with pytest.raises(ValueError, match="lists the name '0.weight' twice"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named + [("0.weight", torch.nn.Parameter(torch.ones(1)))],
            communicator=TwinRanks(),
        )


def test_optimizer_listing_a_parameter_twice_is_refused():
    model, _, _ = model_and_data()
    params = list(model.parameters())
    with pytest.warns(UserWarning):  # torch itself only warns
        sgd = torch.optim.SGD(params + [params[1]], lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer lists parameter #\d+ twice"):
        DistributedOptimizer(sgd, communicator=TwinRanks())


def test_named_parameters_must_cover_the_optimizer():
    model, _, _ = model_and_data()
    with pytest.raises(ValueError, match="named_parameters is missing 2 of the optimizer's parameters"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters())[2:], communicator=TwinRanks()
        )


def test_nothing_trainable_is_refused_with_the_fix():
    model, _, _ = model_and_data()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="none of the 6 parameters requires grad: set requires_grad=True"):
        wrap(model)


def test_not_an_optimizer_is_a_type_error():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        DistributedOptimizer("sgd", communicator=TwinRanks())


class SharedWeight(torch.nn.Module):
    """``mid`` is used plainly and inside a reentrant checkpoint: two accumulations per backward pass."""

    def __init__(self, checkpoint_last):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = torch.nn.Linear(10, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        self.checkpoint_last = checkpoint_last

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.mid(torch.tanh(self.inp(x)))
        if self.checkpoint_last:
            return checkpoint(lambda t: self.out(torch.tanh(self.mid(t))), h, use_reentrant=True)
        return self.out(checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True))


@pytest.mark.parametrize("checkpoint_last", [False, True])
@pytest.mark.parametrize("passes", [1, 2])
def test_double_accumulation_in_reentrant_checkpoint_equals_a_local_step(checkpoint_last, passes):
    _, x, y = model_and_data()
    model, reference = SharedWeight(checkpoint_last), SharedWeight(checkpoint_last)
    comm = TwinRanks()
    optimizer = wrap(model, comm, bucket_cap_mb=0.001, first_bucket_mb=0.0005, backward_passes_per_step=passes)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for net, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            for half in x.chunk(passes):
                F.cross_entropy(net(half), y[: len(half)]).backward()
            opt.step()
    # mid's bucket is not the last: it is sent during backward, once both accumulations are in.
    assert any(p is model.mid.weight for p in optimizer.buckets[0].params) and len(optimizer.buckets) >= 2
    assert len(comm.calls) == 3 * len(optimizer.buckets)
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a)


def test_layer_unfrozen_after_wrapping_joins_the_buckets():
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    model[0].requires_grad_(False)
    optimizer = wrap(model)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert model[0].weight.grad is None and not optimizer.reducer.holds(model[0].weight)
    for step in range(3):
        if step == 1:
            model[0].requires_grad_(True)
        reference[0].requires_grad_(step >= 1)
        for net, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    assert optimizer.reducer.holds(model[0].weight) and "0.weight" in optimizer.parameter_names
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a)


def test_an_error_ending_one_optimizers_backward_still_ends_the_others_pass():
    # Autograd stops a pass's final callbacks at the first that raises; a second optimizer's
    # pass would stay open on this rank while other ranks end theirs.
    model, x, y = model_and_data()
    reference, _, _ = model_and_data()
    head = [model[0].weight, model[0].bias]
    rest = [p for p in model.parameters() if not any(p is h for h in head)]
    first = DistributedOptimizer(torch.optim.SGD(rest, lr=0.1), communicator=TwinRanks())
    second = DistributedOptimizer(torch.optim.SGD(head, lr=0.1), communicator=TwinRanks())

    def refuse(started):
        raise RuntimeError("this reduction failed")

    first.reducer._finish = refuse  # ``rest`` gets its gradients first: its pass ends first
    with pytest.raises(RuntimeError, match="this reduction failed"):
        F.cross_entropy(model(x), y).backward()
    F.cross_entropy(reference(x), y).backward()
    assert second.reducer.phase is Phase.IDLE
    for mine, theirs in zip(head, reference[0].parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)  # twin ranks: the average of equal gradients
