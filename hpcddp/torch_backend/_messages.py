"""The torch Work of a point-to-point message of ``ProcessGroupHPCDDP`` (torch's isend/irecv/send/recv).

The message itself is the communicator's (``hpcddp.comm.mpi.p2p``); this Work gives it torch's
``wait``/``is_completed``/``get_future`` and gloo's "Timed out" after the group's timeout.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from ..comm._cuda_events import current_cuda_device, use_cuda_device
from ._profiling import wait_ended

__all__ = ["MessageWork"]


class MessageWork(dist.Work):
    """A message in flight; ``is_completed()`` moves it on, ``wait()`` completes it (raising on a mismatch)."""

    def __init__(self, message, group_timeout: float | None, describe: str, profiled=None) -> None:
        super().__init__()
        self._message = message
        self._profiled = profiled  # its profiler event (``_profiling.begin``), or None
        self._group_timeout = group_timeout
        self._describe = describe
        self._future = torch.futures.Future()
        self._watch_lock, self._watched = threading.Lock(), False
        self._settle_lock = threading.RLock()  # a callback run by set_result may settle again

    def _settle(self) -> None:
        # The future's own thread (get_future) and a waiting thread may both settle it: once only.
        with self._settle_lock:
            if self._future.done() or not self._message.poll():
                return
            try:
                self._future.set_result([self._message.wait()])
            except Exception as err:  # noqa: BLE001 - raised again by wait()
                self._future.set_exception(err)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Complete the message; raise "Timed out" after ``timeout``, or the group's enforced timeout, as gloo does."""
        seconds = (timeout.total_seconds() if timeout else None) or self._group_timeout
        if not self._message._block(seconds) and (self._message.name == "send" or self._message.cancel_unmatched()):
            self._message.withdraw()  # a late message matches nothing here, and no stall is reported
            raise RuntimeError(f"{self._describe}: Timed out after {seconds:g} s waiting for the peer")
        self._message.wait()  # raises a mismatch; a receive matched just in time takes its data
        self._settle()
        wait_ended(self._profiled)
        return True

    def is_completed(self) -> bool:
        self._settle()
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """A future completed when the message is (by a thread of its own: nothing else moves a message on)."""
        with self._watch_lock:
            if not self._watched and not self._future.done():
                self._watched = True
                threading.Thread(
                    target=self._complete_future, args=(current_cuda_device(),), name="hpcddp-message-future",
                    daemon=True,
                ).start()  # fmt: skip
        return self._future

    def _complete_future(self, cuda_device: int | None) -> None:
        use_cuda_device(cuda_device)  # the future's callbacks run here, on the caller's GPU
        self._message._block(None)
        self._settle()

    def result(self) -> list[torch.Tensor]:
        """The message's tensor, once it completed (torch's deprecated ``Work.result``)."""
        self.wait()
        return list(self._future.value())

    def _source_rank(self) -> int:
        """The sender of a receive from any rank (torch's ``recv(src=None)`` returns it)."""
        self.wait()
        return self._message.source
