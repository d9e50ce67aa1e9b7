"""Asynchronous model averaging: each rank steps alone while its model is averaged in the background.

    averager = hpcddp.AsyncModelAverager(model, optimizer)   # a plain torch optimizer
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()               # also looks at the round of averaging in flight
    averager.close()                   # one synchronous average: identical models everywhere

The rules, written once here (every other module follows them by calling this one):

1. **One round in flight.** A round is one non-blocking average (``allreduce_async_``) of
   a flat copy, the *snapshot*, of the model's floating parameters and floating buffers,
   plus one number: whether this rank asks the rounds to stop. The optimizer's post-step
   hook polls the round in flight and, once it is done, applies
   ``live += average - snapshot`` and posts the next round. The step never waits for a
   round, so a fast rank never waits for a slow rank's computation.
2. **One order.** Every rank posts rounds 0, 1, 2, ... and a round completes once every
   rank has posted it. Rounds stop where every rank sees it: after the first round whose
   average carries a stop request (``pause()``, ``close()``), no rank posts another until
   it calls ``resume()``. ``pause()``, ``resume()`` and ``close()`` are therefore
   collective: every rank calls them, equally often. Rounds run on a communicator of
   their own (split from the job's at construction, closed by ``close()``): a round is
   posted at a different point of each rank's script, so on a shared communicator it
   would meet the script's own collectives (an evaluation's allreduce, the rounds of a
   second averager) in a different order on each rank. NCCL orders collectives across
   all communicators of a GPU, so on nccl even a communicator of their own can deadlock:
   the averager refuses nccl and names the mpi backend instead.
3. **The lock.** The pre-step hook takes the averager's lock and the post-step hook
   releases it after the averaging update; ``pause()``, ``resume()`` and ``close()`` take
   it too. So an optimizer step and an averaging update never touch a tensor at once,
   whichever threads call them, and the training loop's updates run in the thread that
   calls ``step()``, right after its step. The communication thread touches the round's
   own buffer only, never a parameter. ``pause()`` and ``close()`` update the parameters
   as well: call them from the training thread, or while no forward or backward pass
   runs (an update between a forward pass and its backward makes autograd raise
   "modified by an inplace operation"). torch runs no post-step hook after a step that
   raised, so the averager also wraps the optimizer's ``step`` (as torch's LR schedulers
   do) and releases the lock there, whatever the step did: a failed step applies no
   round, and any thread may then ``close()``. A thread that steps takes part in the
   rounds: an uncaught exception in it ends the job, as one in the main thread does
   (``hpcddp.fault.abort``).
4. **Buffers.** Floating buffers (BatchNorm's running statistics) ride in the same
   rounds but take the round's average itself, not ``average - snapshot``: running
   statistics decay, and the delta of a decaying running variance can push it below
   zero; an average of the ranks' values stays within them (a round's staleness is
   nothing to a running estimate). Integer buffers (``num_batches_tracked``) and the
   optimizer's state (momentum, Adam's moments) stay each rank's own, as in local SGD.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import types
from collections.abc import Iterator

import torch

from ..comm.base import Communicator, Handle, ReduceOp
from ..comm.oplog import mark_collective_thread
from ..ddp.consistency import check_same_parameters
from ..ddp.optimizer import DistributedOptimizer
from ..observe.stragglers import report_step_rates
from ..runtime.state import at_shutdown
from .averaging import check_count, job_communicator

__all__ = ["AsyncModelAverager"]


class AsyncModelAverager:
    """Average a model over all ranks in the background while each rank steps its own optimizer.

    Construction is collective: every rank starts from rank 0's parameters and
    buffers. A rank that does not construct it leaves the others waiting in its
    first collective, as with any collective (or, when that rank runs another
    collective, every rank raises CollectiveMismatchError on the mpi backend). The first ``warmup_steps`` steps average the
    parameters synchronously after each step; after that each step only looks at
    the round in flight (module docstring, rule 1) and never waits for it. Warm-up
    steps are collectives: every rank takes them (and pauses) at the same steps.

    **Staleness.** At most one round is in flight per rank. The average a rank applies
    at its step ``t`` was formed from snapshots taken ``k`` of its own steps earlier,
    where ``k`` is the number of steps it takes while one round goes round: 1 to 2 on
    the slowest rank and about its speed ratio to the slowest rank elsewhere (a round
    completes once the slowest rank has posted it, once per slow step).

    **Why it converges.** The update ``live += average - snapshot`` replaces the
    snapshot's share of the model by the average and keeps every local step taken
    since: no local progress is discarded. Summed over the ranks the corrections
    cancel (the average of the snapshots minus the snapshots), so the replicas' mean
    moves by the ranks' optimizer steps only, as in synchronous data-parallel SGD,
    while each round pulls every replica back to that mean: their spread stays
    within ``k`` local steps. That is local SGD with averaging period ``k`` (Lin et
    al. 2018; Bagua's asynchronous model average), whose convergence is known; a
    fast rank contributes more steps, that is more samples, to the mean.

    **Costs.** Replicas differ by up to ``k`` steps of drift until ``close()``, and
    results are not bitwise reproducible: which snapshots meet in a round depends on
    timing. Optimizer state is not averaged. ``close()`` (also run by
    ``hpcddp.shutdown()``) ends with identical parameters on every rank.

    Args:
        model: the module whose floating parameters and buffers are averaged; build the
            averager once it has its device and dtype (it keeps the tensors it found).
        optimizer: the plain torch optimizer of ``model``'s parameters (not an
            ``hpcddp.DistributedOptimizer``); its ``step()`` stays in the loop.
        warmup_steps: steps averaged synchronously first (>= 0).
        communicator: the Communicator to use; the one ``hpcddp.init()`` made by default.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int = 0,
        *,
        communicator: Communicator | None = None,
    ) -> None:
        self._check_arguments(model, optimizer, warmup_steps)
        self.warmup_steps = warmup_steps
        #: optimizer steps taken since construction (a world of one counts none: no hooks)
        self.num_steps = 0
        #: asynchronous rounds applied (after a ``pause()``, the same number on every rank)
        self.num_rounds = 0
        self._comm = job_communicator(communicator)
        if self._comm.name == "nccl" and self._comm.size > 1:
            # NCCL requires one order of collectives across all communicators of a GPU; rounds
            # posted at rank-dependent steps meet the script's collectives on the default group
            # in a different order on each rank, which can deadlock (issue 34, item 10).
            raise RuntimeError(
                "AsyncModelAverager cannot run on the nccl backend (its rounds at rank-dependent steps can deadlock "
                "with the script's NCCL collectives): start hpcddp with backend='mpi' (hpcddp.init(backend='mpi') or "
                "HPCDDP_BACKEND=mpi), or use hpcddp.PeriodicModelAverager, which averages at the same steps everywhere"
            )
        self._model, self._optimizer = model, optimizer
        self._optimizer_params = _count_params(optimizer)
        named = _averaged(model)
        self._use(named, allocate=False)
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread inside a step (rule 3)
        self._in_flight: Handle | None = None
        self._paused = self._stopped = self._closed = False
        self._hooks = []
        self._step = None  # the optimizer's step as it was before the averager wrapped it
        if self._comm.size == 1:
            return
        self._comm = self._comm.split(list(range(self._comm.size)))  # rule 2: the rounds' own
        check_same_parameters(self._comm, named, "AsyncModelAverager")
        self._use(named)
        with torch.no_grad():
            self._pack()
            self._comm.broadcast_async_(self._round, 0, check="AsyncModelAverager start").wait()
            torch._foreach_copy_(self._tensors, self._round_views)
        self._check = "AsyncModelAverager round" if self._comm.agrees_in_background else None
        self._hooks = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        self._wrap_step()
        self._started_at = time.perf_counter()
        at_shutdown(self.close)

    def _use(self, named: list[tuple[str, torch.Tensor]], allocate: bool = True) -> None:
        """Average ``named`` (the model's floating tensors) from now on, in a round buffer of their size."""
        if len({t.device for _, t in named}) > 1:
            devices = sorted({str(t.device) for _, t in named})
            raise ValueError(f"model must live on one device to be averaged, got {devices}: move it with model.to()")
        self._tensors = [t.detach() for _, t in named]
        self._pointers = [t.data_ptr() for t in self._tensors]
        self._names = [name for name, _ in named]
        self._num_params = sum(1 for name, _ in named if name.startswith("parameter "))
        self._params_numel = sum(t.numel() for t in self._tensors[: self._num_params])
        if not allocate:
            return
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in self._tensors), torch.float32)
        numel = sum(t.numel() for t in self._tensors) + 1  # the last element: the stop request
        self._round = torch.empty(numel, dtype=dtype, device=self._tensors[0].device)
        self._snapshot = torch.empty_like(self._round)
        self._round_views = self._views(self._round)

    @staticmethod
    def _check_arguments(model, optimizer, warmup_steps) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError(
                "optimizer must be a plain torch optimizer, got an hpcddp.DistributedOptimizer (it averages every "
                "gradient synchronously): pass the optimizer it wraps, and close() the DistributedOptimizer first"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_count("warmup_steps", warmup_steps, 0)
        in_model = {id(p) for p in model.parameters()}
        strays = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_model]
        if strays:
            raise ValueError(
                f"optimizer holds {len(strays)} parameter(s) that are not model's (the first of shape "
                f"{list(strays[0].shape)}): build the optimizer from model.parameters()"
            )
        if not any(p.is_floating_point() for p in model.parameters()):
            raise ValueError(f"model has no floating-point parameters to average, got {type(model).__name__}")
        complex_ = [n for n, p in model.named_parameters() if p.is_complex()]
        if complex_:
            raise ValueError(
                f"model has complex parameters ({', '.join(complex_[:3])}), which AsyncModelAverager does not average: "
                "hold them as torch.view_as_real() pairs of floats"
            )

    def _check_tensors_unchanged(self) -> None:
        """Raise RuntimeError when the model's tensors were added, removed or replaced, or the optimizer grew."""
        if _count_params(self._optimizer) != self._optimizer_params:
            self._check_arguments(self._model, self._optimizer, self.warmup_steps)
            self._optimizer_params = _count_params(self._optimizer)
        named = _averaged(self._model)
        if [t.data_ptr() for _, t in named] != self._pointers:
            changes = [f"{n} added" for n, _ in named if n not in self._names]
            changes += [f"{n} removed" for n in self._names if n not in dict(named)]
            if changes:
                raise RuntimeError(
                    f"AsyncModelAverager: the model's parameters changed after it was made ({', '.join(changes[:4])}), "
                    "so averaging would not reach them all: make the averager once the model has all its layers"
                )
            raise RuntimeError(
                "AsyncModelAverager: the model's parameters or buffers were replaced after it was made (model.to(), "
                ".double(), load_state_dict(assign=True)), so averaging would no longer reach them: make the averager "
                "after the model has its final device and dtype (close() averages the new tensors once, a new "
                "AsyncModelAverager goes on from there)"
            )

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat``'s pieces shaped as the averaged tensors (the stop request, last, left out)."""
        sizes = [t.numel() for t in self._tensors]
        return [v.view(t.shape) for v, t in zip(flat[:-1].split(sizes), self._tensors)]

    # -- the step hooks (rules 1 and 3) ------------------------------------------------------
    def _wrap_step(self) -> None:
        """Make the optimizer's ``step`` release the lock after a step that raised (rule 3)."""
        # The step found on the instance: an LR scheduler's wrapper made before stays in the
        # chain. Ours is a bound method, as an LR scheduler made after expects (it rebinds
        # step.__func__ to the optimizer).
        self._had_own_step = "step" in self._optimizer.__dict__
        self._step = step = self._optimizer.step

        def guarded_step(optimizer, *args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self._release_after_failed_step()

        self._guarded_step = types.MethodType(guarded_step, self._optimizer)
        self._optimizer.step = self._guarded_step

    def _unwrap_step(self) -> None:
        if self._step is None or self._optimizer.__dict__.get("step") is not self._guarded_step:
            return  # wrapped again since (an LR scheduler made after): ours stays in its chain, a no-op
        if self._had_own_step:
            self._optimizer.step = self._step
        else:
            del self._optimizer.step  # the class's step again

    def _release_after_failed_step(self) -> None:
        if self._holder == threading.get_ident():  # the pre-step hook ran, the post-step hook did not
            self._holder = None
            self._lock.release()

    def _before_step(self, optimizer, args, kwargs) -> None:
        mark_collective_thread()
        if self._holder != threading.get_ident():  # else a step of this thread raised outside the wrapper
            self._lock.acquire()
            if self._closed:  # closed by another thread while this one waited: the post-step hook is gone
                self._lock.release()
                return
            self._holder = threading.get_ident()

    def _after_step(self, optimizer, args, kwargs) -> None:
        try:
            self.num_steps += 1
            if not self._paused and not self._closed:
                with torch.no_grad():
                    if self.num_steps <= self.warmup_steps:
                        self._average_now()
                    elif self._in_flight is None or self._in_flight.poll():
                        if self._in_flight is not None:
                            self._apply_round()
                        if not self._stopped:
                            self._post_round(stop=False)
        finally:
            self._holder = None
            self._lock.release()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._holder == me:
            yield
            return
        with self._lock:
            self._holder = me
            try:
                yield
            finally:
                self._holder = None

    # -- rounds ---------------------------------------------------------------------------
    def _pack(self) -> None:
        torch._foreach_copy_(self._round_views, self._tensors)
        self._round[-1] = 0

    def _post_round(self, stop: bool) -> None:
        self._pack()
        self._round[-1] = 1 if stop else 0
        self._snapshot.copy_(self._round)
        self._in_flight = self._comm.allreduce_async_(self._round, ReduceOp.AVERAGE, check=self._check)

    def _apply_round(self) -> None:
        handle, self._in_flight = self._in_flight, None
        handle.wait()  # raises the round's error, if it failed
        self._check_tensors_unchanged()
        self._stopped = self._stopped or self._round[-1].item() > 0
        params = self._num_params
        self._round[: self._params_numel].sub_(self._snapshot[: self._params_numel])
        torch._foreach_add_(self._tensors[:params], self._round_views[:params])
        if params < len(self._tensors):  # buffers take the average itself (rule 4)
            torch._foreach_copy_(self._tensors[params:], self._round_views[params:])
        self.num_rounds += 1

    def _stop_rounds(self) -> None:
        """Post and apply rounds until one carries a stop request (rule 2); blocking."""
        with torch.no_grad():
            while not self._stopped:
                if self._in_flight is None:
                    self._post_round(stop=True)
                self._in_flight.wait()
                self._apply_round()

    def _use_current_tensors(self) -> None:
        """Take the tensors the model holds now for close()'s average: those loaded while paused (assign=True) too.

        Collective, alike on every rank whatever each rank replaced: the same ValueError
        on every rank when the ranks' tensors no longer match (one rank called .double()).
        """
        named = _averaged(self._model)
        check_same_parameters(self._comm, named, "AsyncModelAverager.close()")
        if [t.data_ptr() for _, t in named] != self._pointers:
            self._use(named)

    def _average_now(self) -> None:
        self._pack()
        self._comm.allreduce_(self._round[:-1], ReduceOp.AVERAGE, check="AsyncModelAverager average")
        torch._foreach_copy_(self._tensors, self._round_views)

    # -- public ---------------------------------------------------------------------------
    def pause(self) -> None:
        """Finish and apply the rounds in flight, then average nothing until ``resume()``.

        Collective (every rank calls it): it waits until every rank has posted the
        last round. Steps taken while paused stay local. Idempotent.
        """
        with self._locked():
            self._paused = True
            if self._comm.size > 1 and not self._closed:
                self._stop_rounds()

    def resume(self) -> None:
        """Average in the background again from the next step (collective; idempotent)."""
        with self._locked():
            if self._closed:
                raise RuntimeError("resume() after close(): make a new AsyncModelAverager to average again")
            if self._paused:
                if self._comm.size > 1:
                    self._check_tensors_unchanged()  # else the next round would update the old tensors
                self._paused = self._stopped = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[AsyncModelAverager]:
        """Pause for the block (an evaluation, a checkpoint), then resume: ``with averager.paused():``."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def close(self) -> None:
        """Finish the round in flight, average once synchronously and stop averaging (collective; idempotent).

        Afterwards every rank holds bitwise identical parameters and floating buffers (those
        the model holds now: tensors loaded while paused with ``load_state_dict(...,
        assign=True)`` included), and the optimizer steps alone. ``hpcddp.shutdown()``
        calls it for a script that did not. Rank 0 reports each rank's steps per second
        (``hpcddp.straggler_report()``) and names the slow ranks.
        """
        if self._closed:
            return
        with self._locked():
            if self._closed:
                return
            self._closed = True  # also when the collectives below fail: they are not tried twice
            try:
                if self._comm.size > 1:
                    self._stop_rounds()
                    self._use_current_tensors()
                    with torch.no_grad():
                        self._average_now()
                    report_step_rates(self._comm, self.num_steps, time.perf_counter() - self._started_at)
                    self._comm.close()
            finally:
                # Last: until now a step in another thread waits in the pre-step hook for the lock (rule 3).
                for hook in self._hooks:
                    hook.remove()
                self._unwrap_step()


def _averaged(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's floating parameters, then its floating buffers, named for messages."""
    named = [(f"parameter {n}", t) for n, t in model.named_parameters() if t.is_floating_point()]
    return named + [(f"buffer {n}", t) for n, t in model.named_buffers() if t.is_floating_point()]


def _count_params(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)
