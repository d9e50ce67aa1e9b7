"""The collective interface every backend implements, and the handles and buffers it returns."""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .reduction import ReduceOp, parse_op

__all__ = [
    "MESSAGE_PIECE_BYTES",
    "BucketSums",
    "Communicator",
    "Handle",
    "PrivateBytes",
    "ReduceOp",
    "completed",
    "even_splits",
    "split_ranks_error",
    "parse_op",
    "splits_error",
]


#: bytes per MPI call: MPI counts elements in 32-bit ints, and Open MPI's reductions of
#: larger messages hold several temporary copies (2.2 GB of fp16 grew a rank to 11.8 GB)
MESSAGE_PIECE_BYTES = 256 * (1 << 20)

_HOOKS_LOCK = threading.Lock()  # completion hooks are rare: one lock for all handles
log = logging.getLogger("hpcddp")


class _Latch:
    """What a handle needs of ``threading.Event`` (set once, is_set, wait), made of one lock.

    An Event is a Condition around a lock, built in Python: about 3 us to make and 2 us to
    set, and a handle is made for every collective, on the gradient hooks' path too. Here
    the lock is held until ``set`` releases it; a waiter takes it and gives it back.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        with contextlib.suppress(RuntimeError):  # two threads setting at once: released already
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        # In slices: a waiter interrupted (Ctrl-C) between taking the lock and giving it back
        # leaves it taken, and the other waiters then see the flag at their next slice.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            wait_s = _LATCH_SLICE_S if deadline is None else min(deadline - time.monotonic(), _LATCH_SLICE_S)
            if wait_s <= 0:
                return False
            if self._lock.acquire(True, wait_s):
                with contextlib.suppress(RuntimeError):  # released by a setter that raced another
                    self._lock.release()
        return True


#: how long a latch's waiter blocks before it looks at the flag again
_LATCH_SLICE_S = 0.1


class Handle:
    """An operation in flight: ``wait()`` blocks until it is done and returns its result.

    A backend completes a handle by calling ``set_result`` or ``set_exception`` from
    any thread; ``then`` functions run in the waiting thread, in order, once.
    """

    #: True once ``wait()`` returned or raised the outcome (not on a timeout): the caller has seen it
    waited = False

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._done = _Latch()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finishers: list[Callable[[Any], Any]] = []
        self._finished = False
        self._completion_hooks: list[Callable[[], None]] = []
        #: perf_counter() when the backend started the operation, if it knows (timelines)
        self.started_at: float | None = None
        #: perf_counter() when the backend completed the operation (for timelines)
        self.completed_at: float | None = None

    def set_result(self, result: Any) -> None:
        if self.completed_at is None:  # a backend may have stamped the real completion already
            self.completed_at = time.perf_counter()
        self._result = result
        self._done.set()
        self._run_completion_hooks()

    def set_exception(self, error: BaseException) -> None:
        self.completed_at = time.perf_counter()
        self._error = error
        self._done.set()
        self._run_completion_hooks()

    def completion_time(self) -> float | None:
        """Return ``completed_at``, waiting for the device first where the backend knows it only then.

        For measurements read after ``wait()``: on nccl, ``wait()`` returns once the caller's
        stream waits for the collective, before its kernels ran.
        """
        return self.completed_at

    def on_completion(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once when the operation completes, in the completing thread (at once if it has).

        For observers (profiler events): ``hook`` must be quick; an exception it raises is logged,
        so that it cannot stop the thread that completes handles (an engine's runner).
        """
        with _HOOKS_LOCK:
            if not self._done.is_set():
                self._completion_hooks.append(hook)
                return
        hook()

    def _run_completion_hooks(self) -> None:
        with _HOOKS_LOCK:
            hooks, self._completion_hooks = self._completion_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - the completing thread (an engine's runner) goes on
                log.exception("hpcddp: a completion hook of %s failed", self.name or "an operation")

    def then(self, finisher: Callable[[Any], Any]) -> Handle:
        """Apply ``finisher`` to the result when waited on; returns self for chaining."""
        self._finishers.append(finisher)
        return self

    def block(self) -> None:
        """Block until the operation completes, leaving its outcome to ``wait()`` (which then returns or raises it)."""
        self._block(None)

    def poll(self) -> bool:
        """Return True if the operation has completed (``wait`` would not block)."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """Return the error the operation completed with; None while it runs or when it succeeded."""
        return self._error if self._done.is_set() else None

    def _block(self, timeout: float | None) -> bool:
        """Wait for completion; return False on timeout. Backends with their own
        completion objects override this."""
        return self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done and return the result (the output tensor for collectives).

        Args:
            timeout: seconds to wait before raising TimeoutError; None waits forever.
        """
        if not self._block(timeout):
            raise TimeoutError(f"{self.name or 'collective'} did not complete within {timeout} s")
        self.waited = True
        if self._error is not None:
            raise self._error
        if not self._finished:
            self._finished = True
            for finisher in self._finishers:
                self._result = finisher(self._result)
        return self._result


class BucketSums:
    """The in-place sums of an optimizer's gradient buckets: each step starts bucket 0, 1, ... in order.

    This one starts each bucket as an allreduce of its own; ``hpcddp.comm.mpi.bucket_sums``
    runs a step's buckets as one operation.

    Args:
        comm: the communicator the buckets are summed on.
        tensors: each bucket's tensor as sent, in bucket order.
        before_send: called with (first, stop) just before buckets ``first`` to ``stop - 1`` are sent
            (``Communicator.bucket_sums``).
    """

    #: buckets are summed while backward runs, so each is started as soon as it is ready (``BucketSender.overlap``)
    overlap = True

    def __init__(
        self, comm: Communicator, tensors: Sequence[torch.Tensor], before_send: Callable[[int, int], None] | None = None
    ) -> None:
        self._comm = comm
        self._tensors = list(tensors)
        self._before_send = before_send

    def start(self, first: int, stop: int, *, labels: Sequence[str], step: int, into: list[Handle]) -> None:
        """Start summing buckets ``first`` to ``stop - 1`` (filled) over the ranks; append their handles to ``into``.

        Args:
            first: the first bucket; buckets start strictly in index order.
            stop: one past the last.
            labels: their labels, "bucket 2 of step 7" (stall reports, the agreement).
            step: the optimizer's step they belong to.
            into: the step's handles, in bucket order: each one appended as its bucket starts.
        """
        if self._before_send is not None:
            self._before_send(first, stop)
        for index, label in zip(range(first, stop), labels):
            into.append(self._comm.allreduce_async_(self._tensors[index], ReduceOp.SUM, label=label, step=step))

    def abandon(self) -> None:
        """The step ends before its last bucket started: nothing is waiting for the rest here."""

    @staticmethod
    def wait(handles: Sequence[Handle]) -> None:
        """Wait for the buckets' sums (``handles``, from ``start``); raise the first failure, in bucket order."""
        if handles:
            # A communicator completes buckets in the order they were sent: the training thread then
            # wakes once for the step, not once per bucket.
            with contextlib.suppress(Exception):  # a failure is raised by the waits that follow, in bucket order
                handles[-1].block()
        for handle in handles:
            handle.wait()


def completed(result: Any, name: str = "") -> Handle:
    """Return a handle that is already done."""
    handle = Handle(name)
    handle.set_result(result)
    return handle


def ranks_text(ranks) -> str:
    """Name ranks in messages: ``rank 3`` or ``ranks 0, 2`` (sorted)."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def split_ranks_error(ranks, size: int) -> str | None:
    """Return what is wrong with ``ranks`` as the members of a sub-communicator, or None."""
    values = list(ranks)
    if not values or any(not isinstance(r, int) or not 0 <= r < size for r in values) or len(set(values)) < len(values):
        return f"ranks must be distinct ranks in [0, {size}), at least one, got {values}"
    return None


def even_splits(rows: int, size: int) -> list[int]:
    """Split ``rows`` over ``size`` ranks as Horovod does: the first ``rows % size`` ranks get one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def as_splits(splits) -> list | None:
    """Return ``splits`` (a list, tuple or tensor of row counts, or None) as a list, or None."""
    if splits is None:
        return None
    return splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)


def alltoall_splits(splits, rows: int, size: int) -> tuple[list[int], str | None]:
    """Return alltoall's row counts per rank (even when ``splits`` is None) and what is wrong with them, or None."""
    values = as_splits(splits)
    if values is None:
        error = None if rows % size == 0 else (
            f"alltoall without splits needs a first dimension divisible by {size} ranks, got {rows}: pass splits"
        )  # fmt: skip
        return even_splits(rows, size), error
    return values, splits_error(values, rows, size)


def splits_error(splits, rows: int, size: int) -> str | None:
    """Return what is wrong with ``splits`` for a tensor of ``rows`` rows on ``size`` ranks, or None.

    Args:
        splits: one non-negative row count per rank.
        rows: the tensor's first dimension.
        size: the number of ranks.
    """
    values = list(splits)
    if len(values) != size or any(int(v) != v or v < 0 for v in values):
        return f"splits must be {size} non-negative row counts (one per rank), got {values}"
    if sum(values) != rows:
        return f"splits must add up to the tensor's first dimension {rows}, got {values} (sum {sum(values)})"
    return None


class PrivateBytes:
    """``nbytes`` bytes on every rank, filled by broadcasts of root's (any communicator).

    What ``Communicator.share_bytes`` returns where the backend shares no memory (MPI's holds
    the bytes once per node: ``hpcddp.comm.mpi.shared_window``)::

        with comm.share_bytes(nbytes, root=0) as shared:   # collective
            if comm.rank == 0:
                fill(shared.array)                        # e.g. read a file into it
            shared.share()                                # collective: root's bytes everywhere
            use(shared.array)                             # read-only on every rank

    Args:
        comm: the ``Communicator`` (None: a world of one).
        nbytes: the buffer's size, the same on every rank.
        root: the rank that fills ``array`` before ``share()``.
    """

    def __init__(self, comm, nbytes: int, root: int) -> None:
        self._comm, self._root = comm, root
        #: the bytes (uint8); root writes them before ``share()``, every rank reads them after
        self.array = np.empty(nbytes, dtype=np.uint8)

    def share(self) -> None:
        """Copy root's ``array`` into every rank's (collective)."""
        if self._comm is None or self._comm.size == 1:
            return
        # In pieces: a GPU backend stages each piece on the device, not the whole buffer.
        for start in range(0, len(self.array), MESSAGE_PIECE_BYTES):
            piece = torch.from_numpy(self.array[start : start + MESSAGE_PIECE_BYTES])
            self._comm.broadcast_async_(piece, self._root).wait()

    def close(self) -> None:
        """Release the buffer (collective where the backend shares memory)."""
        self.array = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> PrivateBytes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Communicator(abc.ABC):
    """Collectives over all ranks on torch tensors; one instance per backend.

    In-place methods end in ``_`` and return a Handle whose result is the tensor.
    Every rank must call collectives in the same order.

    Every tensor collective takes a keyword ``check``: a string (the tensor's name,
    or "") asks the backend to verify first, in order with the collective itself,
    that every rank passes matching metadata (see ``hpcddp.comm.agreement``); on
    disagreement every rank's handle raises CollectiveMismatchError and nothing is
    sent. None (the default, hpcddp's own bucket reductions) skips the check, as
    does ``check_collectives = False``.

    The asynchronous ones the optimizer and the Horovod API start (allreduce, broadcast,
    allgather, reducescatter, alltoall) also take keywords ``label``, what the collective is
    for ("bucket 2 of step 7", Horovod's ``name``: stall reports name it), and ``step``, the
    training step it belongs to (compared across ranks, and reported).
    """

    #: backend name: "mpi", "gloo", "nccl" or "local"
    name: str = "abstract"
    #: run the agreement check where a caller asks for it (``check=``)
    check_collectives: bool = True
    #: an ``*_async`` call's ``check=`` agreement runs on the communication thread, so the call
    #: returns at once (mpi); False: the agreement waits for the other ranks in the calling thread
    agrees_in_background: bool = False
    #: set by the runtime when the process ends (``close()`` then also ends what the script left)
    process_ending: bool = False

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def _checking(self, check: str | None) -> bool:
        return check is not None and self.check_collectives and self.size > 1

    @abc.abstractmethod
    def allreduce_async_(
        self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        """Start reducing ``tensor`` in place across ranks."""

    def bucket_sums(
        self, tensors: Sequence[torch.Tensor], before_send: Callable[[int, int], None] | None = None
    ) -> BucketSums:
        """Return the in-place sums of ``tensors`` (an optimizer's gradient buckets), started in index order each step.

        A backend may plan them once here, or run a step's buckets as one operation (MPI).

        Args:
            tensors: each bucket's tensor as sent, in bucket order.
            before_send: called with (first, stop) just before buckets ``first`` to ``stop - 1``
                are sent, in bucket order, where they are sent (on the communication thread when
                that sends while backward runs; every bucket handed over by then at once).
        """
        return BucketSums(self, tensors, before_send)

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks and return it (blocking)."""
        if check is None:
            return self.allreduce_async_(tensor, op).wait()
        return self.allreduce_async_(tensor, op, check=check).wait()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        """Return the reduction of ``tensor`` across ranks, leaving it unchanged (blocking)."""
        return self.allreduce_(tensor.clone(memory_format=torch.contiguous_format), op, check=check)

    @abc.abstractmethod
    def broadcast_async_(
        self, tensor: torch.Tensor, root: int, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        """Start copying root's ``tensor`` into every rank's ``tensor``."""

    @abc.abstractmethod
    def allgather_async(
        self, tensor: torch.Tensor, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's picklable ``obj`` on every rank."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's picklable ``obj``, in rank order."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        """Return the list of every rank's picklable ``obj`` on ``root``, None elsewhere."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    def share_bytes(self, nbytes: int, root: int) -> PrivateBytes:
        """Return a buffer of ``nbytes`` bytes that ``root`` fills and its ``share()`` copies to every rank.

        Collective, as are the buffer's ``share()`` and ``close()`` (or the end of its
        ``with`` block); see ``PrivateBytes``. Backends that can share
        memory hold the bytes once per node.

        Args:
            nbytes: the buffer's size, the same on every rank.
            root: the rank that fills it.
        """
        return PrivateBytes(self, nbytes, root)

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        """Start reducing ``tensor`` onto ``root``: root's tensor becomes the reduction, the others' stay."""
        raise NotImplementedError(f"{self.name} communicator has no reduce")

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        """Start concatenating every rank's ``tensor`` along dim 0 on ``root``; the result is None elsewhere."""
        raise NotImplementedError(f"{self.name} communicator has no gather")

    def scatter_async_(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, check: str | None = None
    ) -> Handle:
        """Start filling every rank's ``out`` with root's ``chunks[rank]`` (``chunks`` only on root)."""
        raise NotImplementedError(f"{self.name} communicator has no scatter")

    def reducescatter_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        splits: list[int] | None = None,
        *,
        check: str | None = None,
        label: str = "",
        step: int | None = None,
    ) -> Handle:
        """Start reducing ``tensor`` and keep this rank's rows of the result.

        Args:
            tensor: the same shape on every rank.
            op: the reduction.
            splits: rows of the result per rank, the same on every rank; None splits
                evenly, the first ``rows % size`` ranks getting one more (Horovod's rule).
        """
        raise NotImplementedError(f"{self.name} communicator has no reducescatter")

    def alltoall_async(
        self,
        tensor: torch.Tensor,
        splits: list[int] | None = None,
        *,
        check: str | None = None,
        label: str = "",
        step: int | None = None,
    ) -> Handle:
        """Start sending ``splits[r]`` rows of ``tensor`` to each rank r; the result is
        ``(received rows concatenated in rank order, received splits as an int64 tensor)``.

        Args:
            tensor: rows to distribute; the dimensions after the first agree across ranks.
            splits: rows for each rank, summing to ``tensor.shape[0]``; None splits evenly
                (the first dimension must then be divisible by the number of ranks).
        """
        raise NotImplementedError(f"{self.name} communicator has no alltoall")

    def send_async(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to rank ``dest``; never blocks the collectives."""
        raise NotImplementedError(f"{self.name} communicator has no send")

    def recv_async_(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Handle:
        """Start receiving into ``tensor`` from rank ``source``; its result is ``tensor``."""
        raise NotImplementedError(f"{self.name} communicator has no recv")

    def join(self) -> int:
        """Take part in the other ranks' checked collectives until every rank joins; return the last to join.

        Horovod's ``join``: sum and average allreduces go on with zeros from the joined
        ranks, other checked collectives raise CollectiveMismatchError where they were called.
        """
        raise NotImplementedError(f"{self.name} communicator has no join: use the mpi backend")

    def split(self, ranks: list[int]) -> Communicator | None:
        """Return a communicator over ``ranks`` (renumbered in list order), None on other ranks.

        Collective over this communicator: every rank calls it with the same list.
        """
        raise NotImplementedError(f"{self.name} communicator cannot split")

    def gradient_channel(self) -> Any:
        """Return the channel one optimizer's buckets run on, agreed once per step; None: no agreement at all.

        Collective. A channel has ``comm`` (where the buckets run), ``before_bucket(index, bucket,
        label=, step=)`` before each bucket, ``confirm_step()`` once the buckets completed, ``refused_step()``,
        ``failed``, ``fail(reason)`` and ``close()``: MPI's (``hpcddp.comm.mpi.gradient_channel``)
        carries the buckets on a communicator of their own; torch.distributed's
        (``hpcddp.comm.torchdist_channel``) on its group.
        """
        return None

    def close(self) -> None:  # noqa: B027 - most backends have nothing to release
        """Release threads and communicators; the communicator is unusable afterwards."""
