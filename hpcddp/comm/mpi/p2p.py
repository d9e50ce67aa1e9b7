"""Point-to-point messages on a communicator: a header, then the data, outside the queue.

Rule 6 of ``hpcddp.comm.mpi.engine``: a send or receive is a set of non-blocking requests
posted by the calling thread, never queued behind collectives (a rank that posts isend
then irecv while its peer does the same must not block in the first). Every message
starts with a small header (dtype, shape, and the tag its data travels under), sent
with the user's tag. A receive posts its data request only once the header has
arrived, with the header's data tag, which no other message in flight between the two
ranks carries: MPI matches headers in the order receives were posted, and the data
then cannot go to another receive, whichever is tested first (a receive from any rank
beside one from a named rank, two receives from any rank). A receiver expecting
another tensor fails with both named before anything is written to its tensor.

Receives whose header has not arrived are moved on by every wait on the communicator
(``progress``): a message, a collective's agreement, and the idle communication
thread. A rank blocked in a collective therefore still takes the large message a peer
must finish sending before it can join that collective.

hpcddp's own ``send_async`` / ``recv_async_``, the torch backend's send/recv and the
Horovod API all use this one protocol, so their messages match each other.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from .. import oplog
from ..agreement import CollectiveMismatchError
from ..base import Handle
from ..dtypes import dtype_name, host_array
from .buffers import staged

__all__ = ["Message", "PointToPoint", "describe_tensors"]

#: bytes per data message: MPI counts are 32-bit, so larger tensors travel as several messages
CHUNK_BYTES = 1 << 30
_FIRST_GAP_S, _LONGEST_GAP_S = 1e-3, 10e-3


def describe_tensors(tensors) -> str:
    """``float32[4, 2]`` for one tensor, a comma-separated list for several (for messages)."""
    return ", ".join(f"{dtype_name(t.dtype)}{list(t.shape)}" for t in tensors)


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[i : i + CHUNK_BYTES] for i in range(0, max(flat.numel(), 1), CHUNK_BYTES)] or [flat]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class Message(Handle):
    """A send or a receive in flight; ``poll()`` and ``wait()`` move it on, from any thread.

    The result is the tensor (for a receive, filled); ``source`` is the sender's rank
    in the communicator once a receive has completed.
    """

    def __init__(self, p2p: PointToPoint, kind: str, tensor: torch.Tensor, peer: int | None, tag: int) -> None:
        super().__init__(kind)
        self._p2p = p2p
        self._tensor = tensor
        self.source = peer
        self._tag = tag
        self._lock = threading.Lock()
        self._token = p2p.log.post(kind, p2p.global_rank(peer), tag)
        self._requests: list = []
        self._header = None  # a receive's header request, until it arrives
        self._buffer: torch.Tensor | None = None  # where a receive's data lands
        self._problem: str | None = None
        #: what the requests read or write, alive until they complete
        self.keep: torch.Tensor | None = None

    def __str__(self) -> str:
        peer = "any rank" if self.source is None else f"rank {self._p2p.global_rank(self.source)}"
        return f"{self.name} {'to' if self.name == 'send' else 'from'} {peer} (tag {self._tag})"

    def poll(self) -> bool:
        if self._done.is_set():
            return True
        with self._lock:
            if not self._done.is_set():
                self._progress()
        return self._done.is_set()

    def try_poll(self) -> None:
        """``poll`` unless another thread is polling this message right now (never blocks)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._done.is_set():
                    self._progress()
            finally:
                self._lock.release()

    def _block(self, timeout: float | None) -> bool:
        if self.poll():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 10e-6
        with oplog.waiting(self._p2p.log, self):
            while not self.poll():
                self._p2p.progress()
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        return True

    def _progress(self) -> None:
        MPI = self._p2p.MPI
        try:
            if self._header is not None:
                status = MPI.Status()
                arrived, header = self._header.test(status)
                if not arrived:
                    return
                self._header_arrived(header, status)
            if not all(request.Test() for request in self._requests):
                return
        except MPI.Exception as err:  # the data is longer than the receiving tensor
            self._problem = self._problem or f"{err}"
        self._finish()

    def _header_arrived(self, header, status) -> None:
        self._header = None
        self.source = status.Get_source()
        self._p2p.take_data(self, header)
        self._p2p.arrived(self)

    def cancel_unmatched(self) -> bool:
        """Cancel a receive no message has matched yet (``MPI_Cancel``); return True when it now never takes one.

        False for a send, for a receive already matched (its data is on the way: wait for
        it) and for a completed message.
        """
        with self._lock:
            if self._done.is_set() or self._header is None:
                return False
            self._header.Cancel()
            status = self._p2p.MPI.Status()
            header = self._header.wait(status)  # at once: cancelled, or matched just before
            if not status.Is_cancelled():
                self._header_arrived(header, status)
                return False
            self._header = None
            self._p2p.arrived(self)
            self._p2p.log.delivered(self._token)
        self.set_exception(RuntimeError(f"{self} was withdrawn before a message came"))
        return True

    def withdraw(self) -> bool:
        """Stop waiting for this message; return True when it was a receive that now never takes one.

        A receive no message has matched is cancelled (``cancel_unmatched``), so no later
        message can match it. A send, or a receive already matched, completes in MPI as it
        would have, with nothing waiting for it. Either way the stall inspector stops
        listing it.
        """
        if self.cancel_unmatched():
            return True
        with self._lock:
            if self._done.is_set():
                return False
            self._p2p.log.delivered(self._token)
        self._p2p.keep_until_done(self)
        return False

    def _finish(self) -> None:
        self._p2p.log.delivered(self._token)
        if self._problem is not None:
            self.set_exception(CollectiveMismatchError(self._problem))
            return
        if self._buffer is not None and self._buffer.data_ptr() != self._tensor.data_ptr():
            with torch.no_grad():
                self._tensor.copy_(self._buffer)
        self.set_result(self._tensor)


class PointToPoint:
    """Sends and receives on one mpi4py communicator.

    Args:
        comm: the mpi4py communicator (shared with the collectives: point-to-point
            messages and collectives never match each other in MPI).
        MPI: the mpi4py ``MPI`` module.
        log: the communicator's OperationLog (messages in flight, for the stall inspector).
        global_ranks: the communicator's ranks as ranks of the whole job (for messages).
    """

    def __init__(self, comm, MPI, log: oplog.OperationLog, global_ranks) -> None:
        self.comm, self.MPI, self.log = comm, MPI, log
        self._global = list(global_ranks)
        self.rank = comm.Get_rank()
        # Users' tags are the headers' tags; hpcddp's own protocols' tags (``reserved_tag``)
        # lie above them, and the data tags above those, one per message.
        upper = comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag_limit = min(2**28, (upper + 1) // 4)
        self._num_reserved = self.tag_limit // 4
        self._first_data_tag = self.tag_limit + self._num_reserved
        self._data_tags = upper + 1 - self._first_data_tag
        #: messages nothing waits for any more (``Message.withdraw``), kept alive until MPI is done with them
        self.withdrawn: list[Message] = []
        self._sent = itertools.count()
        self._lock = threading.Lock()
        self._awaiting_header: dict[int, Message] = {}
        # progress() backs off while no header arrives (1 ms doubling to 10 ms), so that
        # many receives in flight cost a waiting rank little CPU; a new receive resets it.
        self._next_scan = 0.0
        self._scan_gap = 0.0
        #: called after a receive is posted (the engine's idle thread then tests it)
        self.on_pending = None

    def global_rank(self, rank: int | None) -> int | None:
        return None if rank is None else self._global[rank]

    def reserved_tag(self, number: int) -> int:
        """The ``number``-th tag (modulo their count) of those no user message can carry, for hpcddp's protocols."""
        return self.tag_limit + number % self._num_reserved

    def _check_tag(self, tag: int, reserved: bool) -> None:
        low, high = (self.tag_limit, self._first_data_tag) if reserved else (0, self.tag_limit)
        if not isinstance(tag, int) or not low <= tag < high:
            raise ValueError(f"tag must be an int in [{low}, {high}), got {tag!r}")

    def _check_peer(self, peer: int, argument: str) -> None:
        size = self.comm.Get_size()
        if not isinstance(peer, int) or not 0 <= peer < size:
            raise ValueError(f"{argument} must be a rank in [0, {size}), got {peer!r}")

    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0, *, reserved: bool = False) -> Message:
        """Start sending ``tensor`` to rank ``dest`` (of this communicator).

        Args:
            tensor: what to send.
            dest: the receiver.
            tag: the user's tag, or with ``reserved`` one from ``reserved_tag``.
            reserved: the message belongs to one of hpcddp's own protocols.
        """
        self._check_peer(dest, "dest")
        self._check_tag(tag, reserved)
        data_tag = self._first_data_tag + next(self._sent) % self._data_tags
        source = staged(tensor)
        message = Message(self, "send", tensor, dest, tag)
        message.keep = source  # the requests read it until they complete
        header = (source.dtype, tuple(source.shape), data_tag)
        message._requests.append(self.comm.isend(header, dest=dest, tag=tag))
        for chunk in _chunks(_bytes(source)):
            message._requests.append(self.comm.Isend(host_array(chunk), dest=dest, tag=data_tag))
        return message

    def recv(self, tensor: torch.Tensor, source: int | None, tag: int = 0, *, reserved: bool = False) -> Message:
        """Start receiving into ``tensor`` from rank ``source``, or from any rank when None (``reserved``: as ``send``)."""
        if source is not None:
            self._check_peer(source, "source")
        self._check_tag(tag, reserved)
        message = Message(self, "recv", tensor, source, tag)
        with self._lock:
            message._header = self.comm.irecv(source=self.MPI.ANY_SOURCE if source is None else source, tag=tag)
            self._awaiting_header[id(message)] = message
            self._next_scan = self._scan_gap = 0.0
        if self.on_pending is not None:
            self.on_pending()
        return message

    def arrived(self, message: Message) -> None:
        """``message``'s header has arrived: ``progress`` need not look at it any more."""
        with self._lock:
            self._awaiting_header.pop(id(message), None)

    def next_progress_in(self) -> float | None:
        """Seconds until ``progress`` tests headers again (0: now), or None when no receive waits for one."""
        if not self._awaiting_header:
            return None
        return max(0.0, self._next_scan - time.monotonic())

    def keep_until_done(self, message: Message) -> None:
        """Keep a withdrawn ``message`` (its requests and buffers) alive until it completes; drop the completed."""
        with self._lock:
            self.withdrawn = [m for m in self.withdrawn if not m.poll()]
            self.withdrawn.append(message)

    def progress(self) -> None:
        """Test the headers of receives in flight and post their data (from any waiting thread)."""
        now = time.monotonic()
        if not self._awaiting_header or now < self._next_scan:
            return
        with self._lock:
            waiting = list(self._awaiting_header.values())
        for message in waiting:
            message.try_poll()
        arrived = len(self._awaiting_header) < len(waiting)
        self._scan_gap = 0.0 if arrived else min(max(2 * self._scan_gap, _FIRST_GAP_S), _LONGEST_GAP_S)
        self._next_scan = now + self._scan_gap

    def take_data(self, message: Message, header) -> None:
        """Post the rest of a receive once its header names the sender, what it sent and its data tag."""
        dtype, shape, data_tag = header
        tensor = message._tensor
        if (dtype, tuple(shape)) != (tensor.dtype, tuple(tensor.shape)):
            sent = describe_tensors([torch.empty(shape, dtype=dtype, device="meta")])
            sender, receiver = self.global_rank(message.source), self.global_rank(self.rank)
            message._problem = (
                f"recv: rank {sender} sent {sent}, rank {receiver} expected {describe_tensors([tensor])} "
                f"(tag {message._tag}): pass a tensor of the sent shape and dtype"
            )
            # Take the data anyway (the sender's requests complete), without touching the caller's tensor.
            message.keep = torch.empty(shape, dtype=dtype)
            target = message.keep
        else:
            message._buffer = target = _receiving(tensor)
        for chunk in _chunks(_bytes(target)):
            message._requests.append(self.comm.Irecv(host_array(chunk), source=message.source, tag=data_tag))


def _receiving(tensor: torch.Tensor) -> torch.Tensor:
    """Where MPI writes a message for ``tensor``: itself when it is CPU and contiguous, else a new buffer."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach()
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
