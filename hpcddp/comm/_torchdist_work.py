"""What a torch.distributed collective of ``TorchDistCommunicator`` returns: its handle over a Work,
the agreement in flight before it, and how a Work's timeout reads."""

from __future__ import annotations

import datetime
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import oplog
from ._cuda_events import GpuCompletion
from .agreement import CollectiveCall
from .base import Handle

__all__ = ["Agreeing", "WorkHandle", "explain_timeout", "work_ended"]


class Agreeing(NamedTuple):
    """An agreement in flight on a torch.distributed group (``TorchDistCommunicator.start_agreement``)."""

    call: CollectiveCall
    vector: torch.Tensor
    work: Any
    label: str
    step: int | None


class WorkHandle(Handle):
    """A Handle over a torch.distributed Work; waiting on it yields ``result``.

    Args:
        work: the Work.
        result: what ``wait()`` returns (before the ``then`` finishers).
        name: the collective, for messages.
        completion: on nccl, its ``GpuCompletion``: when the kernels ran, which the Work's
            future does not tell (it completes once they are queued).
    """

    def __init__(self, work, result: Any, name: str, completion: GpuCompletion | None = None) -> None:
        self._gpu = completion
        super().__init__(name)
        self._work = work
        self._pending_result = result
        if completion is not None:
            return
        # Stamp the completion when the backend reaches it, not when someone waits
        # (the timeline's allreduce spans would otherwise last until step()).
        try:
            work.get_future().add_done_callback(self._stamp_completion)
        except (AttributeError, RuntimeError):  # a backend without futures: stamped at wait()
            pass

    @property
    def completed_at(self) -> float | None:  # type: ignore[override]
        """perf_counter() when the backend completed the operation (on a GPU: when its kernels ran)."""
        return self._gpu.completed_at if self._gpu is not None else self._completed_at

    @completed_at.setter
    def completed_at(self, value: float | None) -> None:
        self._completed_at = value

    def completion_time(self) -> float | None:
        if self._gpu is not None:
            return self._gpu.completion_time()
        return super().completion_time()

    def _stamp_completion(self, _future) -> None:
        if self.completed_at is None:
            self.completed_at = time.perf_counter()

    def poll(self) -> bool:
        return self._done.is_set() or self._work.is_completed()

    def _block(self, timeout: float | None) -> bool:
        if not self._done.is_set():
            try:
                with oplog.waiting(None, self.name):
                    if timeout is None:
                        self._work.wait()
                    elif not self._work.wait(timeout=datetime.timedelta(seconds=timeout)):
                        return False
            except RuntimeError as err:
                if timeout is None:
                    raise explain_timeout(err, self.name) from None
                if not work_ended(self._work):
                    return False  # only this wait ran out ("Operation timed out!"); the collective goes on
                return self._block(None)  # it ended meanwhile: its own outcome, an error or the result
            self.set_result(self._pending_result)
        return True


def work_ended(work) -> bool:
    """Whether a torch Work has ended, successfully or not (nccl may raise its error when asked)."""
    try:
        return work.is_completed()
    except RuntimeError:
        return True


def explain_timeout(err: RuntimeError, collective: str) -> RuntimeError:
    """Name the collective and the knob when torch.distributed's timeout ended it."""
    text = str(err)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return err
    backend = dist.get_backend() if dist.is_initialized() else "torch.distributed"
    return RuntimeError(
        f"{collective} on {backend} timed out ({text.splitlines()[0]}): a rank did not join it in time; "
        "raise dist_timeout (init(dist_timeout=...) or HPCDDP_DIST_TIMEOUT) if the ranks are only slow, and "
        "see the stall inspector's report above for which ranks were missing"
    )
