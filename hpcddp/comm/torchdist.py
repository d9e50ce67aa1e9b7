"""Collectives through torch.distributed (nccl on GPUs, gloo on CPUs)."""

from __future__ import annotations

import collections
import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .base import Communicator, Handle, ReduceOp, completed

__all__ = ["TorchDistCommunicator", "join_process_group"]

# Far more than can be in flight at once (one per bucket), so a dropped Work is long done.
_KEPT_WORKS = 1024

_DIST_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def join_process_group(
    backend: str, rank: int, world_size: int, *, timeout_s: float = 1800, device: torch.device | None = None
) -> None:
    """Make torch.distributed's default group at the MASTER_ADDR/MASTER_PORT ``hpcddp.init()`` exported.

    Args:
        backend: "gloo" or "nccl".
        rank: this process's rank.
        world_size: the number of ranks.
        timeout_s: how long a collective (and the rendezvous) may wait.
        device: for nccl, this rank's GPU (binds the communicator to it).
    """
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (address and port):
        raise RuntimeError(
            "MASTER_ADDR/MASTER_PORT are not set: call hpcddp.init() first (it exports them), or set both"
        )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" and device is not None else {}),
    )


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
            if timeout is None:
                self._work.wait()
            elif not self._work.wait(timeout=datetime.timedelta(seconds=timeout)):
                return False
            self.set_result(self._pending_result)
        return True


class TorchDistCommunicator(Communicator):
    """Communicator over the default torch.distributed process group.

    Args:
        backend: "gloo" or "nccl"; the process group must already be initialised.
        device: where the backend wants tensors (a CUDA device for nccl).
    """

    def __init__(self, backend: str, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call hpcddp.init() first")
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.name = backend
        self.device = device
        self._recent_works: collections.deque = collections.deque(maxlen=_KEPT_WORKS)

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
            work = self._keep(dist.all_reduce(staged, op=_DIST_OPS[op], async_op=True))
            handle = _WorkHandle(work, staged, "allreduce")
        if op is ReduceOp.AVERAGE:
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def broadcast_async_(self, tensor: torch.Tensor, root: int) -> Handle:
        staged = self._on_device(tensor)
        work = self._keep(dist.broadcast(staged, src=root, async_op=True))
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
        work = self._keep(dist.all_gather(pieces, padded, async_op=True))
        handle = _WorkHandle(work, pieces, "allgather")
        return handle.then(lambda out: torch.cat([p[:n] for p, n in zip(out, rows)]).to(tensor.device))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=root, device=self._object_device())
        return holder[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, dst=root)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def _object_device(self):
        return self.device if self.name == "nccl" else None

    def close(self) -> None:
        if dist.is_initialized():
            if self.size > 1:  # leave together: no peer is still inside a collective
                # Kept too: gloo's barrier holds the Works before it (see _keep).
                self._keep(dist.barrier(async_op=True)).wait()
            dist.destroy_process_group()
