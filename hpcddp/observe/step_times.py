"""Each rank's step times for the straggler reports, and the one collective that sends them to rank 0.

What rank 0 makes of them is ``hpcddp.observe.stragglers``'s. The rules, written once here:
the optimizer calls ``StepTimeRecorder.step_done`` when each ``step()`` ends (in a
``finally``) and its reducer calls ``reduction_done`` when each gradient reduction completes;
nothing else calls in.

1. **Per step, clocks only.** ``step_done`` stores one row of ``time.perf_counter()``
   differences in a ring (at most ``MAX_WINDOW`` rows, preallocated), and only for a step
   whose gradient reduction finished since the last row (none after ``close()``, none for a
   step without a backward pass): the time from the end of the previous ``step()`` to the
   end of this one, split into

   - *wait*: the time the reducer spent finishing the step's reductions, and launching its
     buckets where a launch blocks inside backward (gloo agrees on the step's calls at bucket
     0's launch, ``ReductionTimes.launch_wait``), both in ``ReductionTimes.wait_total``: a
     rank that is ahead waits there for the others;
   - *data*: from the end of the previous step to the first call of a module that holds one
     of this optimizer's parameters, itself or in its children (a global forward pre-hook armed
     at the end of each step, removed by that call: the module calls until then take torch's
     hooked path; which modules hold them is found once per module). Other models' calls (a
     second optimizer's, a teacher model) count here. When that first call runs under
     ``torch.no_grad()`` (an evaluation between steps, a frozen part of the model run first),
     the step's data and forward are not told apart: its row has *data+forward* only;
   - *forward*: from there to the first gradient hook of the step's last backward pass (a
     loss's own backward, before the first parameter's gradient, counts here too);
   - *backward*: that pass, up to its end, less its launches' blocking (the wait comes after it);
   - *optimizer*: the rest of ``step()`` after any wait in it;
   - *other*: what is left (clipping, GradScaler, logging between backward and ``step()``).

   A window is labelled with the steps whose rows it holds: the row of a step is stored when
   its ``step()`` ends, after its reduction reported the window, so the window reported in
   reduction N holds steps N-every to N-1 (numbered by their reductions).

   A rank's own compute is its step-to-step time minus its wait. No collective, no host
   synchronisation; the hook's handle is the one object made per step. The hook is armed and
   disarmed under a lock: a module called on another thread meanwhile cannot leave it armed;
   ``hpcddp.shutdown()`` and ``close()`` disarm it.
2. **One gather per window, inside a reduction.** Windows are counted in the reducer's
   completed reductions (``Reducer.num_reductions``), which every rank completes alike: when
   reduction N ends and N is a multiple of ``every``, the reducer calls ``reduction_done``
   before the reduction returns, and every rank sends the medians of its window (``FIELDS``,
   float64; its host name too, the first time only) to rank 0 in one ``gather_object`` on the
   optimizer's gradient channel (``Communicator.gradient_channel``), right after the
   reduction's last bucket (with a process set: to the set's first rank, which judges and
   prints; the lines name ranks in the job). A rank that completed the reduction is in the gather; a rank that
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
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from array import array

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from ..env.settings import read_straggler_every
from ..runtime.state import at_shutdown
from . import timeline
from .stragglers import FIELDS, MIN_ROWS, NUM_TIMES, StragglerReport, gather_to_rank_0, job_rank, judge, publish

__all__ = ["MAX_WINDOW", "StepTimeRecorder", "recorder_for"]

log = logging.getLogger("hpcddp")

#: steps a window's medians are taken over at most (the last ones before the report)
MAX_WINDOW = 1024
#: recorders made in this process (one per DistributedOptimizer, closed ones included): lines name the
#: optimizer by its place in that count once a second one was made
_num_recorders = 0
#: the recorders alive: hpcddp.shutdown() disarms their forward hooks
_recorders: weakref.WeakSet[StepTimeRecorder] = weakref.WeakSet()


def _disarm_all() -> None:
    for recorder in list(_recorders):
        recorder.stop()


def recorder_for(comm, record_timeline: bool) -> StepTimeRecorder | None:
    """Return a recorder for one optimizer, or None when HPCDDP_STRAGGLER_EVERY is 0 or ``comm`` has one rank.

    Collective over ``comm`` (from the optimizer's constructor, which is): the ranks compare
    their HPCDDP_STRAGGLER_EVERY, and where it differs (mpirun does not pass a variable to
    other hosts without ``-x``) or some rank's is not a number (set after ``init()``, which
    checks it), every rank turns the reports off alike, with a one-line warning.

    Args:
        comm: the optimizer's communicator.
        record_timeline: mark each report in ``hpcddp.observe.timeline`` when one is recorded.
    """
    if comm.size == 1:
        return None
    unset = not os.environ.get("HPCDDP_STRAGGLER_EVERY", "").strip()
    try:
        every, error = read_straggler_every(os.environ), ""
    except ValueError as err:  # set after init(), which checked it: one line, not a traceback on one rank
        every, error = -1, str(err)
    everyones = comm.allgather_object((every, unset, error))
    errors = [(rank, said) for rank, (_, _, said) in enumerate(everyones) if said]
    values = {(value, was_unset) for value, was_unset, said in everyones if not said}
    if errors or len({value for value, _ in values}) > 1:
        if comm.rank == 0 and errors:
            rank, said = errors[0]
            more = f" (and on {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
            log.warning("hpcddp: on rank %d%s: %s: straggler reports are off", rank, more, said)
        elif comm.rank == 0:
            log.warning(
                "hpcddp: HPCDDP_STRAGGLER_EVERY differs between the ranks (%s): straggler reports are off; "
                "give every rank the same value (mpirun -x HPCDDP_STRAGGLER_EVERY)",
                ", ".join(f"unset ({value})" if was_unset else str(value) for value, was_unset in sorted(values)),
            )
        return None
    return StepTimeRecorder(every, record_timeline=record_timeline) if every else None


class StepTimeRecorder:
    """One optimizer's step times on this rank, reported to rank 0 every ``every`` reductions.

    The lines name the optimizer ("DistributedOptimizer #2") by the recorder's ``number``: its
    place among the recorders made in this process, closed optimizers' included, once there
    is more than one.

    Args:
        every: reductions per report (> 0).
        record_timeline: mark each report in the timeline when one is recorded.
    """

    def __init__(self, every: int, *, record_timeline: bool = False) -> None:
        if every <= 0:
            raise ValueError(f"every must be > 0, got {every}")
        global _num_recorders
        _num_recorders += 1
        #: which recorder of this process this is: rank 0's lines name the optimizer by it (DistributedOptimizer #2)
        self.number = _num_recorders
        self.every = every
        self._record_timeline = record_timeline
        self._capacity = min(every, MAX_WINDOW)
        self._ring = array("d", bytes(8 * self._capacity * NUM_TIMES))
        self._num_rows = 0
        self._partial = False
        self._hook = None
        self._hook_lock = threading.Lock()
        self._forward_at = 0.0
        #: ids of this optimizer's parameters (the reducer's): only modules holding one start the forward
        self._parameter_ids: frozenset[int] = frozenset()
        #: module -> whether it holds one of them, itself or in its children (found at its first call)
        self._holds: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()
        #: the steps (numbered by their reductions) of the window's first and last rows
        self._first_step = self._last_step = 0
        self._comm = None
        self._sent_host = False
        self._hosts: list[str] = []
        self._times = None
        self._prev_end: float | None = None
        self._wait_seen = 0.0
        self._reductions_seen = 0
        _recorders.add(self)
        at_shutdown(_disarm_all, at_exit=False)

    # -- per step, local ----------------------------------------------------------------------
    def step_done(self, started: float, times, num_reductions: int, named) -> None:
        """Note that ``step()`` ended; store its row when a reduction finished since the last one.

        Local: no collective. Called in ``step()``'s ``finally``, also when the step raised.

        Args:
            started: when ``step()`` was entered.
            times: the reducer's ``ReductionTimes``.
            num_reductions: the reducer's completed reductions now.
            named: the reducer's (name, parameter) pairs: a call of a module holding one starts the forward.
        """
        now = time.perf_counter()
        if times is not self._times:  # a new reducer (rebind_): its counts start afresh
            self._times, self._prev_end = times, None
            self._wait_seen, self._reductions_seen = times.wait_total, num_reductions
            self._parameter_ids = frozenset(id(parameter) for _, parameter in named)
            self._holds = weakref.WeakKeyDictionary()
        wait = times.wait_total - self._wait_seen
        if num_reductions != self._reductions_seen and self._prev_end is not None:
            self._store(self._prev_end, started, now, wait, times, num_reductions)
        self._wait_seen, self._reductions_seen = times.wait_total, num_reductions
        self._prev_end = time.perf_counter()
        self._forward_at = 0.0
        with self._hook_lock:
            if self._hook is None:
                self._hook = register_module_forward_pre_hook(self._on_forward)

    def stop(self) -> None:
        """Disarm the forward hook (the optimizer's reducer was closed: its steps are local from now on)."""
        with self._hook_lock:
            hook, self._hook = self._hook, None
            if hook is not None:
                hook.remove()

    def _on_forward(self, mod, inputs) -> None:
        # Only this optimizer's model starts the forward (its top module's call, a compiled
        # wrapper's too): a loss, a transform or another model (a second optimizer's, a teacher)
        # is data. Its first call under no_grad (an evaluation, a frozen part run first) leaves
        # this step unsplit rather than calling the evaluation data or forward.
        holds = self._holds.get(mod)
        if holds is None:
            ids = self._parameter_ids
            holds = self._holds[mod] = any(id(parameter) in ids for parameter in mod.parameters())
        if not holds:
            return
        if torch.is_grad_enabled():
            self._forward_at = time.perf_counter()
        self.stop()

    def _store(self, prev: float, started: float, now: float, wait: float, times, step: int) -> None:
        nan = math.nan
        interval = now - prev
        wait = min(max(wait, 0.0), interval)
        compute = interval - wait
        begin, end = times.backward_start, times.backward_end
        data = forward = data_forward = backward = nan
        if prev < begin <= end:
            backward = max(end - begin - times.launch_wait, 0.0)
            data_forward = begin - prev
            if prev < self._forward_at <= begin:
                data, forward = self._forward_at - prev, begin - self._forward_at
        elif prev < self._forward_at <= now:  # no backward pass of ours (gradients assigned by hand): data still
            data = self._forward_at - prev
        optimizer = now - max(started, times.wait_end)
        known = data_forward + backward if not math.isnan(backward) else (0.0 if math.isnan(data) else data)
        other = compute - optimizer - known
        row = (self._num_rows % self._capacity) * NUM_TIMES
        values = (interval, wait, compute, data, forward, data_forward, backward, optimizer, max(other, 0.0))
        self._ring[row : row + NUM_TIMES] = array("d", values)
        if self._num_rows == 0:
            self._first_step = step
        self._num_rows += 1
        self._last_step = step

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
        if comm is not self._comm:  # a new reducer (rebind_, on every rank): a new window, host names again
            self._comm, self._sent_host, self._num_rows, self._partial = comm, False, 0, False
        self._partial |= active_ranks < comm.size
        if num_reductions % self.every:
            return
        if not self._partial:  # rule 3
            self._report(comm)
        self._num_rows, self._partial = 0, False

    def _medians(self) -> list[float]:
        rows = min(self._num_rows, self._capacity)
        if rows == 0:
            return [math.nan] * NUM_TIMES
        window = torch.frombuffer(self._ring, dtype=torch.float64)[: rows * NUM_TIMES].view(rows, NUM_TIMES)
        return window.nanmedian(dim=0).values.tolist()

    def _report(self, comm) -> None:
        """Send this window's medians to rank 0 (collective over ``comm``); rank 0 judges and prints."""
        started = time.perf_counter()
        # The steps of the rows held (the last ``_capacity`` of them), not the reductions counted.
        first = max(self._first_step, self._last_step - self._capacity + 1)
        last = self._last_step
        first_report, self._sent_host = not self._sent_host, True
        rank, node = job_rank(comm)
        gathered = gather_to_rank_0(
            comm, [*self._medians(), rank, node, min(self._num_rows, self._capacity)], first_report
        )
        report = None
        if gathered is not None:
            try:  # rank 0's own work: an error here must not leave it out of step with the others
                report = self._judge(*gathered, first_report, first, last)
            except Exception:
                log.exception("hpcddp: straggler report of steps %d-%d failed on rank 0", first, last)
        self._mark(started, report)

    def _judge(
        self, table: torch.Tensor, hosts: list[str], first_report: bool, first: int, last: int
    ) -> StragglerReport | None:
        if first_report:
            self._hosts = hosts
        if int(table[:, FIELDS.index("steps")].min()) < MIN_ROWS:
            return None  # too few steps on some rank to tell noise from a straggler
        label = f"DistributedOptimizer #{self.number}" if _num_recorders > 1 else ""
        report = judge(table, self._hosts, first, last, optimizer=label)
        publish(report)
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
