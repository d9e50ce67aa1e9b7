"""The reference for tests/elastic_job.py: replay, in one process, the steps that counted.

Each step that counted is the last execution of that step number (a start resumed from a
commit runs the lost steps again). Its gradient is the average of every rank's mean
squared error gradient over the indices that rank logged; SGD applies it, in float64.
"""

import glob
import json
import os

import torch


def read_steps(log_dir):
    """Return every rank's logged steps (dicts), from every start of the job."""
    lines = []
    for path in glob.glob(os.path.join(log_dir, "launch*-rank*.jsonl")):
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.endswith("\n")]
    return lines


def replay(log_dir):
    """Return ``(weight, bias, counted)``: the reference parameters and, per step number, the start that counted."""
    lines = read_steps(log_dir)
    counted = {}
    for line in lines:
        counted[line["step"]] = max(counted.get(line["step"], -1), line["launch"])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, dtype=torch.float64, generator=generator)
    w = torch.randn(8, 1, dtype=torch.float64, generator=generator)
    y = x @ w + 0.1 * torch.randn(96, 1, dtype=torch.float64, generator=generator)
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1).double()
    for step in sorted(counted):
        batches = [line for line in lines if line["step"] == step and line["launch"] == counted[step]]
        assert len(batches) == batches[0]["size"], (
            f"step {step}: {len(batches)} ranks logged it of {batches[0]['size']}"
        )
        grads = []
        for batch in batches:
            model.zero_grad()
            index = torch.tensor(batch["indices"])
            torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.05 * sum(g[i] for g in grads) / len(grads)
    return model.weight.detach().flatten().tolist(), model.bias.detach().tolist(), counted


def assert_matches_replay(log_dir):
    """Check the job's final parameters (rank 0's final.json) against the replay; return the replay's step map."""
    weight, bias, counted = replay(log_dir)
    with open(os.path.join(log_dir, "final.json")) as f:
        final = json.load(f)
    assert final["step"] == max(counted), (final["step"], max(counted))
    torch.testing.assert_close(
        torch.tensor(final["weight"] + final["bias"], dtype=torch.float64),
        torch.tensor(weight + bias, dtype=torch.float64),
        rtol=1e-12,
        atol=1e-12,
    )
    return counted
