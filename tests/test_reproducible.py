"""reproducible=True: the same parameters, bit for bit, at 1, 2, 3 and 4 ranks, and close to a plain float run."""

import hashlib
import random
import sys
from fractions import Fraction

import pytest
import torch

import hpcddp
from hpcddp.reproducible import fixed_point
from hpcddp.testing import run_mpi

from .conftest import ROOT
from .reproducible_job import EPOCHS, MICRO_BATCH, NUM_SAMPLES, PER_STEP, SEED, make_data, make_model

TIME_LIMIT_S = 300
JOB = f"{ROOT}/tests/reproducible_job.py"


# -- the exact sum -------------------------------------------------------------------------
def exact_sum(groups, dtype, divisor=1):
    """Sum contributions with fixed_point, split into groups ("ranks") and aligned as the optimizer does."""
    num_digits, n = fixed_point.digits_needed([dtype]), groups[0][0].numel()
    values, rest = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    parts = []
    for group in groups:
        digits, position = torch.zeros(num_digits, n, dtype=torch.float64), fixed_point.NO_DIGIT
        for contribution in group:
            new = max(position, fixed_point.position_of(float(contribution.double().abs().max())))
            if position != fixed_point.NO_DIGIT:
                fixed_point.shift_down_(digits, new - position)
            position = new
            if position != fixed_point.NO_DIGIT:
                fixed_point.add_(digits, position, contribution, values, rest)
        parts.append((digits, position))
    agreed = max(position for _, position in parts)
    total = torch.zeros(num_digits, n, dtype=torch.int64)
    for digits, position in parts:
        if position != fixed_point.NO_DIGIT:
            fixed_point.shift_down_(digits, agreed - position)
        total += fixed_point.as_int64_(digits)
    return fixed_point.to_float_(fixed_point.as_float64_(total), agreed, torch.empty(n, dtype=torch.float64), divisor)


def exactly(contributions, divisor=1):
    return torch.tensor(
        [float(sum(Fraction(float(c[i])) for c in contributions) / divisor) for i in range(contributions[0].numel())],
        dtype=torch.float64,
    )


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_sum_is_the_same_for_any_order_and_split_and_near_exact(dtype):
    generator = torch.Generator().manual_seed(5)
    limit = 6 if dtype is torch.float16 else 24
    contributions = []
    for _ in range(9):
        scale = torch.exp2(torch.randint(-limit, limit, (500,), generator=generator).double())
        values = (torch.randn(500, generator=generator, dtype=torch.float64) * scale).to(dtype)
        values[::7] = 0
        contributions.append(values)
    whole = exact_sum([contributions], dtype)
    shuffled = contributions[:]
    random.Random(1).shuffle(shuffled)
    assert torch.equal(whole, exact_sum([shuffled[:3], shuffled[3:4], shuffled[4:]], dtype))
    assert torch.equal(whole, exact_sum([[c] for c in shuffled], dtype))
    exact = exactly(contributions)
    largest = max(float(c.double().abs().max()) for c in contributions)
    kept_to = largest * 2.0 ** -(fixed_point.KEPT_BELOW_LARGEST + 24)  # what a contribution may lose, at most
    assert ((whole - exact).abs() <= 9 * kept_to + 2.0**-51 * exact.abs()).all()


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_ends_of_a_dtype_range_sum_exactly(dtype):
    finfo = torch.finfo(dtype)
    smallest = finfo.tiny * finfo.eps
    for contributions in (
        [torch.full((3,), smallest, dtype=dtype), torch.full((3,), finfo.tiny, dtype=dtype)],
        [torch.full((3,), finfo.max / 4, dtype=dtype), torch.full((3,), -finfo.max / 4, dtype=dtype)],
        [torch.full((3,), finfo.max / 2, dtype=dtype)] * 4,
    ):
        mean = exact_sum([contributions], dtype, len(contributions))
        assert torch.equal(mean, exactly(contributions, len(contributions)))


@pytest.mark.unit
def test_digits_needed_names_a_dtype_it_cannot_sum():
    assert fixed_point.digits_needed([torch.float32, torch.bfloat16]) == 3
    assert fixed_point.digits_needed([torch.float64]) == 4
    with pytest.raises(TypeError, match="int64"):
        fixed_point.digits_needed([torch.int64])


# -- the sampler ---------------------------------------------------------------------------
@pytest.mark.unit
def test_sampler_splits_each_step_evenly_and_the_union_is_the_global_order():
    sampler = hpcddp.MicroBatchSampler(100, 4, 8, seed=1, rank=0, world_size=1)
    (alone,) = [list(iter(hpcddp.MicroBatchSampler(100, 4, 8, seed=1, rank=0, world_size=1)))]
    for world in (2, 3, 16):
        per_rank = [list(hpcddp.MicroBatchSampler(100, 4, 8, seed=1, rank=r, world_size=world)) for r in range(world)]
        for step, micro_batches in enumerate(alone):
            taken = [mb for rank in per_rank for mb in rank[step]]
            assert taken == micro_batches
            counts = [len(rank[step]) for rank in per_rank]
            assert max(counts) - min(counts) <= 1 and sum(counts) == 8
    assert [len(s) for s in alone] == [8, 8, 8] and len(sampler) == 3  # 100 // 32 steps, the rest dropped
    per_rank = [list(hpcddp.MicroBatchSampler(100, 4, 8, rank=r, world_size=3)) for r in range(3)]
    assert [len(rank[0]) for rank in per_rank] == [3, 3, 2]
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(100, generator=generator).tolist()
    assert alone[1][2].indices == order[40:44] and alone[1][2].index == 10
    digest = hashlib.blake2b(b"1:0:10", digest_size=8).digest()
    assert alone[1][2].seed == int.from_bytes(digest, "little") & (2**63 - 1)


@pytest.mark.unit
def test_sampler_without_drop_last_keeps_the_tail_and_resumes_at_its_place():
    sampler = hpcddp.MicroBatchSampler(70, 4, 8, seed=2, drop_last=False, rank=0, world_size=1)
    steps = list(sampler)
    assert [len(s) for s in steps] == [8, 8, 2] and len(steps[-1][-1].indices) == 2
    sampler = hpcddp.MicroBatchSampler(70, 4, 8, seed=2, drop_last=False, rank=1, world_size=2)
    sampler.set_epoch(3)
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict()
    assert (state["epoch"], state["next_step"]) == (3, 1)
    resumed = hpcddp.MicroBatchSampler(70, 4, 8, seed=2, drop_last=False, rank=0, world_size=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the epoch it is in: continue, not restart
    fresh = hpcddp.MicroBatchSampler(70, 4, 8, seed=2, drop_last=False, rank=0, world_size=3)
    fresh.set_epoch(3)
    assert list(resumed) == list(fresh)[1:]
    with pytest.raises(ValueError, match="micro_batch_size=4"):
        hpcddp.MicroBatchSampler(70, 5, 8, seed=2, drop_last=False).load_state_dict(state)
    with pytest.raises(ValueError, match="micro_batches_per_step must be an integer >= 1, got 0"):
        hpcddp.MicroBatchSampler(70, 4, 0)


@pytest.mark.unit
def test_sampler_at_an_epoch_end_resumes_with_the_next_epoch_and_repeats_without_set_epoch():
    sampler = hpcddp.MicroBatchSampler(64, 4, 8, rank=0, world_size=1)
    first = list(sampler)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["next_step"] == 0
    assert list(sampler) == first  # again without set_epoch: the same order, as DistributedSampler
    with pytest.raises(ValueError, match="num_samples=20 is less than one step.*drop_last=False"):
        hpcddp.MicroBatchSampler(20, 4, 8)


@pytest.mark.unit
def test_micro_batch_rng_seeds_dropout_and_restores_the_generator():
    (step,) = list(hpcddp.MicroBatchSampler(8, 4, 2, rank=0, world_size=1))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with step[0].rng():
        first = torch.nn.functional.dropout(torch.ones(100), 0.5)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(step[0].seed)
    assert torch.equal(first, torch.nn.functional.dropout(torch.ones(100), 0.5))


# -- the optimizer in one process ----------------------------------------------------------
def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def reproducible(model, **kwargs):
    return hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), reproducible=True, **kwargs
    )


@pytest.mark.unit
def test_the_gradient_is_the_mean_of_the_micro_batches(world_of_one):
    model, reference = small_model(), small_model()
    optimizer = reproducible(model)
    assert isinstance(optimizer, hpcddp.DistributedOptimizer) and optimizer.buckets == []
    data = torch.randn(5, 3, 4)
    for x in data:
        model(x).square().sum().backward()
        assert all(p.grad is None for p in model.parameters())  # held in the exact sums until the step
    grads = [torch.zeros_like(p) for p in reference.parameters()]
    for x in data:
        for g, got in zip(grads, torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))):
            g += got
    optimizer.synchronize()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g / 5, rtol=1e-6, atol=0)
    optimizer.step()


@pytest.mark.unit
def test_without_zero_grad_the_last_gradient_is_added_as_torch_adds_it(world_of_one):
    model = small_model()
    optimizer = reproducible(model, op="sum")
    x = torch.randn(3, 4)
    model(x).sum().backward()
    optimizer.step()
    first = [p.grad.clone() for p in model.parameters()]
    held = [p.grad for p in model.parameters()]
    model(x).sum().backward()  # no zero_grad: torch would accumulate into the step's gradient
    optimizer.synchronize()
    for p, old in zip(model.parameters(), held):
        assert p.grad is old  # the same tensor, as torch keeps it
    second = torch.autograd.grad(model(x).sum(), list(model.parameters()))  # leaves grad alone
    for p, g, new in zip(model.parameters(), first, second):
        torch.testing.assert_close(p.grad, g + new, rtol=1e-6, atol=1e-7)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is old and not p.grad.any() for p, old in zip(model.parameters(), held))


@pytest.mark.unit
def test_unused_parameters_stay_none_and_frozen_ones_join_when_unfrozen(world_of_one):
    model = small_model()
    model[2].weight.requires_grad_(False)
    optimizer = reproducible(model)
    model[0](torch.randn(2, 4)).sum().backward()  # the last layer is not used
    optimizer.step()
    assert model[2].bias.grad is None and model[2].weight.grad is None and model[0].weight.grad is not None
    optimizer.zero_grad()
    model[2].weight.requires_grad_(True)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert model[2].weight.grad is not None


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_double_precision_parameters(world_of_one, dtype):
    model = small_model().to(dtype)
    optimizer = reproducible(model)
    inputs = torch.randn(4, 3, 4, dtype=dtype)
    for x in inputs:
        model(x).sum().backward()
    optimizer.synchronize()
    reference = small_model().to(dtype)
    for x in inputs:
        reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(
            p.grad.double(), q.grad.double() / 4, rtol=2e-2 if dtype != torch.float64 else 1e-12, atol=1e-3
        )
    optimizer.step()


@pytest.mark.unit
def test_what_it_cannot_sum_is_an_error_naming_the_parameter(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    with pytest.raises(FloatingPointError, match=r"'0.weight'.*inf or NaN.*skip_nonfinite=True"):
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()  # the failed step left nothing behind
    optimizer.step()
    assert torch.isfinite(model[0].weight).all()
    skipping = reproducible(small_model(), skip_nonfinite=True)
    model = skipping.gradients.named[0][1]
    before = model.detach().clone()
    (model.sum() * float("inf")).backward()
    skipping.step()
    assert skipping.skipped_steps == 1 and torch.equal(model, before)


@pytest.mark.unit
def test_a_gradient_assigned_by_hand_or_a_pass_that_raised_is_an_error(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match="'0.weight'.*assigned by hand"):
        optimizer.step()
    model.zero_grad()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):  # after the last layer's gradients accumulated
        model[2](Boom.apply(model[1](model[0](torch.randn(2, 4))))).sum().backward()
    with pytest.raises(hpcddp.StepStoppedError, match="rank 0"):
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


@pytest.mark.unit
def test_synchronize_then_clip_then_step_and_a_pass_after_synchronize_is_refused(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    moved = sum(float((p.detach() - b).norm()) ** 2 for p, b in zip(model.parameters(), before)) ** 0.5
    assert moved == pytest.approx(0.1 * 1e-3, rel=1e-3)
    optimizer.zero_grad()
    optimizer.synchronize()
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="after synchronize"):
        optimizer.step()


@pytest.mark.unit
def test_a_gradient_there_before_the_first_backward_is_refused_but_one_changed_after_synchronize_is_kept(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    model[0].bias.grad = torch.ones_like(model[0].bias)  # by hand, then a backward pass on top
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="'0.bias'.*assigned by hand"):
        optimizer.step()
    optimizer.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.synchronize()
    for p in model.parameters():
        p.grad = p.grad.clamp(-1e-3, 1e-3)  # new tensors, the same on every rank: the step's gradients
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(((p.detach() - b).abs() <= 1.001e-4).all() for p, b in zip(model.parameters(), before))
    optimizer.zero_grad(set_to_none=False)
    model(torch.randn(2, 4)).sum().backward()  # the zeroed clamped gradients are carried, not "by hand"
    optimizer.step()


@pytest.mark.unit
def test_a_failed_synchronize_leaves_the_next_step_working(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    optimizer.synchronize()  # NaN gradients: step() refuses them
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.synchronize()
    optimizer.synchronize()  # again, with no new pass: nothing changes
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.unit
def test_grad_scaler_steps_on_the_unscaled_mean_and_backs_off_on_overflow(world_of_one):
    model, reference = small_model(), small_model()
    optimizer = reproducible(model)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(3, 4)
    scaler.scale(model(x).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    reference(x).sum().backward()
    plain.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    optimizer.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(x).sum() * float("inf")).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)  # the clipping pattern: unscale after synchronize()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**9 and all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.zero_grad()
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(optimizer)  # before synchronize(): nothing to unscale yet
    with pytest.raises(RuntimeError, match="unscale_.*before optimizer.synchronize"):
        scaler.step(optimizer)


@pytest.mark.unit
def test_synchronize_twice_keeps_the_verdict_and_zero_grad_drops_a_synchronized_step(world_of_one):
    model = small_model()
    optimizer = reproducible(model)
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    optimizer.synchronize()
    optimizer.synchronize()
    with pytest.raises(FloatingPointError, match="inf or NaN"):
        optimizer.step()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.synchronize()
    optimizer.zero_grad()  # the script skips this step
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.unit
def test_what_cannot_work_is_refused_with_the_fix(world_of_one):
    model = small_model()
    with pytest.raises(ValueError, match="LBFGS"):
        hpcddp.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), reproducible=True)
    optimizer = reproducible(model)
    with pytest.raises(ValueError, match="join.*not needed"), hpcddp.join(optimizer):
        pass
    model.double()  # after the optimizer: torch makes new accumulators, which the hooks do not see
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match="moved or cast.*after"):
        optimizer.step()


@pytest.mark.unit
def test_zero_grad_mid_step_drops_the_sum_as_torch_drops_the_gradients(world_of_one):
    model, reference = small_model(), small_model()
    optimizer = reproducible(model)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.zero_grad()
    x = torch.randn(2, 4)
    model(x).sum().backward(create_graph=True)
    optimizer.synchronize()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert not optimizer.gradients._digits.requires_grad  # create_graph: the sums hold no graph


@pytest.mark.unit
def test_a_mean_that_does_not_fit_its_dtype_is_an_error_and_one_near_the_top_is_exact(world_of_one):
    big = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD([big], lr=0.0), [("big", big)], reproducible=True)
    for _ in range(2):
        (big * 1.5e308).sum().backward()
    optimizer.synchronize()
    assert big.grad.tolist() == [1.5e308, 1.5e308]
    optimizer.step()
    half = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    summing = hpcddp.DistributedOptimizer(
        torch.optim.SGD([half], lr=0.0), [("half", half)], reproducible=True, op="sum"
    )
    for _ in range(2):
        (half * 40000.0).sum().backward()
    with pytest.raises(FloatingPointError, match="'half' does not fit its dtype"):
        summing.step()


@pytest.mark.unit
def test_an_optimizer_dropped_without_close_leaves_no_live_hooks(world_of_one):
    model = small_model()
    first = reproducible(model)
    del first
    import gc

    gc.collect()
    second = reproducible(model)
    model(torch.randn(2, 4)).sum().backward()
    second.step()


@pytest.mark.unit
def test_compression_and_predivide_are_refused(world_of_one):
    model = small_model()
    for kwargs, knob in (
        ({"compression": "fp16"}, "compression='fp16'"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor=2.0"),
    ):
        with pytest.raises(ValueError, match=knob):
            reproducible(model, **kwargs)
    with pytest.raises(TypeError, match="reproducible must be True or False, got 'yes'"):
        hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reproducible="yes")


# -- at 1 to 4 ranks -----------------------------------------------------------------------
def reference_run():
    """The same training in one process with plain float arithmetic, the order and seeds rebuilt by hand."""
    inputs, targets = make_data()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for epoch in range(EPOCHS):
        generator = torch.Generator().manual_seed(SEED + epoch)
        order = torch.randperm(NUM_SAMPLES, generator=generator).tolist()
        for step in range(NUM_SAMPLES // (MICRO_BATCH * PER_STEP)):
            optimizer.zero_grad()
            for index in range(step * PER_STEP, (step + 1) * PER_STEP):
                samples = order[index * MICRO_BATCH : (index + 1) * MICRO_BATCH]
                seed = int.from_bytes(
                    hashlib.blake2b(f"{SEED}:{epoch}:{index}".encode(), digest_size=8).digest(), "little"
                )
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed & (2**63 - 1))
                    loss = torch.nn.functional.cross_entropy(model(inputs[samples]), targets[samples])
                (loss / PER_STEP).backward()
            optimizer.step()
    return model.state_dict()


def train(tmp_path, num_ranks, *extra):
    out = tmp_path / f"params-{num_ranks}-{len(extra)}.pt"
    result = run_mpi(num_ranks, [sys.executable, JOB, str(out), *extra], timeout=TIME_LIMIT_S, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    return torch.load(out) if out.exists() else None


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return train(tmp_path_factory.mktemp("reproducible"), 1)


def assert_identical(got, want, steps=32):
    assert got["steps"] == want["steps"] == steps
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), name


@pytest.mark.ranks
@pytest.mark.parametrize(("num_ranks", "backend"), [(2, "mpi"), (3, "mpi"), (4, "mpi"), (3, "gloo")])
def test_training_is_bit_identical_at_every_world_size(tmp_path, one_rank, num_ranks, backend):
    assert_identical(train(tmp_path, num_ranks, "--backend", backend), one_rank)


@pytest.mark.ranks
def test_with_fewer_micro_batches_than_ranks_it_is_bit_identical_too(tmp_path):
    # 2 micro-batches per step over 3 ranks: one rank idle in every step (128 steps).
    alone, three = train(tmp_path, 1, "--per-step", "2"), train(tmp_path, 3, "--per-step", "2", "--backend", "mpi")
    assert_identical(three, alone, steps=128)


@pytest.mark.ranks
def test_a_run_resumed_at_another_world_size_is_bit_identical(tmp_path, one_rank):
    checkpoint = tmp_path / "half.pt"
    train(tmp_path, 2, "--stop-after", "20", "--checkpoint", str(checkpoint))
    assert_identical(train(tmp_path, 3, "--resume", str(checkpoint)), one_rank)


@pytest.mark.ranks
def test_it_is_close_to_a_plain_float_run(one_rank):
    for name, value in reference_run().items():
        got = one_rank["params"][name]
        assert (got - value).norm() <= 1e-4 * value.norm(), name
