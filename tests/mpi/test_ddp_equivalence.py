"""hpcddp's DistributedOptimizer (mpi backend) ends with the same parameters as DDP on gloo."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcddp

STEPS = 12
# The model's 22 KB of gradients in 3+ buckets (defaults would put them all in one).
SEVERAL_BUCKETS = {"bucket_cap_mb": 0.005, "first_bucket_mb": 0.002}


class Net(torch.nn.Module):
    """Small MLP with a branch that only some ranks, in some steps, use."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 48)
        self.hidden = torch.nn.Linear(48, 48)
        self.rare = torch.nn.Linear(48, 48)
        self.out = torch.nn.Linear(48, 4)

    def forward(self, x, use_rare=False):
        h = F.relu(self.inp(x))
        h = F.relu(self.hidden(h))
        if use_rare:
            h = F.relu(self.rare(h))
        return self.out(h)


def make_model():
    torch.manual_seed(1234)
    return Net()


def batches(steps, per_rank=8):
    generator = torch.Generator().manual_seed(100 + hpcddp.rank())
    return [
        (torch.randn(per_rank, 12, generator=generator), torch.randint(0, 4, (per_rank,), generator=generator))
        for _ in range(steps)
    ]


def assert_same(reference, model):
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def train_ddp(model, data, optimizer_cls, accumulate=1, rare=lambda step: False, **ddp_kwargs):
    # `rare` is unused in some steps, so DDP must look for unused parameters.
    ddp = DDP(model, find_unused_parameters=True, **ddp_kwargs)
    optimizer = optimizer_cls(ddp.parameters())
    for step, (x, y) in enumerate(data):
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        optimizer.zero_grad()
        for i, (mx, my) in enumerate(micro):
            if i < len(micro) - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(mx, rare(step)), my).backward()
            else:
                F.cross_entropy(ddp(mx, rare(step)), my).backward()
        optimizer.step()
    return model


def train_hpcddp(model, data, optimizer_cls, accumulate=1, rare=lambda step: False, use_no_sync=False, **kwargs):
    passes = 1 if use_no_sync else accumulate
    optimizer = hpcddp.DistributedOptimizer(
        optimizer_cls(model.parameters()), model.named_parameters(), backward_passes_per_step=passes, **kwargs
    )
    for step, (x, y) in enumerate(data):
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        optimizer.zero_grad()
        for i, (mx, my) in enumerate(micro):
            if use_no_sync and i < len(micro) - 1:
                with optimizer.no_sync():
                    F.cross_entropy(model(mx, rare(step)), my).backward()
            else:
                F.cross_entropy(model(mx, rare(step)), my).backward()
        optimizer.step()
    optimizer.close()
    return model, optimizer


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.mark.parametrize("optimizer_cls", [sgd, adam])
def test_several_buckets_match_ddp(gloo, optimizer_cls):
    data = batches(STEPS)
    reference = train_ddp(make_model(), data, optimizer_cls, bucket_cap_mb=0.01)
    model, optimizer = train_hpcddp(make_model(), data, optimizer_cls, **SEVERAL_BUCKETS)
    assert len(optimizer.buckets) >= 3
    assert_same(reference, model)


def test_accumulation_matches_ddp_no_sync(gloo):
    data = batches(STEPS, per_rank=16)
    reference = train_ddp(make_model(), data, sgd, accumulate=2)
    model, optimizer = train_hpcddp(make_model(), data, sgd, accumulate=2, **SEVERAL_BUCKETS)
    assert len(optimizer.buckets) >= 3
    assert_same(reference, model)


def test_no_sync_context_matches_ddp_no_sync(gloo):
    data = batches(STEPS, per_rank=16)
    reference = train_ddp(make_model(), data, sgd, accumulate=2)
    model, optimizer = train_hpcddp(make_model(), data, sgd, accumulate=2, use_no_sync=True, **SEVERAL_BUCKETS)
    assert len(optimizer.buckets) >= 3
    assert_same(reference, model)


def test_parameter_unused_on_some_ranks_matches_ddp(gloo):
    # Rank r uses the `rare` layer in steps where (step + r) % 3 == 0: at 2 and 4
    # ranks some steps have some ranks use it and others not, and some steps none.
    def rare(step):
        return (step + hpcddp.rank()) % 3 == 0

    data = batches(STEPS)
    reference = train_ddp(make_model(), data, sgd, rare=rare)
    model, optimizer = train_hpcddp(make_model(), data, sgd, rare=rare, **SEVERAL_BUCKETS)
    assert len(optimizer.buckets) >= 3
    assert_same(reference, model)


def test_parameter_unused_everywhere_keeps_grad_none_as_ddp(gloo):
    model = make_model()
    before = copy.deepcopy(model.rare.weight.detach())
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for x, y in batches(3):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        assert model.rare.weight.grad is None
        assert model.hidden.weight.grad is not None
    torch.testing.assert_close(model.rare.weight, before)
    optimizer.zero_grad(set_to_none=False)
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    # As torch's zero_grad(set_to_none=False) and DDP: a gradient that was None stays None.
    assert model.rare.weight.grad is None and model.hidden.weight.grad is not None
    optimizer.close()


def sgd_with_decay(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)


def train_keeping_grads(model, step_on, zero_grad, data, scenario):
    """Steps in which no rank uses ``rare`` in the last backward pass, though it had a gradient before.

    "second backward": a first pass uses ``rare``, a second (another loss) does not, then one
    step: its gradient stays the first pass's average. "zeroed, not None": gradients zeroed
    in place (``model.zero_grad(set_to_none=False)``) and ``rare`` unused in every other step:
    it keeps a zero gradient, so weight decay and momentum still move it.
    """
    for step, (x, y) in enumerate(data):
        if scenario == "second backward":
            zero_grad(True)
            F.cross_entropy(model(x[:4], True), y[:4]).backward()
            F.cross_entropy(model(x[4:], False), y[4:]).backward()
        else:
            zero_grad(False)
            F.cross_entropy(model(x, step % 2 == 0), y).backward()
        step_on()
    return model


@pytest.mark.parametrize("scenario", ["second backward", "zeroed, not None"])
def test_a_parameter_no_rank_uses_keeps_the_gradient_it_had_as_ddp(gloo, scenario):
    data = batches(6)
    ddp = DDP(make_model(), find_unused_parameters=True)
    reference_optimizer = sgd_with_decay(ddp.parameters())
    train_keeping_grads(ddp, reference_optimizer.step, lambda none: ddp.zero_grad(none), data, scenario)

    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(sgd_with_decay(model.parameters()), model.named_parameters())
    # The model's own zero_grad, as a script written for DDP calls it: the optimizer is not told.
    train_keeping_grads(model, optimizer.step, lambda none: model.zero_grad(none), data, scenario)
    optimizer.close()
    assert not torch.equal(model.rare.weight, make_model().rare.weight)  # it was trained
    assert_same(ddp.module, model)


def compress_hook(dtype):
    """A DDP comm hook that sends in ``dtype``, as torch's fp16/bf16_compress_hook (which want NCCL)."""

    def hook(state, bucket):
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(torch.distributed.get_world_size())
        future = torch.distributed.all_reduce(compressed, async_op=True).get_future()

        def decompress(done):
            return buffer.copy_(done.value()[0])

        return future.then(decompress)

    return hook


@pytest.mark.parametrize("compression, tolerance", [("fp16", 1e-4), ("bf16", 1e-3)])
def test_compression_matches_ddp_with_the_same_compression(gloo, compression, tolerance):
    data = batches(STEPS)
    reference = make_model()
    ddp = DDP(reference, find_unused_parameters=True)
    ddp.register_comm_hook(None, compress_hook(getattr(torch, "float16" if compression == "fp16" else "bfloat16")))
    optimizer = sgd(ddp.parameters())
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    model, _ = train_hpcddp(make_model(), data, sgd, compression=compression)
    # The tolerance covers rounding in the half-precision sums (measured: bf16 5e-4 at
    # 4 ranks, equal at 2), far below how far training moves the parameters.
    movement = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), make_model().parameters()))
    assert movement > 30 * tolerance
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, atol=tolerance, rtol=0)


def test_sum_op_is_the_plain_mpi4py_sum_of_local_gradients():
    from mpi4py import MPI

    model, local = make_model(), make_model()
    x, y = batches(1)[0]
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), op="sum", **SEVERAL_BUCKETS
    )
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(local(x), y).backward()  # this rank's own gradient, summed below with mpi4py
    for (name, param), mine in zip(local.named_parameters(), model.parameters()):
        if param.grad is None:  # the unused `rare` layer
            assert mine.grad is None, name
            continue
        expected = param.grad.numpy().copy()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
        torch.testing.assert_close(mine.grad, torch.from_numpy(expected), atol=1e-6, rtol=1e-6, msg=name)
    optimizer.close()


def test_lr_scheduler_accepts_the_wrapper(gloo):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    optimizer.close()


def test_gradients_are_identical_on_every_rank_after_step(gloo):
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), bucket_cap_mb=0.01
    )
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for param in (p for p in model.parameters() if p.grad is not None):
        gathered = hpcddp.allgather(param.grad.unsqueeze(0))
        for other in gathered:
            assert torch.equal(other, gathered[0])
    optimizer.close()


def test_ranks_that_joined_keep_the_same_unused_gradients_and_optimizer_state_as_the_others(gloo):
    # Gradients zeroed in place by the model, `rare` used in the first step only, and rank 0 with
    # more batches: the ranks that ran out shadow its steps with no gradient of their own. Every
    # rank must decide alike whether `rare` keeps its zero gradient (momentum and weight decay
    # move it) or goes back to None, or their optimizer states drift apart.
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(sgd_with_decay(model.parameters()), model.named_parameters())
    with hpcddp.join(optimizer):
        for step, (x, y) in enumerate(batches(5 if hpcddp.rank() == 0 else 2)):
            model.zero_grad(set_to_none=False)
            F.cross_entropy(model(x, step == 0), y).backward()
            optimizer.step()
    optimizer.close()
    mine = [optimizer.state[p]["momentum_buffer"] for p in model.rare.parameters()] + list(model.parameters())
    for other in hpcddp.allgather_object(mine):
        for a, b in zip(mine, other):
            assert torch.equal(a, b)


class ConvNet(torch.nn.Module):
    """Two convolutions, made channels_last as a GPU script does for tensor cores."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("powersgd", [False, True])
def test_channels_last_model_keeps_gradient_strides_and_matches_ddp(gloo, powersgd):
    def make():
        torch.manual_seed(7)
        return ConvNet().to(memory_format=torch.channels_last)

    generator = torch.Generator().manual_seed(200 + hpcddp.rank())
    data = [
        (torch.randn(4, 3, 6, 6, generator=generator).to(memory_format=torch.channels_last), torch.randint(0, 4, (4,)))
        for _ in range(4)
    ]
    # PowerSGD compresses a channels_last matrix in its memory order (columns permuted): only the layout is checked.
    kwargs = {"compression": hpcddp.PowerSGD(start_powerSGD_iter=1)} if powersgd else {}
    reference = make()
    ddp = DDP(reference)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    model = make()
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model.named_parameters(), **kwargs
    )
    for x, y in data:
        ddp_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        ddp_opt.step()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        for name, param in model.named_parameters():
            assert param.grad.stride() == param.stride(), name
    optimizer.close()
    if not powersgd:
        assert_same(reference, model)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize(
    "optimizer_cls, rare, use_no_sync",
    [
        (sgd_with_decay, lambda step: False, False),  # a branch no rank ever uses
        (adamw, lambda step: step >= 3, False),  # a layer first used at the fourth step
        (adamw, lambda step: step >= 3, True),
    ],
    ids=["never used, SGD with decay", "first used at step 4, AdamW", "first used at step 4, AdamW, no_sync"],
)
def test_zero_grad_keeping_tensors_leaves_gradients_no_rank_had_none_as_ddp(gloo, optimizer_cls, rare, use_no_sync):
    # zero_grad(set_to_none=False) zeroes the gradients that exist; one that is None stays None, so
    # the optimizer skips the parameter (no weight decay, no momentum, no Adam step) until it is used.
    data = batches(8, per_rank=16)
    accumulate = 2 if use_no_sync else 1
    reference = make_model()
    ddp = DDP(reference, find_unused_parameters=True)
    reference_optimizer = optimizer_cls(ddp.parameters())
    model = make_model()
    optimizer = hpcddp.DistributedOptimizer(
        optimizer_cls(model.parameters()), model.named_parameters(), **SEVERAL_BUCKETS
    )
    for step, (x, y) in enumerate(data):
        reference_optimizer.zero_grad(set_to_none=False)
        optimizer.zero_grad(set_to_none=False)
        for i, (mx, my) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            last_pass = i == accumulate - 1
            with contextlib.nullcontext() if last_pass else ddp.no_sync():
                F.cross_entropy(ddp(mx, rare(step)), my).backward()
            with contextlib.nullcontext() if last_pass else optimizer.no_sync():
                F.cross_entropy(model(mx, rare(step)), my).backward()
        assert (model.rare.weight.grad is None) == (reference.rare.weight.grad is None), step
        reference_optimizer.step()
        optimizer.step()
    optimizer.close()
    assert_same(reference, model)
    expected_steps = [reference_optimizer.state.get(p, {}).get("step") for p in reference.rare.parameters()]
    assert [optimizer.state.get(p, {}).get("step") for p in model.rare.parameters()] == expected_steps


class WithEmptyParameters(torch.nn.Module):
    """A small MLP with zero-element parameters, one of a dtype of its own (a bucket of its own)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 16)
        self.empty = torch.nn.Parameter(torch.zeros(0, 16))
        self.empty64 = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.inp(x))
        h = h + (self.empty.sum(0) + self.empty64.sum().float())
        return self.out(h)


@pytest.mark.parametrize("bucket_kwargs", [{}, SEVERAL_BUCKETS], ids=["default buckets", "small buckets"])
def test_zero_element_parameters_train_as_ddp(gloo, bucket_kwargs):
    def make():
        torch.manual_seed(5)
        return WithEmptyParameters()

    data = batches(4)
    reference = make()
    ddp = DDP(reference)
    reference_optimizer = sgd(ddp.parameters())
    model = make()
    optimizer = hpcddp.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), **bucket_kwargs)
    for x, y in data:
        for net, opt in ((ddp, reference_optimizer), (model, optimizer)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        assert model.empty.grad.shape == (0, 16) and model.empty64.grad.dtype == torch.float64
    optimizer.close()
    assert_same(reference, model)


class SparseEmbedding(torch.nn.Module):
    """An embedding with sparse gradients, as recommendation and word-vector models use with SparseAdam."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embedding = torch.nn.Embedding(40, 6, sparse=True)

    def forward(self, ids):
        return self.embedding(ids).sum(dim=1)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SparseAdam, torch.optim.SGD])
def test_sparse_gradients_reach_the_optimizer_sparse_as_with_ddp(gloo, optimizer_cls):
    generator = torch.Generator().manual_seed(300 + hpcddp.rank())
    # Each rank touches a different set of rows; some rows no rank touches.
    data = [
        (torch.randint(0, 30, (8, 3), generator=generator), torch.randn(8, 6, generator=generator)) for _ in range(6)
    ]
    reference = SparseEmbedding()
    ddp = DDP(reference)
    reference_optimizer = optimizer_cls(ddp.parameters(), lr=0.05)
    model = SparseEmbedding()
    optimizer = hpcddp.DistributedOptimizer(optimizer_cls(model.parameters(), lr=0.05), model.named_parameters())
    for ids, target in data:
        for net, opt in ((ddp, reference_optimizer), (model, optimizer)):
            opt.zero_grad()
            F.mse_loss(net(ids), target).backward()
            opt.step()
    optimizer.close()
    assert_same(reference, model)
    assert not torch.equal(model.embedding.weight, SparseEmbedding().embedding.weight)


@pytest.mark.parametrize("how", ["a backward before wrapping", "step(closure)"])
def test_sparse_adam_trains_as_with_ddp_when_the_gradient_predates_the_optimizer_or_comes_from_a_closure(gloo, how):
    generator = torch.Generator().manual_seed(400 + hpcddp.rank())
    data = [
        (torch.randint(0, 30, (8, 3), generator=generator), torch.randn(8, 6, generator=generator)) for _ in range(4)
    ]
    reference, model = SparseEmbedding(), SparseEmbedding()
    ddp = DDP(reference)
    if how == "a backward before wrapping":  # the sparse gradient is in place when the buckets are built
        for net in (ddp, model):
            F.mse_loss(net(data[0][0]), data[0][1]).backward()
    reference_optimizer = torch.optim.SparseAdam(ddp.parameters(), lr=0.05)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SparseAdam(model.parameters(), lr=0.05), model.named_parameters()
    )
    for ids, target in data:
        for net, opt in ((ddp, reference_optimizer), (model, optimizer)):

            def closure(net=net, opt=opt, ids=ids, target=target):
                opt.zero_grad(set_to_none=False)
                loss = F.mse_loss(net(ids), target)
                loss.backward()
                return loss

            if how == "step(closure)":
                assert opt.step(closure) is not None  # the closure's loss, as torch's step(closure) returns
            else:
                closure()
                opt.step()
    optimizer.close()
    assert_same(reference, model)
