"""What straggler reports cost: rank 0's share of one report at p ranks, and each rank's bookkeeping per step.

Rank 0, per report: every rank's payload (``FIELDS`` as float64, plus its host name in the
first report) pickled as mpi4py's gather sends it, unpickled as rank 0 receives it, then
``unpack``, ``judge`` and the lines (``publish``, logged to nowhere), with 1 in 512 ranks
slow. Per step: ``StepTimeRecorder.reduction_done`` and ``step_done`` between reports (with
the forward hook armed, and fired by the next module call) and ``ReductionTimes.waited``,
against one training step of ``hpcddp bench train``'s MLP on this machine. Run on the CPU:

    PYTHONPATH=. python docs/straggler_cost.py            # p = 512 and 4,096, 7 runs each
"""

import logging
import pickle
import socket
import statistics
import sys
import time
from array import array

import torch

from hpcddp.bench.models import build_workload
from hpcddp.ddp.timing import ReductionTimes
from hpcddp.observe import stragglers
from hpcddp.observe.step_times import StepTimeRecorder
from hpcddp.observe.stragglers import FIELDS, judge, unpack

RUNS = 7


def payloads(num_ranks: int, first: bool) -> list[bytes]:
    """What each of ``num_ranks`` ranks sends: 30 ms steps, 1 in 512 ranks 40 ms slower."""
    host = socket.gethostname().encode() if first else b""
    sent = []
    for rank in range(num_ranks):
        slow = 0.040 if rank % 512 == 7 else 0.0
        values = {
            "step": 0.070,
            "wait": 0.040 - slow,
            "compute": 0.030 + slow,
            "data": 0.001 + slow,
            "forward": 0.009,
            "data_forward": 0.010 + slow,
            "backward": 0.018,
            "optimizer": 0.002,
            "other": 0.0,
            "rank": rank,
            "node": rank // 8,
            "steps": 200,
        }
        sent.append(array("d", [values[name] for name in FIELDS]).tobytes() + host)
    return sent


def rank0_cost(num_ranks: int, first: bool) -> tuple[float, int, float]:
    """Return (seconds at rank 0 for one report, bytes it receives, seconds of it judging)."""
    blobs = [pickle.dumps(p, pickle.HIGHEST_PROTOCOL) for p in payloads(num_ranks, first)]
    start = time.perf_counter()
    received = [pickle.loads(b) for b in blobs]
    judging = time.perf_counter()
    table, hosts = unpack(received)
    report = judge(table, hosts, 1, 200)
    stragglers.publish(report)
    end = time.perf_counter()
    assert len(report.stragglers) == max(1, num_ranks // 512), report.stragglers
    return end - start, sum(len(b) for b in blobs), end - judging


class _Comm:
    rank, size = 0, 4


def per_step_cost(steps: int = 20_000) -> tuple[float, float]:
    """Return (seconds of ``reduction_done`` + ``step_done`` + ``waited`` per step, seconds of the hooked module call's extra)."""
    recorder = StepTimeRecorder(10**9)
    times, comm, module = ReductionTimes(), _Comm(), torch.nn.Linear(1, 1)
    named = list(module.named_parameters())
    x = torch.zeros(1)
    samples = []
    for step in range(1, steps + 1):
        times.backward_start = time.perf_counter()
        times.backward_end = times.backward_start
        start = time.perf_counter()
        times.waited(times.backward_end)
        recorder.reduction_done(step, 4, comm)
        recorder.step_done(start, times, step, named)
        samples.append(time.perf_counter() - start)
    # The one hooked module call per step, against the same call unhooked.
    hooked, plain = [], []
    for _ in range(2_000):
        recorder._hook is None and recorder.step_done(time.perf_counter(), times, 1, named)
        start = time.perf_counter()
        module(x)
        hooked.append(time.perf_counter() - start)
        start = time.perf_counter()
        module(x)
        plain.append(time.perf_counter() - start)
    return statistics.median(samples), statistics.median(hooked) - statistics.median(plain)


def mlp_step() -> float:
    """Median seconds of one local training step of ``hpcddp bench train``'s MLP (batch 32)."""
    torch.set_num_threads(1)
    workload = build_workload("mlp")
    model = workload.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    samples = []
    for i in range(25):
        start = time.perf_counter()
        optimizer.zero_grad()
        workload.loss(model).backward()
        optimizer.step()
        if i >= 5:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(1)  # as a rank runs (hpcddp.init sets it): rank 0's judging too, not only the MLP's step
    logging.getLogger("hpcddp").addHandler(logging.NullHandler())
    logging.getLogger("hpcddp").propagate = False
    sizes = [int(n) for n in sys.argv[1].split(",")] if len(sys.argv) > 1 else [512, 4096]
    for num_ranks in sizes:
        for first in (True, False):
            runs = [rank0_cost(num_ranks, first) for _ in range(RUNS)]
            seconds = statistics.median(r[0] for r in runs)
            judging = statistics.median(r[2] for r in runs)
            print(
                f"p={num_ranks} {'first report (host names)' if first else 'later reports'}: rank 0 "
                f"{seconds * 1e3:.1f} ms (judging {judging * 1e3:.1f} ms; runs "
                f"{min(r[0] for r in runs) * 1e3:.1f}-{max(r[0] for r in runs) * 1e3:.1f}), "
                f"receives {runs[0][1]:,} bytes ({runs[0][1] / num_ranks:.0f} per rank)"
            )
    bookkeeping, hook = per_step_cost()
    step = mlp_step()
    print(
        f"per step: reduction_done + step_done + waited {bookkeeping * 1e6:.1f} us, hooked module call +{hook * 1e6:.1f} us; "
        f"MLP step {step * 1e3:.1f} ms; overhead {(bookkeeping + hook) / step * 100:.3f} %"
    )


if __name__ == "__main__":
    main()
