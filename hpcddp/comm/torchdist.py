"""Collectives through torch.distributed (nccl on GPUs, gloo on CPUs)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..stall import CollectiveLog, StallInspector
from .base import Communicator, Handle, ReduceOp, completed

__all__ = ["TorchDistCommunicator"]

# Far more than can be in flight at once (one per bucket), so a dropped Work is long done.
_KEPT_WORKS = 1024

_DIST_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class _WorkHandle(Handle):
    """A Handle over a torch.distributed Work; waiting on it yields ``result``."""

    def __init__(self, work, result: Any, name: str) -> None:
        super().__init__(name)
        self._work = work
        self._pending_result = result
        # Stamp the completion when the backend reaches it, not when someone waits
        # (the timeline's allreduce spans would otherwise last until step()).
        try:
            work.get_future().add_done_callback(self._stamp_completion)
        except (AttributeError, RuntimeError):  # a backend without futures: stamped at wait()
            pass

    def _stamp_completion(self, _future) -> None:
        if self.completed_at is None:
            self.completed_at = time.perf_counter()

    def poll(self) -> bool:
        return self._done.is_set() or self._work.is_completed()

    def _block(self, timeout: float | None) -> bool:
        if not self._done.is_set():
            try:
                if timeout is None:
                    self._work.wait()
                elif not self._work.wait(timeout=datetime.timedelta(seconds=timeout)):
                    return False
            except RuntimeError as err:
                raise _explain_timeout(err, self.name) from None
            self.set_result(self._pending_result)
        return True


def _explain_timeout(err: RuntimeError, collective: str) -> RuntimeError:
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


class TorchDistCommunicator(Communicator):
    """Communicator over the default torch.distributed process group.

    Args:
        backend: "gloo" or "nccl"; the process group must already be initialised.
        device: where the backend wants tensors (a CUDA device for nccl).
    """

    def __init__(
        self,
        backend: str,
        device: torch.device,
        *,
        inspector_comm=None,
        stall_timeout: float = 0,
        stall_action: str = "abort",
        stall_abort_after: float = 0,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call hpcddp.init() first")
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.name = backend
        self.device = device
        self._recent_works: collections.deque = collections.deque(maxlen=_KEPT_WORKS)
        self.collectives = CollectiveLog()
        self._inspector = None
        if inspector_comm is not None and stall_timeout > 0 and self.size > 1:
            # torch.distributed cannot say which rank is missing; MPI, which started
            # the ranks, carries the stall inspector's questions beside it.
            self._inspector = StallInspector(
                inspector_comm.Dup(), self.collectives, stall_timeout, stall_action, stall_abort_after
            )

    def _track(self, work, name: str, tensor: torch.Tensor | None = None):
        """Record ``work`` for the stall inspector until it completes, and keep it (see ``_keep``)."""
        if self._inspector is not None:
            shape, dtype = (None, None) if tensor is None else (tensor.shape, str(tensor.dtype).removeprefix("torch."))
            desc = self.collectives.submit(name, shape, dtype, start=True)
            work.get_future().add_done_callback(lambda _future: self.collectives.finish(desc))
        return self._keep(work)

    def _keep(self, work):
        # gloo's worker thread may drop the last reference to a Work, whose destructor
        # takes the GIL (a Work launched in backward captured Python state); during
        # interpreter exit that thread then dies mid-destructor and std::terminate aborts
        # the process (seen 1 run in 2 with 4 buckets). Holding recent Works here, until
        # this object dies, makes the main thread the one to destroy them.
        self._recent_works.append(work)
        return work

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device and tensor.is_contiguous():
            return tensor
        return tensor.to(self.device).contiguous()

    def allreduce_async_(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        if op is ReduceOp.AVERAGE and not tensor.dtype.is_floating_point:
            raise TypeError(f"op='average' needs a floating-point tensor, got {tensor.dtype}: use op='sum'")
        staged = self._on_device(tensor)
        if self.size == 1:
            handle = completed(staged, "allreduce")
        else:
            work = self._track(dist.all_reduce(staged, op=_DIST_OPS[op], async_op=True), "allreduce", staged)
            handle = _WorkHandle(work, staged, "allreduce")
        if op is ReduceOp.AVERAGE:
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def broadcast_async_(self, tensor: torch.Tensor, root: int) -> Handle:
        staged = self._on_device(tensor)
        work = self._track(dist.broadcast(staged, src=root, async_op=True), "broadcast", staged)
        handle = _WorkHandle(work, staged, "broadcast")
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        source = self._on_device(tensor.detach())
        if source.dim() == 0:
            source = source.reshape(1)
        # torch.distributed gathers equal shapes only: pad the first dimension to
        # the longest rank's, then cut each piece back.
        rows = self.allgather_object(source.shape[0])
        longest = max(rows)
        padded = torch.zeros((longest, *source.shape[1:]), dtype=source.dtype, device=source.device)
        padded[: source.shape[0]] = source
        pieces = [torch.empty_like(padded) for _ in rows]
        work = self._track(dist.all_gather(pieces, padded, async_op=True), "allgather", padded)
        handle = _WorkHandle(work, pieces, "allgather")
        return handle.then(lambda out: torch.cat([p[:n] for p, n in zip(out, rows)]).to(tensor.device))

    @contextlib.contextmanager
    def _blocking(self, name: str) -> Iterator[None]:
        """Around a blocking torch.distributed call: stall records and timeout messages."""
        desc = self.collectives.submit(name, start=True) if self._inspector is not None else None
        try:
            yield
        except RuntimeError as err:
            raise _explain_timeout(err, name) from None
        finally:
            if desc is not None:
                self.collectives.finish(desc)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        holder = [obj]
        with self._blocking("broadcast_object"):
            dist.broadcast_object_list(holder, src=root, device=self._object_device())
        return holder[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        with self._blocking("allgather_object"):
            dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        with self._blocking("gather_object"):
            dist.gather_object(obj, out, dst=root)
        return out

    def barrier(self) -> None:
        with self._blocking("barrier"):
            dist.barrier()

    def _object_device(self):
        return self.device if self.name == "nccl" else None

    def close(self) -> None:
        if self._inspector is not None:
            self._inspector.stop()
            self._inspector._comm.Free()
            self._inspector = None
        if dist.is_initialized():
            if self.size > 1:  # leave together: no peer is still inside a collective
                # Kept too: gloo's barrier holds the Works before it (see _keep).
                self._keep(dist.barrier(async_op=True)).wait()
            dist.destroy_process_group()
        # Also when the script destroyed the group itself: the kept Works (and what
        # they hold of the group) go now, on this thread, not during interpreter
        # teardown from whichever object happens to hold this communicator last.
        self._recent_works.clear()
