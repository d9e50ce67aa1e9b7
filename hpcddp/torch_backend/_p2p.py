"""send/recv for ``ProcessGroupHPCDDP``: non-blocking MPI requests, completed by ``Work.wait()``.

Point-to-point messages do not go through the communication thread: a rank
that posts isend then irecv while its peer does the same must not block in the
first (blocking sends of large messages would deadlock in that order). Each
message is preceded by a small header (dtype, shape) so a receiver that
expects another tensor fails with both shapes named instead of reading a
prefix of the data.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..comm.agreement import CollectiveMismatchError
from ._buffers import bytes_view, describe, stage, unstage

__all__ = ["PointToPoint"]


class _RequestWork(dist.Work):
    """MPI requests that ``wait()`` completes, then ``finish()`` (which may raise)."""

    def __init__(self, finish) -> None:
        super().__init__()
        self._finish = finish
        self._future = torch.futures.Future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._future.done():
            try:
                self._future.set_result(self._finish())
            except BaseException as err:  # noqa: BLE001 - raised again by the future
                self._future.set_exception(err)
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class PointToPoint:
    """Mixin of ``ProcessGroupHPCDDP``: send, recv (torch's isend/irecv/send/recv and batch_isend_irecv)."""

    def _tags(self, tag: int) -> tuple[int, int]:
        if not 0 <= tag < 2**30:
            raise ValueError(f"tag must be in [0, 2**30), got {tag}")
        return 2 * tag, 2 * tag + 1

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _RequestWork:
        tensor = tensors[0]
        staged, (header_tag, data_tag) = stage(tensor), self._tags(tag)
        requests = [
            self._mpi.isend(describe([tensor]), dest=dst, tag=header_tag),
            self._mpi.Isend(bytes_view(staged), dest=dst, tag=data_tag),
        ]

        def finish():
            for request in requests:
                request.wait()
            return [tensor]

        return _RequestWork(finish)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _RequestWork:
        tensor = tensors[0]
        staged, (header_tag, data_tag) = stage(tensor), self._tags(tag)
        expected, MPI = describe([tensor]), self._MPI
        header = self._mpi.irecv(source=src, tag=header_tag)
        data = self._mpi.Irecv(bytes_view(staged), source=src, tag=data_tag)
        sender, receiver = self._global_ranks[src], self._global_ranks[self.rank()]

        def finish():
            sent = header.wait()
            try:
                data.Wait()
            except MPI.Exception:
                if sent == expected:
                    raise
            if sent != expected:
                raise CollectiveMismatchError(
                    f"recv: rank {sender} sent {sent}, rank {receiver} expected {expected} (tag {tag}): "
                    "pass a tensor of the sent shape and dtype"
                )
            return [unstage(tensor, staged)]

        return _RequestWork(finish)

    def recv_anysource(self, tensors, tag=0):
        raise ValueError("recv with src=None is not supported by the hpcddp backend: pass src=")
