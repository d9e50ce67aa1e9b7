"""Name the straggler: which rank made the others wait, by how much, and where its time went.

    mpirun -np 64 python train.py          # a report every 200 steps; HPCDDP_STRAGGLER_EVERY=0 turns it off

    hpcddp: straggler: rank 2 (host n3) made the others wait 41 ms per step (median of steps
    60-79, 87 % of the step); its time went to (this rank/a typical rank): data 40/0.1 ms,
    forward 1.0/0.8 ms, backward 0.4/0.3 ms, optimizer 0.4/0.4 ms, other 0.1/0.1 ms

Each rank records its step times and sends rank 0 their medians once per window
(``hpcddp.observe.step_times``: the rules of that collective); this module is what rank 0
makes of them, and the reports' data.

Rank 0 keeps the last report (``straggler_report``) and, under ``hpcddp run``, leaves its
lines in the run's status directory (``RUN_STATUS_FILE``), which ``hpcddp run`` prints again
at the end of the job. An optimizer over a process set reports to the set's first rank
(the lines name ranks in the job); with several sets each first rank writes the same file,
and the last report written is the one ``hpcddp run`` prints. ``AsyncModelAverager``, where nobody waits, reports each rank's steps
per second when it closes (``report_step_rates``, inside its collective ``close()``). Horovod's
``DistributedOptimizer(op=hvd.Adasum)`` steps outside these reductions and reports nothing.

The verdict: the *baseline* is the ``BASELINE_QUANTILE`` quantile of the ranks' median
compute (a low quantile, so that several slow ranks do not raise it, as they would a median);
a rank whose compute exceeds it by more than ``max(MIN_WAIT_S, MIN_SHARE x the median
step)`` is a straggler, and the excess is how long it made the others wait per step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import socket
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from ..env.files import read_text_no_follow, write_atomically
from ..env.settings import MIN_STRAGGLER_STEPS, read_straggler_every, run_status_dir
from ..runtime import state

__all__ = [
    "BASELINE_QUANTILE",
    "FIELDS",
    "MIN_ROWS",
    "MIN_SHARE",
    "MIN_WAIT_S",
    "NUM_TIMES",
    "RankTimes",
    "Straggler",
    "StepRateReport",
    "StragglerReport",
    "describe",
    "gather_to_rank_0",
    "job_rank",
    "judge",
    "publish",
    "report_step_rates",
    "run_status_lines",
    "straggler_report",
    "unpack",
]

log = logging.getLogger("hpcddp")

#: what each rank sends per window, in this order (medians in seconds; rank, node and steps as numbers)
FIELDS = (
    "step",
    "wait",
    "compute",
    "data",
    "forward",
    "data_forward",
    "backward",
    "optimizer",
    "other",
    "rank",
    "node",
    "steps",
)
_F = {name: index for index, name in enumerate(FIELDS)}
#: the per-step times at the head of ``FIELDS`` (what ``step_times`` records each step)
NUM_TIMES = _F["rank"]
#: the quantile of the ranks' compute that counts as an unhindered rank's
BASELINE_QUANTILE = 0.25
# Both thresholds must be crossed. Measured on a 2-core machine running 4 ranks beside other
# jobs (load 5-7, docs/guide/stragglers.md): over 140 balanced windows of 20 small steps the slowest
# rank's median compute exceeded the baseline by at most 15 ms (52 % of a 29 ms step: ranks
# sharing a core) and, over 20 windows of 8.4M-parameter steps (200-700 ms), by 42 ms (19 %) and 64 ms (10 %).
#: a rank is named only when it makes the others wait longer than this per step ...
MIN_WAIT_S = 0.020
#: ... and longer than this share of the median step
MIN_SHARE = 0.25
#: rows (steps) every rank must have in a window before rank 0 names anyone: a median of fewer is noise
MIN_ROWS = MIN_STRAGGLER_STEPS
#: stragglers named one by one per report; the rest are counted in one more line
MAX_NAMED = 8
#: the file in ``hpcddp run``'s status directory (HPCDDP_RUN_STATUS) holding rank 0's last report
RUN_STATUS_FILE = "stragglers.txt"


@dataclass(frozen=True)
class RankTimes:
    """One rank's medians over a window, in milliseconds (NaN where this rank could not tell).

    Args:
        rank: the rank (in the job, not in a process set).
        host: its host name.
        step_ms: time from the end of one ``step()`` to the end of the next.
        wait_ms: time spent waiting for the gradient reductions.
        compute_ms: step minus wait: the rank's own work.
        data_ms: end of the previous step to the first call of a module with parameters.
        forward_ms: from there to the start of backward.
        data_forward_ms: data and forward together (known when backward ran, even without modules).
        backward_ms: the backward pass (the wait after it excluded).
        optimizer_ms: the rest of ``step()``.
        other_ms: what is left of the compute (clipping, logging, evaluation).
    """

    rank: int
    host: str
    step_ms: float
    wait_ms: float
    compute_ms: float
    data_ms: float
    forward_ms: float
    data_forward_ms: float
    backward_ms: float
    optimizer_ms: float
    other_ms: float


@dataclass(frozen=True)
class Straggler:
    """A rank that made the others wait.

    Args:
        rank: the rank.
        host: its host name.
        waited_ms: how long it made the others wait per step: its compute minus the baseline.
        share: that as a share of the median step.
        times: its medians.
    """

    rank: int
    host: str
    waited_ms: float
    share: float
    times: RankTimes


@dataclass(frozen=True)
class StragglerReport:
    """The verdict on one window of steps (rank 0's; see ``straggler_report``).

    Args:
        first_step: the first step of the window (steps count from 1).
        last_step: its last step.
        step_ms: the median step time over the ranks.
        baseline_ms: the compute of an unhindered rank (``BASELINE_QUANTILE`` of the ranks').
        stragglers: the ranks that made the others wait, slowest first (empty: a balanced window).
        typical: the median over the other ranks of each figure (rank -1).
        table: every rank's medians as rank 0 received them (one row of ``FIELDS``, in seconds, per rank).
        hosts: the ranks' host names.
        optimizer: which optimizer ("DistributedOptimizer #2"), where the job made more than one.
    """

    first_step: int
    last_step: int
    step_ms: float
    baseline_ms: float
    stragglers: tuple[Straggler, ...]
    typical: RankTimes
    table: torch.Tensor = dataclasses.field(repr=False, compare=False)
    hosts: tuple[str, ...] = dataclasses.field(repr=False, compare=False)
    optimizer: str = ""

    @functools.cached_property
    def ranks(self) -> tuple[RankTimes, ...]:
        """Every rank's medians, in rank order (made when first read: thousands of objects at scale)."""
        rows = self.table.tolist()
        return tuple(_rank_times(row, self.hosts[i] if i < len(self.hosts) else "") for i, row in enumerate(rows))


@dataclass(frozen=True)
class StepRateReport:
    """Each rank's steps per second under ``AsyncModelAverager``, where no rank waits for another.

    Args:
        seconds: the longest time a rank averaged (from the averager's start to its ``close()``).
        steps_per_s: each rank's steps per second, in rank order.
        typical: the ``1 - BASELINE_QUANTILE`` quantile of the ranks' rates (an unhindered rank's).
        slow: the ranks whose steps took more than ``MIN_WAIT_S`` and ``MIN_SHARE`` longer than
            a typical rank's, slowest first.
        hosts: the ranks' host names.
        ranks: the ranks (in the job) whose rates ``steps_per_s`` holds, in that order.
    """

    seconds: float
    steps_per_s: tuple[float, ...]
    typical: float
    slow: tuple[int, ...]
    hosts: tuple[str, ...] = dataclasses.field(repr=False, compare=False)
    ranks: tuple[int, ...] = dataclasses.field(repr=False, compare=False, default=())


_last_report: StragglerReport | StepRateReport | None = None


def straggler_report() -> StragglerReport | StepRateReport | None:
    """Return the last straggler report, on rank 0; None on the other ranks and before the first.

    With a process set (Horovod's ``process_set=``) the report is on the set's first rank
    instead, and each set's first rank keeps its own. A ``StragglerReport`` covers one
    window of ``HPCDDP_STRAGGLER_EVERY`` steps of a ``DistributedOptimizer`` (the last one
    to report when several do); a balanced window gives a report with no stragglers. An
    ``AsyncModelAverager`` reports each rank's steps per second when it closes
    (``StepRateReport``).
    """
    return _last_report


def publish(report: StragglerReport | StepRateReport) -> None:
    """Keep ``report`` as the last one and log its lines (rank 0), also for ``hpcddp run``'s end-of-job summary."""
    global _last_report
    _last_report = report
    if isinstance(report, StragglerReport):
        named = [describe(s, report) for s in report.stragglers]
        rest = report.stragglers[MAX_NAMED:]
        more = rest and (
            f"straggler: {len(rest)} more ranks made the others wait {rest[-1].waited_ms:.0f}-{rest[0].waited_ms:.0f} "
            f"ms per step (hosts {', '.join(sorted({s.host for s in rest})[:8])})"
        )
        quiet = f"no straggler in steps {report.first_step}-{report.last_step} (median step {report.step_ms:.0f} ms)"
    else:
        named = [_describe_rate(report, report.ranks.index(rank)) for rank in report.slow]
        more = f"straggler: {len(named) - MAX_NAMED} more slow ranks"
        quiet = f"no straggler in {report.seconds:.0f} s of asynchronous averaging"
    lines = named[:MAX_NAMED] + ([f"{more}; hpcddp.straggler_report() has them"] if len(named) > MAX_NAMED else [])
    for line in lines:
        log.warning("hpcddp: %s", line)
    _write_run_status(lines or [quiet])


def _write_run_status(lines: list[str]) -> None:
    """Leave the last report's lines in ``hpcddp run``'s status directory, for its end-of-job summary."""
    directory = run_status_dir(os.environ)
    if directory is None:
        return
    text = "".join(f"{line}\n" for line in lines).encode()
    try:
        write_atomically(Path(directory) / RUN_STATUS_FILE, lambda file: file.write(text), "straggler report")
    except OSError:  # not shared with rank 0's node, or gone: the lines were logged all the same
        pass


def run_status_lines(directory: str) -> list[str]:
    """Return the lines of the last straggler report a job's rank 0 left in ``hpcddp run``'s status directory.

    Args:
        directory: the job's status directory (HPCDDP_RUN_STATUS).
    """
    try:
        text = read_text_no_follow(Path(directory) / RUN_STATUS_FILE)
    except OSError:  # no report (a short job, reports off), or not a regular file (a planted link)
        return []
    return [line for line in text.split("\n") if line]


def report_step_rates(comm, num_steps: int, seconds: float) -> StepRateReport | None:
    """Gather every rank's steps per second on rank 0 and name the slow ranks there; collective over ``comm``.

    For asynchronous averaging, where a fast rank never waits for a slow one: what a slow rank
    costs is that its model lags and its batches are fewer, so the rates are the figure.
    Returns the report on rank 0, None elsewhere (and when HPCDDP_STRAGGLER_EVERY is 0 on
    some rank, or ``comm`` has one rank). The gather runs whatever the setting, so that ranks
    given different values (mpirun without ``-x`` on other hosts) never split it.

    Args:
        comm: the averager's communicator.
        num_steps: optimizer steps this rank took.
        seconds: over how long.
    """
    if comm.size == 1:
        return None
    on = read_straggler_every(os.environ) > 0
    gathered = gather_to_rank_0(comm, [num_steps, seconds, job_rank(comm)[0], on], True)
    if gathered is None or not bool(gathered[0][:, 3].all()):
        return None
    table, hosts = gathered
    rates = table[:, 0] / table[:, 1].clamp(min=1e-9)
    typical = float(torch.quantile(rates, 1 - BASELINE_QUANTILE, interpolation="higher"))
    # Slower by more than both thresholds, as a synchronous straggler: per step, in seconds and as a share.
    typical_step = 1.0 / typical if typical > 0 else math.inf
    slow = _slowest(1.0 / rates.clamp(min=1e-9) - typical_step, typical_step)
    report = StepRateReport(
        seconds=float(table[:, 1].max()),
        steps_per_s=tuple(rates.tolist()),
        typical=typical,
        slow=tuple(int(table[i, 2]) for i in slow),
        hosts=tuple(hosts),
        ranks=tuple(int(r) for r in table[:, 2].tolist()),
    )
    publish(report)
    return report


def _describe_rate(report: StepRateReport, i: int) -> str:
    host = f" (host {report.hosts[i]})" if report.hosts[i] else ""
    return (
        f"straggler: rank {report.ranks[i]}{host} ran {report.steps_per_s[i]:.1f} steps/s where a typical rank ran "
        f"{report.typical:.1f} (asynchronous averaging: nobody waited for it, its model lagged and it trained on "
        "fewer batches)"
    )


def job_rank(comm) -> tuple[int, int]:
    """This rank's rank and node in the job (not in a process set's communicator)."""
    return (state.rank(), state.node_rank()) if state.is_initialized() else (comm.rank, 0)


def gather_to_rank_0(comm, values: list[float], with_host: bool) -> tuple[torch.Tensor, list[str]] | None:
    """Send ``values`` (float64) and, ``with_host``, this host's name to rank 0 in one gather (collective over ``comm``).

    Returns rank 0's table (a row of ``values`` per rank) and host names; None elsewhere.
    """
    payload = array("d", values).tobytes() + (socket.gethostname().encode()[:255] if with_host else b"")
    payloads = comm.gather_object(payload, 0)
    return None if payloads is None else unpack(payloads, len(values))


# -- the verdict, on rank 0 -------------------------------------------------------------------
def unpack(payloads: list[bytes], num_values: int = len(FIELDS)) -> tuple[torch.Tensor, list[str]]:
    """Return the table the ranks sent (one row of ``num_values`` per rank: ``FIELDS``) and their host names.

    Args:
        payloads: what each rank sent, in rank order: ``num_values`` float64, then its host
            name (UTF-8) in the first report only ("" after).
        num_values: the numbers in each payload.
    """
    width = 8 * num_values
    table = torch.frombuffer(bytearray(b"".join(p[:width] for p in payloads)), dtype=torch.float64)
    return table.view(len(payloads), num_values), [p[width:].decode(errors="replace") for p in payloads]


def judge(
    table: torch.Tensor, hosts: list[str], first_step: int, last_step: int, optimizer: str = ""
) -> StragglerReport:
    """Name the ranks that made the others wait, from every rank's medians.

    Args:
        table: one row of ``FIELDS`` per rank, in seconds, in rank order.
        hosts: the ranks' host names ("" or missing: unknown).
        first_step: the window's first step.
        last_step: its last step.
        optimizer: the optimizer the lines name ("": the job's only one).
    """
    num_ranks = table.shape[0]
    compute = table[:, _F["compute"]]
    step = float(table[:, _F["step"]].median())
    # "lower": a rank's own figure, never one interpolated towards the slow ones (at 2 ranks, 3/4 of the way).
    baseline = float(torch.quantile(compute, BASELINE_QUANTILE, interpolation="lower"))
    excess = compute - baseline
    slow = _slowest(excess, step)
    others = torch.ones(num_ranks, dtype=torch.bool)
    others[slow] = False
    typical = dataclasses.replace(_rank_times(table[others].nanmedian(dim=0).values.tolist(), ""), rank=-1)
    stragglers = []
    for i in slow:
        times = _rank_times(table[i].tolist(), hosts[i] if i < len(hosts) else "")
        waited = float(excess[i])
        share = waited / step if step > 0 else math.inf
        stragglers.append(Straggler(rank=times.rank, host=times.host, waited_ms=waited * 1e3, share=share, times=times))
    return StragglerReport(
        first_step=first_step,
        last_step=last_step,
        step_ms=step * 1000.0,
        baseline_ms=baseline * 1000.0,
        stragglers=tuple(stragglers),
        typical=typical,
        table=table,
        hosts=tuple(hosts),
        optimizer=optimizer,
    )


# _rank_times fills RankTimes in FIELDS' order.
assert [f.name for f in dataclasses.fields(RankTimes)][2:] == [f"{name}_ms" for name in FIELDS[:NUM_TIMES]]


def _slowest(excess: torch.Tensor, step: float) -> list[int]:
    """Return the indices whose ``excess`` seconds per step exceed both thresholds (``step``: the median step), largest first."""
    slow = (excess > max(MIN_WAIT_S, MIN_SHARE * step)).nonzero().flatten()
    return slow[excess[slow].argsort(descending=True)].tolist()


def _rank_times(values: list[float], host: str) -> RankTimes:
    return RankTimes(int(values[_F["rank"]]), host, *(1000.0 * v for v in values[:NUM_TIMES]))


def describe(straggler: Straggler, report: StragglerReport) -> str:
    """Return the one line that names ``straggler`` (without the "hpcddp: " prefix).

    Args:
        straggler: one of ``report.stragglers``.
        report: its report.
    """
    mine, typical = straggler.times, report.typical
    if math.isnan(mine.backward_ms):  # no backward pass of the optimizer's (gradients assigned by hand)
        parts = ([] if math.isnan(mine.data_ms) else ["data"]) + ["optimizer", "other"]
    elif math.isnan(mine.data_ms) or math.isnan(typical.data_ms):
        parts = ["data_forward", "backward", "optimizer", "other"]
    else:
        parts = ["data", "forward", "backward", "optimizer", "other"]
    went = ", ".join(
        f"{name.replace('_', '+')} {_ms(getattr(mine, name + '_ms'))}/{_ms(getattr(typical, name + '_ms'))} ms"
        for name in parts
    )
    host = f" (host {straggler.host})" if straggler.host else ""
    return (
        f"straggler: rank {straggler.rank}{host} made the others wait {straggler.waited_ms:.0f} ms per step "
        f"({report.optimizer + ', ' if report.optimizer else ''}median of steps {report.first_step}-{report.last_step}, "
        f"{100 * straggler.share:.0f} % of the step); "
        f"its time went to (this rank/a typical rank): {went}"
    )


def _ms(value: float) -> str:
    if math.isnan(value):
        return "?"
    return f"{value:.1f}" if value < 9.95 else f"{value:.0f}"
