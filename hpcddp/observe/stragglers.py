"""Name the straggler: which rank made the others wait, by how much, and where its time went.

    mpirun -np 64 python train.py          # a report every 200 steps; HPCDDP_STRAGGLER_EVERY=0 turns it off

    hpcddp: straggler: rank 2 (host n3) made the others wait 41 ms per step (median of steps
    61-80, 87 % of the step); its time went to (this rank/a typical rank): data 40/0.1 ms,
    forward 1.0/0.8 ms, backward 0.4/0.3 ms, optimizer 0.4/0.4 ms, other 0.1/0.1 ms

The rules, written once here. The optimizer calls ``StepTimeRecorder.step_done`` when each
``step()`` ends (in a ``finally``) and its reducer calls ``reduction_done`` when each gradient
reduction completes; nothing else calls in.

1. **Per step, clocks only.** ``step_done`` stores one row of ``time.perf_counter()``
   differences in a ring (at most ``MAX_WINDOW`` rows, preallocated), and only for a step
   whose gradient reduction finished since the last row (none after ``close()``, none for a
   step without a backward pass): the time from the end of the previous ``step()`` to the
   end of this one, split into

   - *wait*: the time the reducer spent finishing the step's reductions
     (``ReductionTimes.wait_total``): a rank that is ahead waits there for the others;
   - *data*: from the end of the previous step to the first call of a module that has
     parameters (a global forward pre-hook armed at the end of each step, removed by its
     first call: one module call per step takes torch's hooked path);
   - *forward*: from there to the first gradient hook of the step's last backward pass;
   - *backward*: that pass, up to its end (the wait comes after it);
   - *optimizer*: the rest of ``step()`` after any wait in it;
   - *other*: what is left (clipping, GradScaler, logging, evaluation).

   A rank's own compute is its step-to-step time minus its wait. No collective, no host
   synchronisation; the hook's handle is the one object made per step.
2. **One gather per window, inside a reduction.** Windows are counted in the reducer's
   completed reductions (``Reducer.num_reductions``), which every rank completes alike: when
   reduction N ends and N is a multiple of ``every``, the reducer calls ``reduction_done``
   before the reduction returns, and every rank sends the medians of its window (``FIELDS``,
   float64; its host name too, the first time only) to rank 0 in one ``gather_object`` on the
   optimizer's gradient channel (``Communicator.gradient_channel``), right after the
   reduction's last bucket. A rank that completed the reduction is in the gather; a rank that
   did not leaves the others waiting in the reduction itself, as it would with the reports off.
   How a script steps its optimizer (a ``step()`` without backward, an error in the wrapped
   step, local steps after ``close()``) cannot change which ranks gather. O(p) bytes at rank 0
   once per window, nothing per step. Rank 0 judges the table (``judge``) and prints one line
   per straggler, once every rank has at least ``MIN_ROWS`` rows in the window.
3. **Only windows in which every rank stepped with data.** While some rank has run out of data
   (``hpcddp.join``, Horovod's ``join``) it shadows the others' steps and would count as the
   fastest rank: the reductions carry how many ranks had data (the same number on every rank),
   and a window with any such reduction is dropped on every rank alike. At world size 1, or with
   ``every=0``, nothing is recorded at all.
4. **Nothing at shutdown.** ``hpcddp.shutdown()`` gathers nothing (ranks may reach it after
   different numbers of steps, or not at all): the end-of-job report is the last window's.

Rank 0 keeps the last report (``straggler_report``) and, under ``hpcddp run``, leaves its
lines in the run's status directory (``RUN_STATUS_FILE``), which ``hpcddp run`` prints again
at the end of the job. ``AsyncModelAverager``, where nobody waits, reports each rank's steps
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
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ..env.files import read_text_no_follow, write_atomically
from ..env.settings import read_straggler_every, run_status_dir
from ..runtime import state
from . import timeline

__all__ = [
    "BASELINE_QUANTILE",
    "FIELDS",
    "MIN_ROWS",
    "MIN_SHARE",
    "MIN_WAIT_S",
    "RankTimes",
    "Straggler",
    "StepRateReport",
    "StepTimeRecorder",
    "StragglerReport",
    "describe",
    "judge",
    "recorder_for",
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
#: the per-step columns of the ring (the first ``_ROW`` of ``FIELDS``)
_ROW = _F["rank"]
#: steps a window's medians are taken over at most (the last ones before the report)
MAX_WINDOW = 1024
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
MIN_ROWS = 5
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
    """

    seconds: float
    steps_per_s: tuple[float, ...]
    typical: float
    slow: tuple[int, ...]
    hosts: tuple[str, ...] = dataclasses.field(repr=False, compare=False)


_last_report: StragglerReport | StepRateReport | None = None
#: recorders made in this process (one per DistributedOptimizer): lines name the optimizer past the first
_num_recorders = 0


def straggler_report() -> StragglerReport | StepRateReport | None:
    """Return the last straggler report, on rank 0; None on the other ranks and before the first.

    A ``StragglerReport`` covers one window of ``HPCDDP_STRAGGLER_EVERY`` steps of a
    ``DistributedOptimizer`` (the last one made when several report), or the steps before
    ``hpcddp.shutdown()``; a balanced window gives a report with no stragglers. An
    ``AsyncModelAverager`` reports each rank's steps per second when it closes
    (``StepRateReport``).
    """
    return _last_report


def recorder_for(record_timeline: bool) -> StepTimeRecorder | None:
    """Return a recorder for one optimizer, or None when HPCDDP_STRAGGLER_EVERY is 0.

    Args:
        record_timeline: mark each report in ``hpcddp.observe.timeline`` when one is recorded.
    """
    every = read_straggler_every(os.environ)
    return StepTimeRecorder(every, record_timeline=record_timeline) if every else None


class StepTimeRecorder:
    """One optimizer's step times on this rank, reported to rank 0 every ``every`` reductions.

    Args:
        every: reductions per report (> 0).
        record_timeline: mark each report in the timeline when one is recorded.
    """

    def __init__(self, every: int, *, record_timeline: bool = False) -> None:
        if every <= 0:
            raise ValueError(f"every must be > 0, got {every}")
        global _num_recorders
        _num_recorders += 1
        #: which recorder of this process this is (the same on every rank: optimizers are made collectively)
        self.number = _num_recorders
        self.every = every
        self._record_timeline = record_timeline
        self._capacity = min(every, MAX_WINDOW)
        self._ring = array("d", bytes(8 * self._capacity * _ROW))
        self._num_rows = 0
        self._partial = False
        self._hook = None
        self._forward_at = 0.0
        self._comm = None
        self._sent_host = False
        self._hosts: list[str] = []
        self._times = None
        self._prev_end: float | None = None
        self._wait_seen = 0.0
        self._reductions_seen = 0

    # -- per step, local ----------------------------------------------------------------------
    def step_done(self, started: float, times, num_reductions: int) -> None:
        """Note that ``step()`` ended; store its row when a reduction finished since the last one.

        Local: no collective. Called in ``step()``'s ``finally``, also when the step raised.

        Args:
            started: when ``step()`` was entered.
            times: the reducer's ``ReductionTimes``.
            num_reductions: the reducer's completed reductions now.
        """
        now = time.perf_counter()
        if times is not self._times:  # a new reducer (rebind_): its counts start afresh
            self._times, self._prev_end = times, None
            self._wait_seen, self._reductions_seen = times.wait_total, num_reductions
        wait = times.wait_total - self._wait_seen
        if num_reductions != self._reductions_seen and self._prev_end is not None:
            self._store(self._prev_end, started, now, wait, times)
        self._wait_seen, self._reductions_seen = times.wait_total, num_reductions
        self._prev_end = time.perf_counter()
        self._forward_at = 0.0
        if self._hook is None:
            self._hook = register_module_forward_pre_hook(self._on_forward)

    def stop(self) -> None:
        """Disarm the forward hook (the optimizer's reducer was closed: its steps are local from now on)."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    def _on_forward(self, mod, inputs) -> None:
        # A loss or a transform without parameters called before the model is data, not forward.
        if next(mod.parameters(), None) is None:
            return
        self._forward_at = time.perf_counter()
        self.stop()

    def _store(self, prev: float, started: float, now: float, wait: float, times) -> None:
        nan = math.nan
        interval = now - prev
        wait = min(max(wait, 0.0), interval)
        compute = interval - wait
        begin, end = times.backward_start, times.backward_end
        data = forward = data_forward = backward = nan
        if prev < begin <= end:
            backward = end - begin
            data_forward = begin - prev
            if prev < self._forward_at <= begin:
                data, forward = self._forward_at - prev, begin - self._forward_at
        optimizer = now - max(started, times.wait_end)
        other = compute - optimizer - (0.0 if math.isnan(backward) else data_forward + backward)
        row = (self._num_rows % self._capacity) * _ROW
        values = (interval, wait, compute, data, forward, data_forward, backward, optimizer, max(other, 0.0))
        self._ring[row : row + _ROW] = array("d", values)
        self._num_rows += 1

    # -- per reduction: collective over the reduction's ranks at a window's end ---------------
    def reduction_done(self, num_reductions: int, active_ranks: int, comm) -> None:
        """Note that reduction ``num_reductions`` completed; at a window's end, report it (collective).

        Called by the reducer on every rank that completed the reduction, before it returns,
        with numbers every rank has alike.

        Args:
            num_reductions: the reducer's completed reductions, this one included.
            active_ranks: ranks that had data in it (all, unless a join is on).
            comm: the communicator of the reduction's buckets (the gradient channel's).
        """
        self._partial |= active_ranks < comm.size
        if num_reductions % self.every:
            return
        if not self._partial:  # rule 3
            self._report(comm, num_reductions)
        self._num_rows, self._partial = 0, False

    def _medians(self) -> list[float]:
        rows = min(self._num_rows, self._capacity)
        if rows == 0:
            return [math.nan] * _ROW
        window = torch.frombuffer(self._ring, dtype=torch.float64)[: rows * _ROW].view(rows, _ROW)
        return window.nanmedian(dim=0).values.tolist()

    def _report(self, comm, last: int) -> None:
        """Send this window's medians to rank 0 (collective over ``comm``); rank 0 judges and prints."""
        started = time.perf_counter()
        if comm is not self._comm:  # another reducer's channel (rebind_): send the host names again
            self._comm, self._sent_host = comm, False
        rank = state.rank() if state.is_initialized() else comm.rank
        node = state.node_rank() if state.is_initialized() else 0
        rows = min(self._num_rows, self._capacity)
        payload = array("d", [*self._medians(), rank, node, rows]).tobytes()
        if not self._sent_host:
            payload += socket.gethostname().encode()[:255]
        first_report = not self._sent_host
        self._sent_host = True
        payloads = comm.gather_object(payload, 0)
        report = None
        if payloads is not None:
            try:  # rank 0's own work: an error here must not leave it out of step with the others
                report = self._judge(payloads, first_report, last)
            except Exception:
                log.exception("hpcddp: straggler report of steps %d-%d failed on rank 0", last - self.every + 1, last)
        self._mark(started, report)

    def _judge(self, payloads: list[bytes], first_report: bool, last: int) -> StragglerReport | None:
        table, hosts = unpack(payloads)
        if first_report:
            self._hosts = hosts
        if int(table[:, _F["steps"]].min()) < MIN_ROWS:
            return None  # too few steps on some rank to tell noise from a straggler
        label = f"DistributedOptimizer #{self.number}" if _num_recorders > 1 else ""
        report = judge(table, self._hosts, max(1, last - self.every + 1), last, optimizer=label)
        _publish(report)
        return report

    def _mark(self, started: float, report: StragglerReport | None) -> None:
        recorder = timeline.current() if self._record_timeline else None
        if recorder is None:
            return
        args = {}
        if report is not None:
            args = {
                "steps": f"{report.first_step}-{report.last_step}",
                "stragglers": ", ".join(f"rank {s.rank} {s.waited_ms:.0f} ms" for s in report.stragglers) or "none",
            }
        recorder.span("straggler report", started, time.perf_counter(), **args)


def _publish(report: StragglerReport) -> None:
    global _last_report
    _last_report = report
    lines = [describe(s, report) for s in report.stragglers[:MAX_NAMED]]
    if len(report.stragglers) > MAX_NAMED:
        rest = report.stragglers[MAX_NAMED:]
        lines.append(
            f"straggler: {len(rest)} more ranks made the others wait {rest[-1].waited_ms:.0f}-{rest[0].waited_ms:.0f} "
            f"ms per step (hosts {', '.join(sorted({s.host for s in rest})[:8])}); hpcddp.straggler_report() has them"
        )
    for line in lines:
        log.warning("hpcddp: %s", line)
    _write_run_status(
        lines or [f"no straggler in steps {report.first_step}-{report.last_step} (median step {report.step_ms:.0f} ms)"]
    )


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
    Returns the report on rank 0, None elsewhere (and when HPCDDP_STRAGGLER_EVERY is 0 or
    ``comm`` has one rank).

    Args:
        comm: the averager's communicator.
        num_steps: optimizer steps this rank took.
        seconds: over how long.
    """
    if comm.size == 1 or not read_straggler_every(os.environ):
        return None
    rank = state.rank() if state.is_initialized() else comm.rank
    payload = array("d", [num_steps, seconds, rank]).tobytes() + socket.gethostname().encode()[:255]
    payloads = comm.gather_object(payload, 0)
    if payloads is None:
        return None
    rows = [array("d", p[:24]) for p in payloads]
    rates = torch.tensor([steps / max(secs, 1e-9) for steps, secs, _ in rows], dtype=torch.float64)
    typical = float(torch.quantile(rates, 1 - BASELINE_QUANTILE, interpolation="higher"))
    # Slower by more than both thresholds, as a synchronous straggler: per step, in seconds and as a share.
    typical_step = 1.0 / typical if typical > 0 else math.inf
    extra = 1.0 / rates.clamp(min=1e-9) - typical_step
    slow = (extra > max(MIN_WAIT_S, MIN_SHARE * typical_step)).nonzero().flatten()
    slow = slow[rates[slow].argsort()].tolist()
    report = StepRateReport(
        seconds=max(secs for _, secs, _ in rows),
        steps_per_s=tuple(rates.tolist()),
        typical=typical,
        slow=tuple(int(rows[i][2]) for i in slow),
        hosts=tuple(p[24:].decode(errors="replace") for p in payloads),
    )
    global _last_report
    _last_report = report
    lines = []
    for i in slow[:MAX_NAMED]:
        host = f" (host {report.hosts[i]})" if report.hosts[i] else ""
        lines.append(
            f"straggler: rank {int(rows[i][2])}{host} ran {report.steps_per_s[i]:.1f} steps/s where a typical rank "
            f"ran {typical:.1f} (asynchronous averaging: nobody waited for it, its model lagged and it trained on "
            "fewer batches)"
        )
    if len(slow) > MAX_NAMED:
        lines.append(f"straggler: {len(slow) - MAX_NAMED} more slow ranks; hpcddp.straggler_report() has them")
    for line in lines:
        log.warning("hpcddp: %s", line)
    _write_run_status(lines or [f"no straggler in {report.seconds:.0f} s of asynchronous averaging"])
    return report


# -- the verdict, on rank 0 -------------------------------------------------------------------
def unpack(payloads: list[bytes]) -> tuple[torch.Tensor, list[str]]:
    """Return the table of the ranks' medians (one row of ``FIELDS`` per rank) and the host names they sent.

    Args:
        payloads: what each rank sent, in rank order: ``FIELDS`` as float64, then its host
            name (UTF-8) in the first report only ("" after).
    """
    width = 8 * len(FIELDS)
    table = torch.frombuffer(bytearray(b"".join(p[:width] for p in payloads)), dtype=torch.float64)
    return table.view(len(payloads), len(FIELDS)), [p[width:].decode(errors="replace") for p in payloads]


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
    threshold = max(MIN_WAIT_S, MIN_SHARE * step)
    excess = compute - baseline
    slow = (excess > threshold).nonzero().flatten()
    slow = slow[excess[slow].argsort(descending=True)].tolist()
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
assert [f.name for f in dataclasses.fields(RankTimes)][2:] == [f"{name}_ms" for name in FIELDS[:_ROW]]


def _rank_times(values: list[float], host: str) -> RankTimes:
    return RankTimes(int(values[_F["rank"]]), host, *(1000.0 * v for v in values[:_ROW]))


def describe(straggler: Straggler, report: StragglerReport) -> str:
    """Return the one line that names ``straggler`` (without the "hpcddp: " prefix).

    Args:
        straggler: one of ``report.stragglers``.
        report: its report.
    """
    mine, typical = straggler.times, report.typical
    if math.isnan(mine.data_ms) or math.isnan(typical.data_ms):
        parts = ["data_forward"]
    else:
        parts = ["data", "forward"]
    if math.isnan(mine.backward_ms):
        parts = []
    parts += ["backward", "optimizer", "other"] if parts else ["optimizer", "other"]
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
