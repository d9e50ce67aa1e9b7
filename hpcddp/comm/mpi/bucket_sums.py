"""An optimizer's gradient buckets summed as one operation per step: the hooks hand buckets over, the runner sums them.

Each bucket as an operation of its own cost the training thread a handle, a queue entry
and a wake-up of the communication thread per bucket, and the communication thread a
trip through the queue: about 40 us a bucket here, where one MPI call of a small bucket
takes 2. A step's buckets always run in index order, one after the other, on their own
communicator (``gradient_channel``), so the step is one operation of the engine instead:
submitted with bucket 0, gated by the step's agreement (engine rule 4), it sums bucket
after bucket as the hooks hand them over (``start``: a number written under the engine's
lock), and each bucket is still numbered in the operation log as it starts and ends
(rule 8: the stall inspector names the bucket a rank waits in). The MPI calls are the
ones each bucket made alone (``MPICommunicator.plan_allreduce``), the agreement per bucket
included where a group timeout asks for it.

A step ends in one of three ways: every bucket was summed; a bucket failed (its error is
that bucket's and every later one's, and the communicator is out of step for good, as
after a timeout: engine rule 9); or the reducer gave up on the step before its last
bucket (``abandon``: the buckets not handed over are not sent, and raise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .. import oplog
from ..base import Handle
from ..reduction import ReduceOp
from .buffers import explain_failure
from .engine import describe_collective
from .waits import one_core

__all__ = ["BucketSums"]


class _BucketHandle(Handle):
    """One bucket's sum: done when its step's operation is (buckets are summed in order, the last one ends it)."""

    def __init__(self, sums: BucketSums, index: int) -> None:
        super().__init__("allreduce")  # its latch unused: the step's handle says when it is done
        self._sums, self._index = sums, index

    def poll(self) -> bool:
        return self._sums._step.poll()

    def exception(self) -> BaseException | None:
        return self._error if self.poll() else None

    def _block(self, timeout: float | None) -> bool:
        step = self._sums._step
        if not step._block(timeout):
            return False
        if self._error is None and self.completed_at is None:
            # The step's operation ended without summing this bucket: its own error (a bug would show here).
            self._error = step._error or RuntimeError(f"gradient bucket {self._index} was not summed")
        return True

    def set_result(self, result: Any) -> None:  # completed by the step's operation only
        raise TypeError("a bucket's sum is completed by its step's operation")

    set_exception = set_result


class BucketSums:
    """The in-place sums of an optimizer's buckets, started in index order each step, run as one operation.

    On a rank that owns several cores (or sums GPU buckets) the communication thread sums
    each bucket as soon as it is handed over, while backward goes on; on a CPU rank bound
    to one core (``waits.one_core``) the step's operation waits until the training thread
    waits for a bucket, and runs there (engine rule 1).

    Args:
        comm: the buckets' ``MPICommunicator`` (a gradient channel's).
        tensors: each bucket's tensor as sent, in bucket order.
        before_send: called with (first, stop) just before buckets ``first`` to ``stop - 1`` are sent
            (``Communicator.bucket_sums``): on the runner, every bucket handed over by then at once.
    """

    def __init__(
        self, comm, tensors: Sequence[torch.Tensor], before_send: Callable[[int, int], None] | None = None
    ) -> None:
        self._comm = comm
        self._engine = comm.engine
        self._log = comm.log
        self._tensors = list(tensors)
        self._handles = [_BucketHandle(self, i) for i in range(len(self._tensors))]
        self._cond = self._engine._cond  # the engine's: closing it wakes a step waiting here
        self._collectives: list[Any] = [None] * len(self._tensors)
        # Planned once where they can be (CPU, MPI's own dtypes, one message): each start then only names
        # its step; a group timeout (an agreement per bucket) or patience plans the bucket at its start.
        planned = comm.planned_allreduces
        self._fixed = [planned.plan(tensor, ReduceOp.SUM, None, step=0) for tensor in self._tensors]
        #: buckets handed over in the current step
        self._started = 0
        self._abandoned = False
        #: counts the steps started: an abandoned step's operation stops where the next one began
        self._generation = 0
        self._plan_each = False
        #: the step's operation waits for the next bucket
        self._waiting = False
        self._step: Handle | None = None
        on_cpu = all(t.device.type == "cpu" for t in self._tensors)
        #: sum while backward runs (several cores, or GPU buckets: the training thread then mostly waits
        #: for the device), else when the training thread waits for the sums
        self.overlap = not (on_cpu and one_core())
        # On the runner, just before the MPI call, where MPI reads the bucket's own memory (CPU); a GPU
        # bucket is staged to the host as it starts, on the training thread's stream: it is readied there.
        self._before_send = before_send
        self._send_prepared_by_runner = before_send is not None and on_cpu

    def start(self, first: int, stop: int, *, labels: Sequence[str], step: int, into: list[Handle]) -> None:
        """Hand buckets ``first`` to ``stop - 1`` (filled) to the step's operation; bucket 0 submits that operation.

        Args:
            first: the first bucket; buckets start strictly in index order.
            stop: one past the last.
            labels: their labels, "bucket 2 of step 7" (stall reports, the agreement).
            step: the optimizer's step they belong to.
            into: the step's handles, in bucket order: theirs are appended once they are handed over.
        """
        handles = self._handles[first:stop]
        if first > 0 and self._step is not None and self._step.completed_at is not None:
            into += handles  # the step's operation ended (closed, failed): the handles keep its error
            return
        if self._before_send is not None and not self._send_prepared_by_runner:
            self._before_send(first, stop)
        if first == 0:  # a group timeout (set at bucket 0) or patience: each bucket planned as it starts
            self._plan_each = self._engine.agreement.runs or oplog.is_patient()
        taken = []
        for index, label in zip(range(first, stop), labels):
            collective, desc = self._fixed[index], None
            if collective is None or self._plan_each:
                collective = self._comm.plan_allreduce(self._tensors[index], ReduceOp.SUM, label=label, step=step)
                desc = describe_collective(collective)  # here: its patience is this thread's
            taken.append((collective, desc, label, step))
        for handle in handles:
            handle._error = handle.started_at = handle.completed_at = None
            handle.waited = False
        with self._cond:
            self._collectives[first:stop] = taken
            self._started = stop
            if first == 0:
                self._abandoned = False
                self._generation += 1  # an abandoned step's operation, still queued, takes none of these
                # Raises when the communicator is closed or out of step (``GradientChannel.fail``).
                self._step = self._engine.submit_series(
                    partial(self._run, self._generation), self._engine.gate, wake=self.overlap
                )
            elif self._waiting:
                self._cond.notify_all()  # not when the step waits in the queue: that would wake the idle thread
        into += handles

    def wait(self, handles: Sequence[Handle]) -> None:
        """Wait once for the step's operation; raise the first bucket's failure, in bucket order.

        Args:
            handles: this step's buckets' handles, from ``start``, in bucket order.
        """
        step = self._step
        if step is None or not handles:
            return
        step._block(None)
        for handle in handles:
            if handle._error is None and handle.completed_at is None:
                handle._block(None)  # not summed by the step's operation: its own error
            handle.waited = True
            if handle._error is not None:
                raise handle._error

    def abandon(self) -> None:
        """The reducer gave up on this step: the buckets not handed over are not sent, and raise."""
        with self._cond:
            if self._step is not None and not self._step.poll():
                self._abandoned = True
                self._cond.notify_all()

    def _run(self, generation: int, gate: Handle | None) -> None:
        """The step's operation, on the runner: after the step's agreement, sum each bucket once it is handed over."""
        engine, cond = self._engine, self._cond
        try:
            if gate is not None:
                gate.wait()  # its error is every bucket's: raised alike on every rank, nothing sent
                with cond:
                    if engine.gate is gate:
                        engine.gate = None  # agreed: what is submitted after it need not wait for it
            if engine.agreement.failure is not None:
                raise RuntimeError(f"allreduce was not run: {engine.agreement.failure}")
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            self._fail(generation, 0, err, out_of_step=False)
            return
        log, agree, handles, perf_counter = self._log, engine.agreement.agree, self._handles, time.perf_counter
        before_send = self._before_send if self._send_prepared_by_runner else None
        index, count = 0, len(self._tensors)
        while index < count:
            with cond:
                while self._started <= index and not self._abandoned and not engine._closed:
                    self._waiting = True
                    cond.wait()
                    self._waiting = False
                handed = self._started
                if generation != self._generation or handed <= index:
                    taken = None
                else:  # every bucket handed over so far, in one go
                    taken = self._collectives[index:handed]
                    self._collectives[index:handed] = [None] * (handed - index)
            if taken is None:
                self._fail(
                    generation, index, RuntimeError(f"gradient bucket {index} was not sent: the step was abandoned")
                )
                return
            first = index
            for collective, desc, label, step in taken:
                if desc is None:  # planned once: named for this step here, off the training thread's path
                    desc = collective.desc.for_step(label, step)
                seq = log.start(desc)
                handle = handles[index]
                handle.started_at = perf_counter()
                try:
                    if before_send is not None and index == first:
                        before_send(index, handed)  # every bucket handed over so far: one call
                    if collective.call is not None:
                        agree(collective.call)
                    collective.body()
                except BaseException as err:  # noqa: BLE001 - every later bucket of the step raises it too
                    log.finish(seq)
                    self._fail(generation, index, explain_failure(err, desc._replace(seq=seq)))
                    return
                log.finish(seq)
                handle.completed_at = perf_counter()
                index += 1

    def _fail(self, generation: int, index: int, error: BaseException, out_of_step: bool = True) -> None:
        """Fail bucket ``index`` and every later one of step ``generation`` with ``error``.

        Args:
            generation: the step; the handles are left alone once a later step began (they are its).
            out_of_step: buckets of this step are not sent on this rank, so its collectives
                here are out of step with the other ranks' for good (engine rule 9).
        """
        agreement = self._engine.agreement
        if out_of_step and agreement.failure is None:
            agreement.failure = RuntimeError(f"a gradient bucket of an earlier step failed on this rank: {error}")
        with self._cond:
            if generation != self._generation:
                return
            now = time.perf_counter()
            for handle in self._handles[index:]:
                handle._error, handle.completed_at = error, now
