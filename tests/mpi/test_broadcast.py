"""broadcast_parameters and broadcast_optimizer_state give every rank root's values."""

import torch

import hpcddp


def test_broadcast_parameters_from_state_dict():
    torch.manual_seed(hpcddp.rank())
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7))
    hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
    for name, tensor in model.state_dict().items():
        gathered = hpcddp.allgather(tensor.unsqueeze(0).float())
        for other in gathered:
            assert torch.equal(other, gathered[0]), name


def test_broadcast_optimizer_state_after_steps():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (hpcddp.rank() + 1))
    for _ in range(hpcddp.rank() + 1):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    hpcddp.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.param_groups[0]["lr"] == 0.01
    steps = hpcddp.allgather_object(float(optimizer.state[model.weight]["step"]))
    assert steps == [1.0] * hpcddp.size()
    moments = hpcddp.allgather(optimizer.state[model.weight]["exp_avg"].unsqueeze(0))
    for other in moments:
        assert torch.equal(other, moments[0])
