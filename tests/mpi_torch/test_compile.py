"""torch.compile(DDP(model)) on the hpcddp backend gives DDP-over-gloo's parameters (issue 36 row 8).

A model with buffers (BatchNorm): DDP's forward broadcasts them, and torch's C++ calls the
backend's Python ``broadcast`` back while torch.compile's frame hook is set.
"""

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _train(model, steps=2):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=generator)).square().sum().backward()
        optimizer.step()


def test_compiled_ddp_over_the_default_group_matches_eager_ddp_over_gloo(gloo):
    torch.manual_seed(dist.get_rank())  # different on each rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = DDP(copy.deepcopy(model), process_group=gloo)
    compiled = torch.compile(DDP(model))
    _train(compiled)
    _train(reference)
    for (name, ours), theirs in zip(model.state_dict().items(), reference.module.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=name)
