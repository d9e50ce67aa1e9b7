"""The futures of the backend's collectives: callbacks run at one point of the order on every rank.

torch runs a future's callbacks when the future completes, or at once in the attaching
thread when it has already completed. A callback that issues a collective (torch's
DDP comm hooks, a user's ``work.get_future().then(...)``) would then run it at a point
of the communicator's order that depends on timing: right after the work on a rank
where the work was still running, after later operations on a rank where it had
finished. Two ranks would pair different collectives, a silent wrong result when their
shapes agree. ``OrderedFuture`` fixes the point instead: ``then`` and
``add_done_callback`` queue the callback on the communicator's engine where they are
called, in program order, so it runs on the runner after the work and before anything
submitted after the attaching call, on every rank alike (rule 3 of
``hpcddp.comm.mpi.engine``). When nothing is queued (the usual case for a future that has
completed) the callback runs at once in the attaching thread, as torch runs it. Its ``wait()`` on the runner runs the queue up to it, so a
callback may wait for a work submitted later without waiting for itself.

Callbacks that torch attaches in C++ (DDP's reducer) keep torch's behaviour: they run
when the future completes, on the runner.

With CUDA tensors the future is a CUDA future (``devices=``), as NCCL's are: completing it
records an event on the completing thread's current stream, and ``wait()`` makes the
waiter's current stream wait for that event. A callback's kernels run on the runner's
stream, and DDP reads the hook's result on its own (a side stream under AMP or a user's
``torch.cuda.stream``): without the events it could read gradients not yet averaged
(issue 34, item 9). A callback here first makes the runner's stream wait for its parent's
events, and its result future records the runner's stream again for the next reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("hpcddp")

__all__ = ["OrderedFuture", "cuda_devices"]


#: whether this torch can make CUDA tensors at all (``torch.cuda.is_available``'s own first test; ROCm too)
_CUDA_BUILT = torch.cuda._is_compiled()


def cuda_devices(tensors) -> list[torch.device]:
    """Return the CUDA devices of ``tensors`` (a tensor, or nested lists of them), in order of first use."""
    found: list[torch.device] = []
    if not _CUDA_BUILT:  # nothing to look for, and the walk costs ~1.5 us of each collective
        return found
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_cuda and item.device not in found:
                found.append(item.device)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return found


class OrderedFuture(torch.futures.Future):
    """A torch future completed on an engine's runner, right after ``handle``.

    Args:
        engine: the engine (``hpcddp.comm.mpi.engine.Engine``) that runs its callbacks.
        handle: the engine handle (``hpcddp.comm.mpi.engine.EngineHandle``) whose
            completion precedes this future's; may be set after construction, before
            the future is handed out; None for a future completed before it is handed out.
        devices: the CUDA devices of its tensors (a stream-safe CUDA future); None or
            empty: a CPU future.
    """

    def __init__(self, engine, handle=None, devices: list[torch.device] | None = None) -> None:
        super().__init__(devices=list(devices) if devices else None)
        self._devices = list(devices or [])
        self._engine = engine
        self.handle = handle

    def wait(self) -> Any:
        if not self.done():
            self.handle._block(None)  # on the runner: runs the queue up to the handle
        return super().wait()

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> OrderedFuture:
        result = OrderedFuture(self._engine, devices=self._devices)

        def run() -> None:
            try:
                settled = self._settled()
                if self._devices:  # the runner's stream waits for the producer's event
                    torch.futures.Future.wait(settled)
                value = callback(settled)
            except Exception as err:  # noqa: BLE001 - delivered through the returned future
                # torch hands a callback's error to the waiter as a RuntimeError
                wrapped = RuntimeError(f"{type(err).__name__}: {err}")
                wrapped.__cause__ = err
                result.set_exception(wrapped)
            except BaseException as err:  # Ctrl-C, sys.exit: the future fails, and the attaching thread stops
                result.set_exception(RuntimeError(f"the callback was stopped by {type(err).__name__}"))
                raise
            else:
                result.set_result(value)

        result.handle = self._engine.submit_callback(run)
        return result

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        def run(future: torch.futures.Future) -> None:
            try:
                callback(future)
            except Exception:  # noqa: BLE001 - as torch: logged, the future is unaffected
                log.exception("hpcddp: a done callback of a collective's future failed")

        self.then(run)

    def _settled(self) -> OrderedFuture:
        # The callback runs after the handle, and this future is completed right after it.
        if not self.done():
            self.handle._block(None)
        return self
