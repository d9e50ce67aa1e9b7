"""Train a small MLP in phases, some with slow ranks, and print what rank 0 reported about stragglers.

Run by tests/test_straggler_runs.py on 4 ranks with HPCDDP_STRAGGLER_EVERY=20. Each phase
has an optimizer of its own; a slow rank sleeps SLEEP_S before its forward pass in every
step. Rank 0 prints one ``LINE <phase> <text>`` per hpcddp warning and one
``REPORT <phase> <json>`` per phase (the last report, from hpcddp.straggler_report()).

``python tests/straggler_job.py <case>`` runs instead one of the review's cases (``CASES``), in
which the ranks step an optimizer unevenly; each rank prints ``DONE <rank>`` at its end.
"""

import json
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

import hpcddp
import hpcddp.horovod as hvd

SLEEP_S = 0.040


class Lines(logging.Handler):
    """Keep rank 0's hpcddp warnings, labelled with the phase they came in."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.phase = ""
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.phase, record.getMessage()))


def train(optimizer, model, steps: int, slow: set[int], batches: int | None = None) -> None:
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(steps if batches is None else batches):
        if hpcddp.rank() in slow:
            time.sleep(SLEEP_S)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def report(phase: str, reports: dict) -> None:
    found = hpcddp.straggler_report()
    if found is not None:
        reports[phase] = {
            "first_step": found.first_step,
            "last_step": found.last_step,
            "stragglers": [[s.rank, s.waited_ms] for s in found.stragglers],
        }


def main() -> None:
    hpcddp.init()
    torch.set_num_threads(1)
    lines = Lines()
    logging.getLogger("hpcddp").addHandler(lines)
    reports: dict = {}

    def phase(
        name: str, slow: set[int], steps: int, *, horovod: bool = False, batches=None, buckets_mb=(25.0, 1.0)
    ) -> None:
        lines.phase = name
        model = mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        if horovod:
            optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        else:
            optimizer = hpcddp.DistributedOptimizer(
                sgd, model.named_parameters(), bucket_cap_mb=buckets_mb[0], first_bucket_mb=buckets_mb[1]
            )
        if batches is None:
            train(optimizer, model, steps, slow)
        else:
            with hpcddp.join(optimizer):
                train(optimizer, model, steps, slow, batches=batches)
        report(name, reports)

    phase("one-slow", {2}, 80)
    phase("balanced", set(), 160)
    phase("two-slow", {1, 3}, 80)
    # Rank 0 runs out of data after 45 steps: the windows ending at 20 and 40 are reported, the
    # one ending at 60 (rank 0 shadowing the others) is not, on any rank.
    phase("join", set(), 0, batches=45 if hpcddp.rank() == 0 else 65)
    # Asynchronous averaging: nobody waits, so the slow rank shows in its steps per second.
    lines.phase = "async"
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = hpcddp.AsyncModelAverager(model, sgd)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    deadline = time.perf_counter() + 2.0
    while time.perf_counter() < deadline:
        if hpcddp.rank() == 1:
            time.sleep(SLEEP_S)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd.step()
    averager.close()
    found = hpcddp.straggler_report()
    if found is not None:
        reports["async"] = {"slow": list(found.slow), "steps_per_s": found.steps_per_s}
    hvd.init()
    # 70 steps: windows end at 20, 40 and 60; shutdown reports steps 61-70.
    phase("horovod", {3}, 70, horovod=True)
    lines.phase = "shutdown"
    rank = hpcddp.rank()
    hpcddp.shutdown()
    report("shutdown", reports)
    # gloo with several buckets: a fast rank waits for the slow one at bucket 0's launch, inside
    # its backward pass (the step's agreement); that is wait, not the fast rank's compute.
    hpcddp.init(backend="gloo")
    phase("gloo", {1}, 40, buckets_mb=(0.01, 0.001))  # 2 buckets: the last layer's, then the first's
    hpcddp.shutdown()
    if rank == 0:
        for name, text in lines.lines:
            print(f"LINE {name} {text}", flush=True)
        for name, found in reports.items():
            print(f"REPORT {name} {json.dumps(found)}", flush=True)


class FailsOnce(torch.optim.SGD):
    """SGD whose step raises once, at its ``fail_at``-th step (0: never)."""

    fail_at = 0
    num_calls = 0

    def step(self, closure=None):
        self.num_calls += 1
        if self.num_calls == self.fail_at:
            raise RuntimeError("inner step failed")
        return super().step(closure)


def uneven(case: str) -> None:
    """One review case at 2 ranks (HPCDDP_STRAGGLER_EVERY as the test sets it): the ranks step unevenly."""
    hpcddp.init()
    torch.set_num_threads(1)
    rank = hpcddp.rank()
    if case == "every-differs" and rank == 1:
        os.environ["HPCDDP_STRAGGLER_EVERY"] = "7"  # as on a host that mpirun gave no -x HPCDDP_STRAGGLER_EVERY
    model = mlp()
    sgd = FailsOnce(model.parameters(), lr=0.01)
    optimizer = hpcddp.DistributedOptimizer(sgd, model.named_parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def reduced_steps(num_steps: int) -> None:
        for _ in range(num_steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                optimizer.step()
            except RuntimeError as err:  # the wrapped step's own error, caught on this rank only
                print(f"CAUGHT {rank} {err}", flush=True)

    if case == "after-close":  # EVERY=5: rank 0's 5th step is a local one
        reduced_steps(3)
        optimizer.close()
        for _ in range(4 if rank == 0 else 0):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    elif case == "no-backward":  # EVERY=5: rank 1's 5th step() follows no backward pass
        reduced_steps(4)
        if rank == 1:
            optimizer.zero_grad()
            optimizer.step()
    elif case == "every-differs":  # EVERY=5 on rank 0, 7 on rank 1
        reduced_steps(8)
    elif case == "inner-raises":  # EVERY=5: rank 1's wrapped step raises at step 5
        sgd.fail_at = 5 if rank == 1 else 0
        reduced_steps(8)
    elif case == "uneven-shutdown":  # EVERY=200: no window ends; 10 steps on rank 0, 9 on rank 1
        reduced_steps(9)
        if rank == 0:
            optimizer.zero_grad()
            optimizer.step()
    elif case == "exit-rank-0":  # EVERY=200: 12 steps, then rank 0 leaves without shutdown()
        reduced_steps(12)
        if rank == 0:
            print(f"DONE {rank}", flush=True)
            sys.exit(0)
    else:
        raise ValueError(f"unknown case {case!r}: one of {CASES}")
    hpcddp.shutdown()
    print(f"DONE {rank}", flush=True)


CASES = ("after-close", "no-backward", "inner-raises", "uneven-shutdown", "exit-rank-0", "every-differs")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        uneven(sys.argv[1])
    else:
        main()
