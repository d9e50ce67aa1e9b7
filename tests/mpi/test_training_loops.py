"""Training loops as users write them (AMP with GradScaler, reentrant checkpointing, fine-tuning,
a NaN loss): hpcddp (mpi backend) ends where torch DDP (gloo) ends, and every rank agrees."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import hpcddp

from .test_ddp_equivalence import SEVERAL_BUCKETS, assert_same, batches, make_model

STEPS = 8


def assert_ranks_agree(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for other in hpcddp.allgather_object(flat):
        assert torch.equal(other, flat)


# ---- fp16 autocast + GradScaler, an inf on one rank at one step ---------------------------------

BAD_STEP = 3


def train_amp(model, optimizer, data, zero_grad_of="optimizer"):
    """The loop of the torch.amp docs, with clipping; returns the loss scale after every step.

    ``zero_grad_of="model"``: the loop clears gradients with ``model.zero_grad()``, as many do.
    """
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for step, (x, y) in enumerate(data):
        if step == BAD_STEP and hpcddp.rank() == hpcddp.size() - 1:
            x = x.clone()
            x[0, 0] = float("inf")  # one rank's gradient overflows
        (model if zero_grad_of == "model" else optimizer).zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def amp_model():
    # 1 MiB of gradients: the reduction takes long enough that unscale_ would read
    # it half done if backward returned before it completed.
    torch.manual_seed(11)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4)
    )


@pytest.mark.parametrize("zero_grad_of", ["optimizer", "model"])
def test_amp_grad_scaler_skips_the_overflowing_step_on_every_rank_as_ddp(gloo, zero_grad_of):
    data = batches(STEPS)
    reference = amp_model()
    ddp = DDP(reference)
    ddp_scales = train_amp(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), data, zero_grad_of)
    model = amp_model()
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters()
    )
    scales = train_amp(model, optimizer, data, zero_grad_of)
    optimizer.close()
    # The overflow halves the scale once, on every rank; the other steps train.
    assert scales == ddp_scales
    assert scales[BAD_STEP] == scales[BAD_STEP - 1] / 2 and scales[0] == scales[-1] * 2
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert_same(reference, model)
    assert_ranks_agree(model)


# ---- a weight used outside and inside a reentrant checkpoint -------------------------------------


class SharedWeight(torch.nn.Module):
    """``mid`` runs once plainly and once inside torch.utils.checkpoint(use_reentrant=True)."""

    def __init__(self, checkpoint_last):
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.Linear(12, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 4)
        self.checkpoint_last = checkpoint_last

    def forward(self, x):
        h = self.mid(torch.tanh(self.inp(x)))
        if self.checkpoint_last:  # the checkpoint's backward runs first and opens the pass
            return checkpoint(lambda t: self.out(torch.tanh(self.mid(t))), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("checkpoint_last", [False, True], ids=["checkpoint-inside", "checkpoint-last"])
def test_weight_inside_and_outside_a_reentrant_checkpoint_matches_ddp_static_graph(gloo, checkpoint_last):
    data = batches(STEPS)
    reference = SharedWeight(checkpoint_last)
    # DDP reduces a parameter accumulated twice in one pass only with static_graph=True.
    ddp = DDP(reference, static_graph=True)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    model = SharedWeight(checkpoint_last)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(), **SEVERAL_BUCKETS
    )
    for net, opt in ((ddp, ddp_optimizer), (model, optimizer)):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    optimizer.close()
    assert len(optimizer.buckets) >= 2
    assert_same(reference, model)
    assert_ranks_agree(model)


def test_more_accumulations_than_learned_is_an_error_not_a_wrong_gradient():
    model = SharedWeight(checkpoint_last=False)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), **SEVERAL_BUCKETS
    )
    # mid's bucket is sent before the first layer's gradient is in.
    assert any(p is model.mid.weight for p in optimizer.buckets[0].params)
    x, y = batches(1)[0]
    F.cross_entropy(model.out(torch.tanh(model.mid(torch.tanh(model.inp(x))))), y).backward()  # mid once
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"'mid\.(weight|bias)' received gradient #2 .* use_reentrant=False"):
        F.cross_entropy(model(x), y).backward()  # mid twice, after its bucket was sent
    optimizer.close()


# ---- fine-tuning: a frozen layer is unfrozen after wrapping -------------------------------------


def test_layer_unfrozen_after_wrapping_is_averaged_as_ddp_rebuilt_after_unfreezing(gloo):
    data = batches(STEPS)
    unfreeze_at = 3
    reference = make_model()
    reference.inp.requires_grad_(False)
    ddp_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    model = make_model()
    model.inp.requires_grad_(False)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters(), **SEVERAL_BUCKETS
    )
    ddp = DDP(reference, find_unused_parameters=True)
    for step, (x, y) in enumerate(data):
        if step == unfreeze_at:
            # DDP reduces only what required grad when it was built: it must be built again.
            reference.inp.requires_grad_(True)
            model.inp.requires_grad_(True)
            ddp = DDP(reference, find_unused_parameters=True)
        for net, opt in ((ddp, ddp_optimizer), (model, optimizer)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    optimizer.close()
    assert "inp.weight" in optimizer.parameter_names
    assert_same(reference, model)
    assert_ranks_agree(model)


# ---- a NaN loss on one rank ---------------------------------------------------------------------


def test_nan_loss_on_one_rank_is_reported_naming_that_rank(caplog):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    bad_rank = hpcddp.size() - 1
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        for step, (x, y) in enumerate(batches(3)):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if step == 1 and hpcddp.rank() == bad_rank:
                loss = loss * float("nan")
            loss.backward()
            optimizer.step()
    optimizer.close()
    warnings = [r.getMessage() for r in caplog.records if "was inf or NaN" in r.getMessage()]
    # Once, when it starts (every later step is NaN everywhere as a consequence), on every rank.
    assert len(warnings) == 1, warnings
    assert f"the local gradient of rank {bad_rank} was inf or NaN in reduction 1" in warnings[0]


# ---- gradients assigned by hand -----------------------------------------------------------------


def hand_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no backward hook reduced" in r.getMessage()]


def test_gradients_assigned_by_hand_stay_local_as_in_ddp_with_one_warning_naming_them(caplog):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        for x, y in batches(3):
            optimizer.zero_grad()
            weight = model.out.weight
            (grad,) = torch.autograd.grad(F.cross_entropy(model(x), y), [weight])
            weight.grad = grad
            optimizer.step()
            assert torch.equal(weight.grad, grad), "torch DDP's behaviour: a gradient no hook saw is not averaged"
    optimizer.close()
    warnings = hand_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "assigned by hand ('out.weight')" in warnings[0], warnings[0]


def test_a_gradient_assigned_by_hand_beside_a_backward_pass_is_named_too(caplog):
    # Backward reduced the other parameters; out.weight's gradient came by hand after it: the
    # replicas drift unless the user averages it, so the step says so (it did not: only steps
    # that nothing was reduced for were checked).
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    weight = model.out.weight
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        for x, y in batches(2):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            (grad,) = torch.autograd.grad(loss, [weight], retain_graph=True)
            loss.backward(inputs=[p for p in model.parameters() if p is not weight])
            weight.grad = grad * (hpcddp.rank() + 1)
            optimizer.step()
    optimizer.close()
    warnings = hand_warnings(caplog)
    assert len(warnings) == 1 and "assigned by hand ('out.weight')" in warnings[0], warnings


def test_no_warning_about_hand_assigned_gradients_in_loops_that_reduce_them(caplog):
    model = make_model()
    model.inp.bias.requires_grad_(False)  # frozen
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), backward_passes_per_step=2
    )
    data = batches(12)
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        for step in range(0, 4, 2):  # backward_passes_per_step: the first pass of each step reduces nothing
            optimizer.zero_grad()
            for x, y in data[step : step + 2]:
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
        optimizer.backward_passes_per_step = 1
        optimizer.zero_grad(set_to_none=False)
        with optimizer.no_sync():
            F.cross_entropy(model(data[4][0]), data[4][1]).backward()
        F.cross_entropy(model(data[5][0]), data[5][1]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.step()  # again, on the same (reduced) gradients
        optimizer.zero_grad()
        optimizer.step()  # no gradient at all
        with hpcddp.join(optimizer):  # uneven: the last rank runs out first and steps in the others' shadow
            for x, y in data[6 : 12 - hpcddp.rank() * 2]:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
    optimizer.close()
    assert hand_warnings(caplog) == []
    assert_ranks_agree(model)


# ---- gradients dropped by hand between an accumulating pass and the reducing one ----------------


@pytest.mark.parametrize("accumulate", ["no_sync", "passes"])
@pytest.mark.parametrize("dropped", ["model.zero_grad()", "one p.grad = None"])
def test_a_gradient_dropped_by_hand_after_an_accumulating_pass_does_not_come_back(accumulate, dropped):
    # Small gradients are accumulated by autograd in their bucket views: a view that still holds
    # the accumulating pass's gradient must not be handed back once the script dropped it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        backward_passes_per_step=2 if accumulate == "passes" else 1,
    )
    try:
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * hpcddp.rank() + step)
            first, second = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
            optimizer.zero_grad()
            earlier = torch.autograd.grad(model(first).square().sum(), list(model.parameters()))
            if accumulate == "passes":
                model(first).square().sum().backward()
            else:
                with optimizer.no_sync():
                    model(first).square().sum().backward()
            if dropped == "model.zero_grad()":
                model.zero_grad()
                kept = []
            else:
                model[0].weight.grad = None
                kept = list(model.parameters())[1:]
            local = torch.autograd.grad(model(second).square().sum(), list(model.parameters()))
            model(second).square().sum().backward()
            optimizer.synchronize()
            for param, mine, before in zip(model.parameters(), local, earlier):
                if any(param is other for other in kept):  # not dropped: both passes' gradients
                    mine = mine + before
                expected = hpcddp.allreduce(mine, op="sum") / hpcddp.size()
                torch.testing.assert_close(param.grad, expected, rtol=1e-6, atol=1e-7)
            optimizer.step()
    finally:
        optimizer.close()
