"""torch's own DDP, FSDP2, DistributedSampler and distributed checkpoints on the hpcddp backend, against gloo."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 8


class Net(torch.nn.Module):
    """Small MLP with a branch that only some ranks, in some steps, use."""

    def __init__(self, with_rare=True):
        super().__init__()
        self.inp = torch.nn.Linear(12, 48)
        self.hidden = torch.nn.Linear(48, 48)
        self.rare = torch.nn.Linear(48, 48) if with_rare else None
        self.out = torch.nn.Linear(48, 4)

    def forward(self, x, use_rare=False):
        h = F.relu(self.hidden(F.relu(self.inp(x))))
        if use_rare:
            h = F.relu(self.rare(h))
        return self.out(h)


def make_model(with_rare=False):
    torch.manual_seed(1234)
    return Net(with_rare).double()


def batches(steps, per_rank=8):
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return [
        (
            torch.randn(per_rank, 12, generator=generator, dtype=torch.float64),
            torch.randint(0, 4, (per_rank,), generator=generator),
        )
        for _ in range(steps)
    ]


def rare(step):
    # Rank r uses `rare` where (step + r) % 3 == 0: some steps some ranks, some steps none.
    return (step + dist.get_rank()) % 3 == 0


def train(runner, data, accumulate=1, use_rare=lambda step: False):
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(data):
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        optimizer.zero_grad()
        for i, (mx, my) in enumerate(micro):
            if i < len(micro) - 1:
                with runner.no_sync():
                    F.cross_entropy(runner(mx, use_rare(step)), my).backward()
            else:
                F.cross_entropy(runner(mx, use_rare(step)), my).backward()
        optimizer.step()


def full(parameter):
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def assert_same(reference, model):
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(full(b), full(a), rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "case",
    [
        {"ddp": {"bucket_cap_mb": 0.005}},
        {"ddp": {"bucket_cap_mb": 0.005, "gradient_as_bucket_view": True}, "accumulate": 2},
        {"ddp": {"bucket_cap_mb": 0.005, "find_unused_parameters": True}, "use_rare": rare},
        {"ddp": {}, "accumulate": 2},
    ],
    ids=["buckets", "no_sync", "find_unused", "one_bucket_no_sync"],
)
def test_ddp_matches_ddp_on_gloo(gloo, case):
    data = batches(STEPS, per_rank=8 * case.get("accumulate", 1))
    options = {k: v for k, v in case.items() if k != "ddp"}
    with_rare = "use_rare" in case
    reference, model = make_model(with_rare), make_model(with_rare)
    train(DDP(reference, process_group=gloo, **case["ddp"]), data, **options)
    runner = DDP(model, **case["ddp"])
    assert dist.get_backend(runner.process_group) == "hpcddp"
    train(runner, data, **options)
    assert_same(reference, model)


def test_fsdp2_fully_shard_matches_ddp_on_gloo(gloo):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = batches(STEPS)
    reference = make_model()
    train(DDP(reference, process_group=gloo), data)
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.inp, model.hidden, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert_same(reference, model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's SyncBatchNorm runs on CUDA tensors only")
def test_sync_batch_norm_matches_gloo(gloo):
    device = torch.device("cuda", torch.cuda.current_device())

    def run(group):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).to(device)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
        ddp = DDP(model, process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(4):
            x = torch.randn(5 + dist.get_rank(), 6, generator=generator).to(device)  # uneven batches
            optimizer.zero_grad()
            ddp(x).square().mean().backward()
            optimizer.step()
        return model

    reference, model = run(gloo), run(None)
    assert_same(reference, model)
    for a, b in zip(reference.buffers(), model.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_distributed_sampler_without_rank_or_size(gloo):
    from torch.utils.data import DistributedSampler

    dataset = list(range(23))
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    assert (sampler.rank, sampler.num_replicas) == (dist.get_rank(), dist.get_world_size())
    explicit = DistributedSampler(dataset, num_replicas=dist.get_world_size(gloo), rank=dist.get_rank(gloo), seed=3)
    sampler.set_epoch(2)
    explicit.set_epoch(2)
    assert list(sampler) == list(explicit)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(sampler), group=gloo)
    assert {i for part in every for i in part} == set(range(len(dataset)))


def test_distributed_checkpoint_save_load(gloo, shared_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded():
        model = make_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return model

    model = sharded()
    for p in model.parameters():
        p.data.add_(0.5)
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{shared_dir}/dcp_hpcddp")
    restored = sharded()
    state = {"model": restored.state_dict()}
    dcp.load(state, checkpoint_id=f"{shared_dir}/dcp_hpcddp")
    restored.load_state_dict(state["model"])
    assert_same(model, restored)
    # The same checkpoint read back on gloo: what hpcddp wrote is what gloo reads.
    plain = make_model()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=f"{shared_dir}/dcp_hpcddp", process_group=gloo)
    plain.load_state_dict(state["model"])
    assert_same(model, plain)
