"""A Horovod elastic training job for the elastic tests: a float64 linear model whose every step is logged.

Each rank appends one JSON line per step to ``<log>/launch<L>-rank<R>.jsonl``: the step,
the size of the job, and the dataset indices of its batch, so that a test can replay the
steps that counted in one process and compare the parameters (an independent reference).
Written as a Horovod elastic script: only the import differs.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hpcddp.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--log", required=True, help="directory for the per-rank step logs")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--commit-every", type=int, default=2, help="steps between commits")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (a slower job)")
parser.add_argument("--die-at", type=int, default=-1, help="in the first start, rank --die-rank kills itself here")
parser.add_argument("--die-rank", type=int, default=1)
args = parser.parse_args()

NUM_SAMPLES, NUM_FEATURES, LR = 96, 8, 0.05


def make_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, dtype=torch.float64, generator=generator)
    w = torch.randn(NUM_FEATURES, 1, dtype=torch.float64, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(NUM_SAMPLES, 1, dtype=torch.float64, generator=generator))


def make_model():
    torch.manual_seed(1)
    return torch.nn.Linear(NUM_FEATURES, 1).double()


hvd.init()
launch = int(os.environ.get("HPCDDP_ELASTIC_LAUNCH", "0"))
dataset = make_data()
model = make_model()
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
)
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
os.makedirs(args.log, exist_ok=True)
log = open(os.path.join(args.log, f"launch{launch}-rank{hvd.rank()}.jsonl"), "a")


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 - Horovod's own idiom
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=state.sampler)
        for batch_idx, (xb, yb) in enumerate(loader):
            indices = state.sampler.indices[batch_idx * args.batch_size : (batch_idx + 1) * args.batch_size]
            optimizer.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            optimizer.step()
            state.step += 1
            line = {"launch": launch, "size": hvd.size(), "rank": hvd.rank(), "step": state.step}
            line.update(epoch=state.epoch, indices=list(indices), time=time.time(), resets=resets)
            log.write(json.dumps(line) + "\n")
            log.flush()
            state.sampler.record_batch(batch_idx, args.batch_size)
            if launch == 0 and state.step == args.die_at and hvd.rank() == args.die_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % args.commit_every == 0:
                state.commit()
            time.sleep(args.step_sleep)
        state.sampler.set_epoch(state.epoch + 1)
        state.commit()


train(state)
if hvd.rank() == 0:
    final = {"weight": model.weight.detach().flatten().tolist(), "bias": model.bias.detach().tolist()}
    final.update(step=state.step, size=hvd.size(), launch=launch)
    with open(os.path.join(args.log, "final.json"), "w") as f:
        json.dump(final, f)
