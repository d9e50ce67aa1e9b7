"""The collective interface every backend implements, and the handles it returns."""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Communicator", "Handle", "ReduceOp", "completed", "parse_op"]


class ReduceOp(enum.Enum):
    """How allreduce combines the ranks' tensors."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"


def parse_op(op: str | ReduceOp, argument: str = "op") -> ReduceOp:
    """Turn ``"average"``/``"sum"``/``"min"``/``"max"`` (or a ReduceOp) into a ReduceOp.

    Args:
        op: the user's value.
        argument: the argument name to put in the error message.
    """
    if isinstance(op, ReduceOp):
        return op
    aliases = {"avg": ReduceOp.AVERAGE, "mean": ReduceOp.AVERAGE}
    key = str(op).lower()
    try:
        return aliases.get(key) or ReduceOp(key)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in ReduceOp)
        raise ValueError(f"{argument} must be one of {choices}, got {op!r}") from None


class Handle:
    """An operation in flight: ``wait()`` blocks until it is done and returns its result.

    A backend completes a handle by calling ``set_result`` or ``set_exception`` from
    any thread; ``then`` functions run in the waiting thread, in order, once.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finishers: list[Callable[[Any], Any]] = []
        self._finished = False
        #: perf_counter() when the backend started the operation, if it knows (timelines)
        self.started_at: float | None = None
        #: perf_counter() when the backend completed the operation (for timelines)
        self.completed_at: float | None = None

    def set_result(self, result: Any) -> None:
        if self.completed_at is None:  # a backend may have stamped the real completion already
            self.completed_at = time.perf_counter()
        self._result = result
        self._done.set()

    def set_exception(self, error: BaseException) -> None:
        self.completed_at = time.perf_counter()
        self._error = error
        self._done.set()

    def then(self, finisher: Callable[[Any], Any]) -> Handle:
        """Apply ``finisher`` to the result when waited on; returns self for chaining."""
        self._finishers.append(finisher)
        return self

    def poll(self) -> bool:
        """Return True if the operation has completed (``wait`` would not block)."""
        return self._done.is_set()

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
        if self._error is not None:
            raise self._error
        if not self._finished:
            self._finished = True
            for finisher in self._finishers:
                self._result = finisher(self._result)
        return self._result


def completed(result: Any, name: str = "") -> Handle:
    """Return a handle that is already done."""
    handle = Handle(name)
    handle.set_result(result)
    return handle


class Communicator(abc.ABC):
    """Collectives over all ranks on torch tensors; one instance per backend.

    In-place methods end in ``_`` and return a Handle whose result is the tensor.
    Every rank must call collectives in the same order.
    """

    #: backend name: "mpi", "gloo", "nccl" or "local"
    name: str = "abstract"

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    @abc.abstractmethod
    def allreduce_async_(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        """Start reducing ``tensor`` in place across ranks."""

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks and return it (blocking)."""
        return self.allreduce_async_(tensor, op).wait()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Return the reduction of ``tensor`` across ranks, leaving it unchanged (blocking)."""
        return self.allreduce_(tensor.clone(memory_format=torch.contiguous_format), op)

    @abc.abstractmethod
    def broadcast_async_(self, tensor: torch.Tensor, root: int) -> Handle:
        """Start copying root's ``tensor`` into every rank's ``tensor``."""

    @abc.abstractmethod
    def allgather_async(self, tensor: torch.Tensor) -> Handle:
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

    def close(self) -> None:  # noqa: B027 - most backends have nothing to release
        """Release threads and communicators; the communicator is unusable afterwards."""
