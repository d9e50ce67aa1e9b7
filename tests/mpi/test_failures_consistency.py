"""Different models on different ranks fail at construction, on every rank, with the same message."""

from collections import OrderedDict

import pytest
import torch

import hpcddp


def model(hidden=16, extra=False, name="hidden"):
    layers = [("inp", torch.nn.Linear(4, 16)), (name, torch.nn.Linear(16, hidden)), ("out", torch.nn.Linear(hidden, 2))]
    if extra:
        layers.append(("extra", torch.nn.Linear(2, 2)))
    return torch.nn.Sequential(OrderedDict(layers))


def last():
    return hpcddp.rank() == hpcddp.size() - 1


def raises_same_everywhere(build):
    with pytest.raises(ValueError) as info:
        build()
    messages = hpcddp.allgather_object(str(info.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


def wrap(net):
    return hpcddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters())


def test_same_model_passes():
    net = model()
    wrap(net).close()
    hpcddp.broadcast_parameters(net.state_dict())


def test_different_shape_names_the_parameter_and_the_rank():
    net = model(hidden=12 if last() else 16)
    message = raises_same_everywhere(lambda: wrap(net))
    r = hpcddp.size() - 1
    assert message.startswith("DistributedOptimizer: the ranks hold different parameters: parameter #2 differs on ")
    assert f"on rank {r} from rank 0" in message, message
    assert f"rank {r} have 'hidden.weight' [12, 16] float32" in message, message
    assert "'hidden.weight' [16, 16] float32" in message, message
    assert "every rank must build the same model" in message


def test_different_names_and_counts_in_broadcast_parameters():
    net = model(name="other" if last() else "hidden")
    message = raises_same_everywhere(lambda: hpcddp.broadcast_parameters(net.state_dict()))
    assert message.startswith("broadcast_parameters: ")
    assert "'other.weight'" in message and "'hidden.weight'" in message, message

    net = model(extra=last())
    message = raises_same_everywhere(lambda: wrap(net))
    r = hpcddp.size() - 1
    assert f"parameter #6 differs on rank {r} from rank 0" in message, message
    assert f"rank {r} have 'extra.weight' [2, 2] float32" in message and "has no such parameter" in message, message
    assert f"rank {r}: 8 vs 6 on rank 0" in message, message


def test_different_dtype_is_caught():
    net = model()
    if last():
        net.out.double()
    message = raises_same_everywhere(lambda: wrap(net))
    assert "'out.weight' [2, 16] float64" in message and "'out.weight' [2, 16] float32" in message, message


@pytest.mark.parametrize("order", ["the same", "another"])
def test_two_optimizers_buckets_reached_in_another_order_on_a_rank_raise_instead_of_being_summed(order):
    # Two halves of the same shapes, an optimizer each: rank 0 runs them in the other order when
    # told, so its backward readies the other optimizer's bucket first. Before, the ranks summed
    # one optimizer's gradients with the other's, silently.
    if hpcddp.size() == 1:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    halves = [torch.nn.Linear(5, 5, dtype=torch.float64) for _ in range(2)]
    optimizers = [
        hpcddp.DistributedOptimizer(torch.optim.SGD(h.parameters(), lr=0.1), h.named_parameters()) for h in halves
    ]
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(hpcddp.rank()))
    try:
        first, second = halves[::-1] if order == "another" and hpcddp.rank() == 0 else halves
        outputs = {id(first): first(x)}
        outputs[id(second)] = second(x)
        loss = outputs[id(halves[0])].pow(2).sum() + outputs[id(halves[1])].pow(3).sum()
        local = torch.autograd.grad(loss, halves[0].weight, retain_graph=True)[0]
        if order == "another":
            with pytest.raises(hpcddp.CollectiveMismatchError, match="gradient bucket differs .* another order"):
                loss.backward()
        else:
            loss.backward()
            expected = hpcddp.allreduce(local, op="sum") / hpcddp.size()
            torch.testing.assert_close(halves[0].weight.grad, expected, rtol=1e-12, atol=1e-12)
    finally:
        for optimizer in optimizers:
            optimizer.close()


def test_different_bucket_sizes_fail_at_construction_naming_the_knobs():
    # Buckets are not compared one by one (hpcddp/comm/mpi/gradient_channel.py): their layout is, when built.
    net = model(hidden=32)
    cap = 0.001 if last() else 25.0

    def build():
        return hpcddp.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), bucket_cap_mb=cap, first_bucket_mb=cap
        )

    if hpcddp.size() == 1:
        build().close()
        return
    message = raises_same_everywhere(build)
    assert message.startswith("DistributedOptimizer: the ranks built different gradient buckets"), message
    assert "pass the same bucket_cap_mb, first_bucket_mb and compression on every rank" in message, message


def test_a_collective_of_the_script_between_buckets_on_one_rank_and_after_them_on_another_averages_right():
    # Rank 0 starts an allreduce of its own inside backward, after the first buckets were launched;
    # the other ranks start it after backward. The buckets move on their own communicator, so
    # neither the order nor the sums depend on where the script's collective falls (before, the
    # ranks compared it with a bucket and raised CollectiveMismatchError).
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(4)])
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), bucket_cap_mb=0.001, first_bucket_mb=0.001
    )
    assert len(optimizer.buckets) == 4
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(hpcddp.rank()))
    try:
        net(x).square().sum().backward()  # the first pass launches nothing early
        optimizer.zero_grad()
        counted = []

        def collective_inside_backward(grad):
            # Started, not waited for: a blocking one would wait for ranks that start it after backward.
            counted.append(hpcddp.allreduce_async(torch.ones(3, dtype=torch.float64), op="sum"))
            return grad

        local = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
        hidden = net[:1](x)
        if hpcddp.rank() == 0:
            hidden.register_hook(collective_inside_backward)  # after the last layers' buckets were launched
        net[1:](hidden).square().sum().backward()
        if hpcddp.rank() != 0:
            collective_inside_backward(None)
        assert counted[0].wait().tolist() == [float(hpcddp.size())] * 3
        for param, mine in zip(net.parameters(), local):
            expected = hpcddp.allreduce(mine, op="sum") / hpcddp.size()
            torch.testing.assert_close(param.grad, expected, rtol=1e-12, atol=1e-12)
    finally:
        optimizer.close()


@pytest.mark.parametrize("where", ["after its first buckets", "before any bucket"])
@pytest.mark.parametrize("then", ["zero_grad", "step", "backward"])
def test_a_rank_whose_backward_stops_part_way_makes_every_rank_refuse_the_step_then_retries_exactly(then, where):
    # The last rank raises in a hook after its first buckets were launched (or before any). The others wait in
    # that step's remaining buckets: the last rank sends them, saying it stopped, and every rank
    # refuses the step alike; the retried step then averages exactly. "zero_grad": it retries the
    # batch (as a script that skips a batch after an error does) and sends them at zero_grad().
    # "step": it steps without zero_grad(), on gradients that are partial (the first layers never
    # got theirs): step() sends them and raises too, instead of averaging them. "backward": then a backward
    # pass before zero_grad(), which would reduce into the refused step: it raises on every rank, before any
    # collective, until zero_grad().
    if hpcddp.size() == 1:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16, dtype=torch.float64) for _ in range(4)])
    # "before any bucket": the first bucket holds the last two layers, and the stop falls between them
    first_mb = 0.001 if where == "after its first buckets" else 0.004
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), bucket_cap_mb=0.001, first_bucket_mb=first_mb
    )
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(hpcddp.rank()))
    stopped = rf"rank {hpcddp.size() - 1} stopped part-way through its backward"
    try:
        net(x).square().sum().backward()  # the first pass launches nothing early
        optimizer.step()
        optimizer.zero_grad()
        cut = 1 if where == "after its first buckets" else 3
        hidden, rest = net[:cut](x), net[cut:]
        if last():

            def stop(grad):
                raise RuntimeError("stopped on purpose")

            hidden.register_hook(stop)  # after the last layers' buckets were launched, or before the first
            with pytest.raises(RuntimeError, match="stopped on purpose"):
                rest(hidden).square().sum().backward()
            if then != "zero_grad":
                with pytest.raises(hpcddp.StepStoppedError, match=stopped):
                    optimizer.step()
        else:
            with pytest.raises(hpcddp.StepStoppedError, match=stopped):
                rest(hidden).square().sum().backward()
            if then != "zero_grad":  # the same script on every rank: a step on the dropped gradients is refused too
                with pytest.raises(hpcddp.StepStoppedError, match=stopped):
                    optimizer.step()
        if then != "zero_grad" or not last():
            assert all(p.grad is None for p in net.parameters())  # nothing half-averaged to step on
        if then == "backward":
            for _ in range(2):
                with pytest.raises(hpcddp.StepStoppedError, match=r"backward\(\) before that zero_grad\(\)"):
                    net(x).square().sum().backward()
            with pytest.raises(hpcddp.StepStoppedError, match=stopped):  # the local gradients it left: never stepped on
                optimizer.step()
        before = [p.detach().clone() for p in net.parameters()]
        optimizer.zero_grad()
        local = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
        net(x).square().sum().backward()
        for param, mine in zip(net.parameters(), local):
            torch.testing.assert_close(
                param.grad, hpcddp.allreduce(mine, op="sum") / hpcddp.size(), rtol=1e-12, atol=1e-12
            )
        optimizer.step()
        for param, old in zip(net.parameters(), before):
            torch.testing.assert_close(param, old - 0.1 * param.grad, rtol=1e-12, atol=1e-12)
    finally:
        optimizer.close()


def test_compression_settings_compare_by_value_not_by_repr():
    # 2 on one rank and 2.0 on another behave alike: the layout check must not refuse them.
    net = model(hidden=32)
    rate = 2 if last() else 2.0
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1),
        net.named_parameters(),
        compression=hpcddp.PowerSGD(min_compression_rate=rate),
    )
    optimizer.close()
