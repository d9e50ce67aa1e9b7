"""The rules every road to MPI follows, and the engine that enforces them on one communicator.

hpcddp reaches MPI through several APIs and from several threads (the training thread,
one communication thread per communicator, autograd's threads running gradient hooks,
torch future callbacks, the stall inspector). There is one road: hpcddp's collectives
(``hpcddp.collectives``), the DistributedOptimizer's gradient buckets (``hpcddp.ddp``)
and the Horovod API (``hpcddp.horovod``) call the ``Communicator`` interface; the
torch.distributed backend ``"hpcddp"``/``"mpi"`` (``hpcddp.torch_backend``) checks
torch's arguments and calls the MPI communicator's ``plan_*`` methods. Either way
``MPICommunicator`` plans each collective (its MPI calls, staging, names from ``hpcddp.comm.names``,
ops from ``hpcddp.comm.reduction``, dtypes from ``hpcddp.comm.dtypes``) and hands it to its ``Engine`` with
``start`` or ``run``. No module outside ``hpcddp.comm.mpi`` makes MPI calls on a communicator.
These rules hold for every collective on the road:

1. **One runner.** On each communicator at most one thread at a time, the *runner*,
   makes collective MPI calls. It is the communication thread, or a thread that waits
   for a result while the communication thread is idle and so runs the queue itself
   (this saves the wake-up of another thread: tens of microseconds per collective).
   A wait with a time limit leaves the queue to the communication thread, so that it
   can return on time. The communication thread starts when it is first woken: work
   that its waiters run themselves needs none.
2. **One order.** Operations run in the order they are submitted, and the log numbers
   them as they start (``OperationLog``): that numbering is the order every member rank
   must share, and what the stall inspector compares across ranks.
3. **The runner's own submissions run at once; callbacks run where they were attached.**
   Code that runs on the runner while it holds the queue (a torch future's callback:
   torch DDP's comm hooks, such as PowerSGD, issue collectives there and wait for them)
   has its collectives run immediately, inline, before anything queued later. A
   callback attached to a collective's future (``then``, ``add_done_callback``) is
   itself queued where it is attached (``submit_callback``), so it runs after its
   work and before anything submitted after the attaching call, on every rank alike,
   however early or late the work completed (``hpcddp.torch_backend._futures``). A wait
   on the runner runs queued operations, in order, until its own completes, so a
   callback that waits for a later work never waits for itself.
4. **Every collective agrees first.** Before moving data the ranks compare what each
   is about to run (op, shapes, dtypes, root, reduce op, splits: ``hpcddp.comm.agreement``) with
   one small non-blocking allreduce (``MPI_Iallreduce``), the same primitive for every
   API and every operation (gradient buckets, barriers and object collectives
   included). Two APIs that disagree on one communicator therefore raise
   ``CollectiveMismatchError`` on every rank instead of pairing one rank's message with
   another's; a rank's error about its own arguments travels in the same message, so
   every rank raises it. ``check_collectives=False`` turns the step off (a rank's own
   argument errors then raise on that rank alone, before anything is sent). One
   communicator is checked another way: an optimizer's ``GradientChannel`` carries its
   buckets alone and agrees once per step, on its parent (``gradient_channel``); a step's
   buckets are one operation there (``bucket_sums``, ``submit_series``), which waits for
   that agreement (``Engine.gate``) and raises its error.
5. **Completion on the runner.** A handle is completed (result or exception) by the
   runner after the operation's last MPI call; its ``on_done`` (a torch future's
   completion) runs there too, with rule 3 in force.
6. **Point-to-point bypasses the queue.** A send or receive is a pair of non-blocking
   requests (header, then data) posted by the calling thread and completed by whoever
   tests them (``p2p``); it never waits for the collectives, nor they for it. Several
   threads therefore call MPI at once: ``MPI_THREAD_MULTIPLE`` is required and checked
   when the first communicator is made. Every wait on the communicator (the agreement,
   the idle communication thread) moves receives in flight on, so that a rank blocked
   in a collective still takes a message its peer must finish sending first.
7. **Waiting spins, yields, then sleeps.** A rank waiting for late ranks (in the agreement)
   tests its request for 100 us without yielding, then up to 5 ms yielding the core
   between tests (``sched_yield``), then sleeps between tests (10 us, doubling to 200 us):
   a non-blocking collective moves on only inside a test, so ranks that arrive within the
   spin see MPI's own hop latency, while a straggler's long wait leaves the core to
   training threads. A yield that comes back over 0.5 ms late (other processes want the
   core) ends the yielding: sleeps wake on time, yields there cost a time slice each.
   Where a node's ranks outnumber its cores the yields start at once and last 50 us
   (``waits.share_cores``).
8. **Everything is visible.** The runner records every operation in the
   communicator's ``OperationLog``, the point-to-point layer every message, and every
   blocking wait says what it waits for (``hpcddp.comm.oplog.waiting``): the stall
   inspector judges from these alone, on its own communicator.
9. **A timeout fails the communicator for good** (``agreement.timeout``, a torch group's
   ``timeout=``): an agreement the other ranks do not join in time raises "Timed out",
   and every later operation raises the same error instead of pairing with the wrong
   one (``hpcddp.comm.mpi.agreeing``). No thread stays behind, so exiting does not wait.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import Any, NamedTuple

from .. import oplog
from .._cuda_events import current_cuda_device, use_cuda_device
from ..agreement import CollectiveCall
from ..base import Handle
from ..dtypes import dtype_name
from .agreeing import Agreement
from .buffers import explain_failure
from .waits import wait_for_request

__all__ = ["Collective", "Engine", "EngineHandle", "describe_collective", "wait_for_request"]

log = logging.getLogger("hpcddp")


class EngineHandle(Handle):
    """A queued operation's handle: a thread that waits for it runs the queue when it can (rule 1)."""

    def __init__(self, engine: Engine, name: str, desc: oplog.Descriptor) -> None:
        super().__init__(name)
        self._engine = engine
        self.desc = desc

    def _block(self, timeout: float | None) -> bool:
        return self._done.is_set() or self._engine.wait_for(self, timeout)


class Collective(NamedTuple):
    """One collective for the engine (``MPICommunicator``'s ``plan_*`` methods make them)."""

    #: its name (``hpcddp.comm.names``)
    name: str
    #: its MPI calls, made on the runner; the return value is the result
    body: Callable[[], Any]
    #: the tensor the log names (shape, dtype), if any
    tensor: Any = None
    #: what every rank agrees on first (rule 4); None: checks are off, or the body agrees itself
    call: CollectiveCall | None = None
    #: how the log names it, made by the planner (``planned_allreduce`` keeps one per signature); None: from
    #: ``tensor``, ``label`` and ``step``
    desc: oplog.Descriptor | None = None
    #: what it is for, e.g. "bucket 2 of step 7" (stall reports)
    label: str = ""
    #: the training step it belongs to, compared across ranks
    step: int | None = None


def describe_collective(collective: Collective) -> oplog.Descriptor:
    """How the log names ``collective``: its planned descriptor, else one made from its tensor, label and step."""
    if collective.desc is not None:
        return collective.desc
    tensor, label, step = collective.tensor, collective.label, collective.step
    if tensor is None:
        return oplog.describe(collective.name, label=label, step=step)
    return oplog.describe(collective.name, tensor.shape, dtype_name(tensor.dtype), label=label, step=step)


class _Operation:
    __slots__ = ("after", "body", "call", "desc", "handle", "logged", "on_done")

    def __init__(self, body, desc, call, handle, on_done, logged: bool = True, after: Handle | None = None) -> None:
        self.body, self.desc, self.call, self.handle, self.on_done = body, desc, call, handle, on_done
        self.logged, self.after = logged, after


#: what a thread waiting for a queued callback waits for (stall reports)
_CALLBACK = oplog.describe("callback", None, None)
#: what a thread waiting for a step's gradient buckets as a whole waits for (each bucket is logged itself)
_SERIES = oplog.describe("allreduce", None, None, label="gradient buckets")


class Engine:
    """Run one MPI communicator's collectives by the rules above.

    Args:
        comm: the mpi4py communicator (owned by the caller).
        MPI: the mpi4py ``MPI`` module.
        log: where operations are recorded (registered with the stall inspector by the caller).
        name: the communication thread is called ``hpcddp-<name>``.
        messages: the communicator's point-to-point layer (its ``progress()`` and
            ``next_progress_in()``), moved on by every wait here (rule 6).
    """

    def __init__(self, comm, MPI, log: oplog.OperationLog, name: str = "mpi", messages=None) -> None:
        self.comm = comm
        self.log = log
        self._messages = messages
        if messages is not None:
            messages.on_pending = self._notice_messages
        self.size = comm.Get_size()
        #: rule 4's agreement and rule 9's timeout: its ``check_collectives``, ``timeout``, ``label``
        self.agreement = Agreement(comm, MPI, log.members, messages)
        # The condition's lock entered directly where no wait is needed: Condition.__enter__ is a
        # Python frame, and run() takes it twice per small blocking collective (its hot path).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._items: collections.deque[_Operation] = collections.deque()
        self._runner: int | None = None
        self._closed = False
        #: the agreement on another communicator that collectives submitted from now on wait
        #: for, and whose error they raise without an MPI call (``hpcddp.comm.mpi.gradient_channel``)
        self.gate: Handle | None = None
        self._cuda_device = current_cuda_device()  # the rank's GPU, for the communication thread too
        # Started when first woken: a communicator whose work the waiting threads run themselves (a
        # rank on one core, blocking collectives alone) never has one.
        self._thread: threading.Thread | None = None
        self._thread_name = f"hpcddp-{name}"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """True once an operation timed out: the ranks are out of step, nothing more runs (rule 9)."""
        return self.agreement.failure is not None

    # -- submitting ---------------------------------------------------------------------
    def submit(
        self, collective: Collective, *, on_done: Callable[[Handle], None] | None = None, wake: bool = True
    ) -> EngineHandle:
        """Queue ``collective`` (its body's MPI calls) after the agreement on its call; return its handle.

        Args:
            collective: what to run.
            on_done: called with the completed handle, on the runner (rule 5).
            wake: False when the caller waits at once (it then runs the queue itself).
        """
        desc = describe_collective(collective)
        handle = EngineHandle(self, collective.name, desc)
        return self._enqueue(_Operation(collective.body, desc, collective.call, handle, on_done, after=self.gate), wake)

    def submit_series(self, run: Callable[[Handle | None], None], gate: Handle | None, wake: bool) -> EngineHandle:
        """Queue ``run(gate)``, an operation that logs the collectives it runs itself (``bucket_sums``); return its handle.

        Args:
            run: the operation; it waits for ``gate`` before its first MPI call.
            gate: the agreement it waits for (``gate`` when it was submitted), or None.
            wake: False leaves it to the first thread that waits for it (rule 1).
        """
        handle = EngineHandle(self, "allreduce", _SERIES)
        return self._enqueue(_Operation(partial(run, gate), _SERIES, None, handle, None, logged=False), wake)

    def submit_callback(self, run: Callable[[], None]) -> EngineHandle:
        """Queue ``run`` (a future's callback) at this point of the order, not logged as an operation (rule 3)."""
        handle = EngineHandle(self, "callback", _CALLBACK)
        return self._enqueue(_Operation(run, _CALLBACK, None, handle, None, logged=False), wake=True, claim=True)

    def _enqueue(self, op: _Operation, wake: bool, claim: bool = False) -> EngineHandle:
        """Queue ``op``; run it at once on the runner (rule 3), or, with ``claim``, in this thread when idle."""
        me = threading.get_ident()
        with self._cond:
            self.check_open(op.desc.op)
            inline = self._runner == me
            claimed = claim and not inline and self._runner is None and not self._items
            if claimed:
                self._runner = me  # nothing queued: here and now is the same point of the order
            elif not inline:
                self._items.append(op)
                if wake and self._runner is None:
                    self._wake()
        if inline or claimed:
            try:
                self._execute(op)
            finally:
                if claimed:
                    self._release()
            stop = op.handle._error
            if claimed and stop is not None and not isinstance(stop, Exception):
                raise stop  # Ctrl-C or sys.exit() in a callback run here: this thread stops, as without hpcddp
        return op.handle

    def run(self, collective: Collective) -> Any:
        """Run ``collective`` now and return its result, in this thread when the queue is idle (blocking).

        The hot path of small blocking collectives: no handle, no queue, no wake-up.
        """
        me = get_ident()
        gate = self.gate
        with self._lock:
            if self.agreement.failure is not None or self._closed:  # the common case without a call
                self.check_open(collective.name)
            nested = self._runner == me
            # An agreement still running elsewhere is waited for in the queue, not holding the runner.
            claimed = not nested and self._runner is None and not self._items and (gate is None or gate.poll())
            if claimed:
                self._runner = me
        if not (nested or claimed):
            return self.submit(collective, wake=False).wait()
        pending = collective.desc or describe_collective(collective)
        seq = self.log.start(pending, blocking=True)
        try:
            if gate is not None:
                gate.wait()
            if collective.call is not None:
                self.agreement.agree(collective.call)
            return collective.body()
        except BaseException as err:
            raise explain_failure(err, pending._replace(seq=seq)) from None
        finally:
            self.log.finish(seq)
            if claimed:
                self._release()

    def check_open(self, name: str) -> None:
        """Raise RuntimeError when ``name`` cannot run here: the communicator is closed, or an operation timed out."""
        if self.agreement.failure is not None:
            raise self._not_run(name)
        if self._closed:
            raise RuntimeError(
                f"{name}: this communicator is closed (hpcddp.shutdown(), or its process group was destroyed): "
                "after a new hpcddp.init(), use objects made after it (process sets, optimizers on them, "
                "hpcddp.DistributedOptimizer; hvd.DistributedOptimizer of the global set follows by itself); "
                "call dist.destroy_process_group() before hpcddp.shutdown()"
            )

    # -- running ------------------------------------------------------------------------
    def _serve(self) -> None:
        use_cuda_device(self._cuda_device)
        me = threading.get_ident()
        while True:
            with self._cond:
                while self._runner is not None or not self._items:
                    if self._closed and not self._items:
                        return
                    # Receives in flight: wake when the point-to-point layer tests them next (rule 6).
                    gap = None if self._messages is None else self._messages.next_progress_in()
                    if gap is not None:
                        self._cond.wait(gap)
                        self._cond.release()
                        try:
                            self._messages.progress()
                        finally:
                            self._cond.acquire()
                    else:
                        self._cond.wait()
                self._runner = me
            try:
                while True:
                    with self._cond:
                        if not self._items:
                            break
                        op = self._items.popleft()
                    self._execute(op)
            finally:
                self._release()

    def _notice_messages(self) -> None:
        """A receive was posted: an idle communication thread starts testing it (rule 6)."""
        with self._cond:
            if self._runner is None:
                self._wake()

    def _wake(self) -> None:
        """Wake the communication thread, starting it the first time (the caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._thread_name, daemon=True)
            self._thread.start()
        else:
            self._cond.notify()

    def _release(self) -> None:
        with self._lock:
            self._runner = None
            if self._items and self._thread is None:
                self._wake()  # left queued by a caller that waits with a time limit, or not at all
            if self._items or self._closed:
                self._cond.notify_all()

    def _not_run(self, name: str) -> RuntimeError:
        return RuntimeError(f"{name} was not run: {self.agreement.failure}")

    def _execute(self, op: _Operation) -> None:
        handle = op.handle
        if not op.logged:
            try:
                handle.set_result(op.body())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                handle.set_exception(err)
            return
        if self.agreement.failure is not None:  # queued before an earlier operation timed out
            handle.set_exception(self._not_run(op.desc.op))
        else:
            seq = self.log.start(op.desc)
            try:
                if op.after is not None:
                    op.after.wait()  # its error is this operation's: raised alike on every rank, nothing sent
                    with self._lock:
                        if self.gate is op.after:
                            self.gate = None  # agreed: what is submitted after it need not wait for it
                handle.started_at = time.perf_counter()
                if op.call is not None:
                    self.agreement.agree(op.call)
                result = op.body()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                self.log.finish(seq)
                handle.set_exception(explain_failure(err, op.desc._replace(seq=seq)))
            else:
                self.log.finish(seq)
                handle.set_result(result)
        # After the handle's completion hooks, not one of them: completing a torch future runs its
        # callbacks inline here, and one that waits for this work must find its profiler event ended.
        if op.on_done is not None:
            try:
                op.on_done(handle)
            except Exception:  # noqa: BLE001 - a callback's failure must not stop the queue
                log.exception("hpcddp: a completion callback of %s failed", op.desc)

    def wait_for(self, handle: EngineHandle, timeout: float | None) -> bool:
        """Block until ``handle`` completes, running queued operations when this thread may (rules 1, 3).

        A wait with a ``timeout`` runs nothing it need not (only what its own thread must, as the
        runner): an operation's MPI calls cannot stop half way, so it leaves the queue to the
        communication thread and returns False on time while late ranks keep the operation waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        token = oplog.wait_begins(self.log, handle.desc)
        try:
            while not handle._done.is_set():
                with self._cond:
                    claimed = deadline is None and self._runner is None and bool(self._items)
                    if claimed:
                        self._runner = me
                    runs = claimed or (self._runner == me and bool(self._items))
                    op = self._items.popleft() if runs else None
                    if op is None and self._runner is None and self._items:
                        self._wake()  # queued with wake=False: the communication thread runs it
                if op is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    # The runner completes the handle, or releases and the comm thread goes on.
                    handle._done.wait(remaining)
                    continue
                try:
                    self._execute(op)
                finally:
                    if claimed:
                        self._release()
        finally:
            oplog.wait_ends(token)
        return True

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish what is queued, then stop the communication thread (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._thread is None and self._items:
                self._wake()  # it finishes what is queued, then stops
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
