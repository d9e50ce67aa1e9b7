"""send/recv for ``ProcessGroupHPCDDP``: the communicator's point-to-point messages (``hpcddp.comm.mpi.p2p``).

Point-to-point messages do not go through the queue (rule 6 of ``hpcddp.comm.mpi.engine``):
a rank that posts isend then irecv while its peer does the same must not block in the
first. The same protocol as hpcddp's own ``send_async``/``recv_async_``, so the two
APIs' messages match.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from ..comm._cuda_events import current_cuda_device, use_cuda_device
from ._profiling import begin, end_when_done, wait_ended

__all__ = ["PointToPoint"]


class _MessageWork(dist.Work):
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


class PointToPoint:
    """Mixin of ``ProcessGroupHPCDDP``: send, recv, recv_anysource (torch's isend/irecv/send/recv,
    batch_isend_irecv)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _MessageWork:
        return self._message("send", f"to rank {dst}", tensors, lambda: self._comm.p2p.send(tensors[0], dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _MessageWork:
        return self._message("recv", f"from rank {src}", tensors, lambda: self._comm.p2p.recv(tensors[0], src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _MessageWork:
        post = lambda: self._comm.p2p.recv(tensors[0], None, tag)  # noqa: E731
        return self._message("recvAnySource", "from any rank", tensors, post)

    def _message(self, op: str, peer: str, tensors: list[torch.Tensor], post) -> _MessageWork:
        """Post a message (``post()``) on an open communicator, with its profiler event ``op`` (torch's name)."""
        engine = self._comm.engine
        engine.check_open("send" if op == "send" else "recv")
        event = begin(f"{self._backend_name}:{op}", tensors)
        describe = f"{op} {peer} on {engine.agreement.label}"
        return _MessageWork(end_when_done(event, post()), engine.agreement.timeout, describe, event)
