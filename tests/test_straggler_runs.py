"""Straggler reports on 4 MPI ranks: a rank that sleeps 40 ms before each forward pass is named, a balanced job is not.

One launch (tests/straggler_job.py) trains in phases with HPCDDP_STRAGGLER_EVERY=20; 4 ranks
on 2 cores is oversubscribed, so the balanced phase runs 8 windows to show that the
thresholds hold under the noise of a loaded machine.
"""

import json
import re
import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

TIME_LIMIT_S = 300
LINE = re.compile(
    r"^hpcddp: straggler: rank (\d+) \(host \S+\) made the others wait (\d+) ms per step "
    r"\(median of steps (\d+)-(\d+), \d+ % of the step\); its time went to \(this rank/a typical rank\): data (\d+)/"
)


@pytest.fixture(scope="module")
def job():
    result = run_mpi(
        4,
        [sys.executable, "tests/straggler_job.py"],
        timeout=TIME_LIMIT_S,
        env={"HPCDDP_STRAGGLER_EVERY": "20", "PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-5000:]
    lines, reports = {}, {}
    for text in result.stdout.splitlines():
        kind, _, rest = text.partition(" ")
        if kind in ("LINE", "REPORT"):
            phase, _, body = rest.partition(" ")
            if kind == "LINE":
                lines.setdefault(phase, []).append(body)
            else:
                reports[phase] = json.loads(body)
    return lines, reports, result.stdout


def named(lines, phase):
    """(rank, ms, first step, last step, data ms) of each straggler line of ``phase``."""
    found = []
    for text in lines.get(phase, []):
        match = LINE.match(text)
        assert match, text
        found.append(tuple(int(g) for g in match.groups()))
    return found


def test_a_rank_that_sleeps_before_its_forward_is_named_with_its_wait(job):
    lines, reports, _ = job
    found = named(lines, "one-slow")
    assert found and {rank for rank, *_ in found} == {2}, lines.get("one-slow")
    assert all(25 <= ms <= 60 and last <= 80 and data >= 25 for _, ms, _, last, data in found), found
    assert [rank for rank, _ in reports["one-slow"]["stragglers"]] == [2]


def test_a_balanced_job_names_nobody(job):
    lines, reports, _ = job
    assert "balanced" not in lines, lines["balanced"]
    assert reports["balanced"] == {"first_step": 141, "last_step": 160, "stragglers": []}


def test_two_slow_ranks_are_both_named(job):
    lines, reports, _ = job
    found = named(lines, "two-slow")
    assert {rank for rank, *_ in found} == {1, 3}, lines.get("two-slow")
    assert all(25 <= ms <= 60 for _, ms, *_ in found), found
    assert sorted(rank for rank, _ in reports["two-slow"]["stragglers"]) == [1, 3]


def test_windows_in_which_a_rank_shadows_the_others_in_join_are_not_reported(job):
    lines, reports, _ = job
    assert "join" not in lines, lines["join"]
    assert reports["join"]["last_step"] == 40  # the window ending at 60 had rank 0 shadowing: dropped


def test_the_horovod_optimizer_reports_and_shutdown_reports_the_last_steps(job):
    lines, reports, _ = job
    assert {rank for rank, *_ in named(lines, "horovod")} == {3}
    ((rank, ms, first, last, _),) = named(lines, "shutdown")
    assert (rank, first, last) == (3, 61, 70) and 25 <= ms <= 60
    assert reports["shutdown"]["last_step"] == 70


def test_asynchronous_averaging_names_the_rank_with_the_fewest_steps_per_second(job):
    lines, reports, _ = job
    assert reports["async"]["slow"] == [1], reports["async"]
    rates = reports["async"]["steps_per_s"]
    assert rates[1] < 0.75 * min(rates[0], rates[2], rates[3]), rates
    (line,) = lines["async"]
    assert line.startswith("hpcddp: straggler: rank 1 (host ") and " steps/s where a typical rank ran " in line


HPCDDP_RUN_JOB = """
import time
import torch
import torch.nn.functional as F
import hpcddp

hpcddp.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = hpcddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for _ in range(40):
    if hpcddp.rank() == 1:
        time.sleep(0.040)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
hpcddp.shutdown()
"""


def test_hpcddp_run_repeats_the_last_report_at_the_end_of_the_job(tmp_path):
    from hpcddp.testing import run_command

    script = tmp_path / "job.py"
    script.write_text(HPCDDP_RUN_JOB)
    result = run_command(
        [sys.executable, "-m", "hpcddp.cli", "run", "-np", "2", str(script)],
        TIME_LIMIT_S,
        env={"HPCDDP_STRAGGLER_EVERY": "20"},
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stdout[-5000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("[hpcddp run] last report: ")]
    assert len(summary) == 1 and summary[0].startswith("[hpcddp run] last report: straggler: rank 1 (host "), (
        result.stdout[-3000:]
    )
    assert "median of steps 21-40" in summary[0]
