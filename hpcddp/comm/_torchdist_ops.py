"""The torch.distributed backend's handles, agreement check, rooted and vector collectives and
point-to-point messages; mixed into TorchDistCommunicator."""

from __future__ import annotations

import datetime
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import oplog
from ._cuda_events import GpuCompletion
from .agreement import CollectiveCall, agreement_vector, describe_call, disagrees, mismatch_error
from .base import Handle, ReduceOp, alltoall_splits, as_splits, even_splits, splits_error
from .reduction import check_average

__all__ = ["Agreeing", "TorchDistOps", "WorkHandle", "explain_timeout", "work_ended"]


class Agreeing(NamedTuple):
    """An agreement in flight on a torch.distributed group (``TorchDistOps.start_agreement``)."""

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


class TorchDistOps:
    """reduce/gather/scatter/reducescatter/alltoall/send/recv and the agreement check over ``self.group``."""

    def _global(self, rank: int) -> int:
        """Return the default group's rank of this group's ``rank`` (torch.distributed's roots are global)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {rank}")
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _padded(self, source: torch.Tensor, rows: int) -> torch.Tensor:
        if source.shape[0] == rows:
            return source
        padded = torch.zeros((rows, *source.shape[1:]), dtype=source.dtype, device=source.device)
        padded[: source.shape[0]] = source
        return padded

    def _verify(
        self,
        check: str | None,
        op: str,
        tensor=None,
        error: str | None = None,
        *,
        label: str = "",
        step: int | None = None,
        **fields,
    ) -> None:
        """Run the agreement check when asked (raising on every rank); else raise ``error`` here.

        ``label`` and ``step`` label the agreement's collectives in the log (stall reports).
        """
        if not self._checking(check):
            if error is not None:
                raise ValueError(error)
            return
        call = describe_call(op, tensor, error=error, name=check or label, step=step, **fields)
        self.finish_agreement(self.start_agreement(call, label=label, step=step))

    def start_agreement(self, call: CollectiveCall, *, label: str = "", step: int | None = None) -> Agreeing:
        """Start the ranks' comparison of ``call`` (one small MIN allreduce); ``finish_agreement`` checks it.

        On a GPU the vector travels without a host sync: only ``finish_agreement`` waits for it.

        Args:
            call: what this rank is about to run.
            label: what it is for (stall reports).
            step: the training step it belongs to.
        """
        vector = torch.tensor(agreement_vector(call), dtype=torch.int64)
        if self.device.type == "cuda":
            vector = vector.pin_memory().to(self.device, non_blocking=True)
        # Tracked, so that the stall inspector sees a rank that never joins the agreement (one that exited).
        work = dist.all_reduce(vector, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        self._track(work, "agreement", vector, label=label, step=step)
        return Agreeing(call, vector, work, label, step)

    def finish_agreement(self, agreeing: Agreeing) -> None:
        """Wait for ``agreeing``; raise CollectiveMismatchError on every rank alike when the calls differ."""
        try:
            agreeing.work.wait()
        except RuntimeError as err:
            raise explain_timeout(err, agreeing.call.op) from None
        if disagrees(agreeing.vector.tolist()):
            raise mismatch_error(self._gather_objects(agreeing.call, label=agreeing.label, step=agreeing.step))

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        check_average(tensor.dtype, op)
        dst = self._global(root)
        self._verify(check, "reduce", tensor, root=root, reduce_op=op)
        is_root = self.rank == root
        # Backends may use a non-root's buffer as scratch: reduce a copy there.
        staged = self._on_device(tensor) if is_root else tensor.detach().to(self.device, copy=True).contiguous()
        work = dist.reduce(staged, dst=dst, op=self._torch_op(op), group=self.group, async_op=True)

        def finish(out: torch.Tensor) -> torch.Tensor:
            if not is_root:
                return tensor
            if self._divides_after(op):
                out.div_(self.size)
            return out if out is tensor else tensor.copy_(out)

        return self._handle(work, "reduce", staged, staged).then(finish)

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        dst = self._global(root)
        source = self._on_device(tensor.detach())
        if source.dim() == 0:
            source = source.reshape(1)
        self._verify(check, "gather", source, root=root)
        rows = self.allgather_object(source.shape[0])
        padded = self._padded(source, max(rows))
        pieces = [torch.empty_like(padded) for _ in rows] if self.rank == root else None
        work = dist.gather(padded, pieces, dst=dst, group=self.group, async_op=True)
        handle = self._handle(work, "gather", padded, pieces)
        return handle.then(
            lambda out: None if out is None else torch.cat([p[:n] for p, n in zip(out, rows)]).to(tensor.device)
        )

    def scatter_async_(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, check: str | None = None
    ) -> Handle:
        src = self._global(root)
        sizes = None
        if self.rank == root:
            if chunks is None or len(chunks) != self.size:
                length = "None" if chunks is None else f"{len(chunks)} tensors"
                sizes = f"chunks must be a list of {self.size} tensors on the root, got {length}"
            elif any(c.dtype != out.dtype for c in chunks):
                sizes = f"chunks must have out's dtype {out.dtype}, got {sorted({str(c.dtype) for c in chunks})}"
            else:
                sizes = [c.numel() for c in chunks]
        # Root's sizes first, so that a wrong-sized ``out`` is an error, not a half-filled tensor.
        sizes = self.broadcast_object(sizes, root)
        if isinstance(sizes, str):
            error = sizes
        else:
            error = None if sizes[self.rank] == out.numel() else (
                f"out holds {out.numel()} elements but root sends {sizes[self.rank]}"
            )  # fmt: skip
        if self._checking(check):
            self._verify(check, "scatter", out, root=root, error=error)
        elif isinstance(sizes, str):
            raise ValueError(f"scatter was not run: {error}")
        longest = max(sizes)
        flat = (
            [self._padded(c.detach().to(self.device).reshape(-1), longest) for c in chunks]
            if self.rank == root
            else None
        )
        received = torch.empty(longest, dtype=out.dtype, device=self.device)
        work = dist.scatter(received, flat, src=src, group=self.group, async_op=True)

        def finish(res: torch.Tensor) -> torch.Tensor:
            if error is not None:
                raise ValueError(f"scatter: {error}: pass an out tensor the size of chunks[{self.rank}]")
            return out.copy_(res[: out.numel()].reshape(out.shape))

        return self._handle(work, "scatter", received, received).then(finish)

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
        if tensor.dim() == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
        check_average(tensor.dtype, op)
        splits = even_splits(tensor.shape[0], self.size) if splits is None else as_splits(splits)
        error = splits_error(splits, tensor.shape[0], self.size)
        self._verify(check, "reducescatter", tensor, error, label=label, step=step, reduce_op=op, splits=splits)
        # gloo has no reduce_scatter and NCCL's wants equal pieces: reduce all, keep this rank's rows.
        full = tensor.detach().to(self.device, copy=True).contiguous()
        work = dist.all_reduce(full, op=self._torch_op(op), group=self.group, async_op=True)
        start = sum(splits[: self.rank])
        handle = self._handle(work, "reducescatter", full, full, label=label, step=step)
        if self._divides_after(op):
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out.narrow(0, start, splits[self.rank]).clone().to(tensor.device))

    def alltoall_async(
        self,
        tensor: torch.Tensor,
        splits: list[int] | None = None,
        *,
        check: str | None = None,
        label: str = "",
        step: int | None = None,
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
        source = self._on_device(tensor.detach())
        rows = source.shape[0]
        splits, error = alltoall_splits(splits, rows, self.size)
        self._verify(check, "alltoall", source, error=error, label=label, step=step)
        sent = torch.tensor(splits, dtype=torch.int64, device=self.device)
        received = torch.empty_like(sent)
        self._keep(dist.all_to_all_single(received, sent, group=self.group, async_op=True)).wait()
        received_rows = received.tolist()
        out = torch.empty((sum(received_rows), *source.shape[1:]), dtype=source.dtype, device=self.device)
        work = dist.all_to_all_single(
            out, source, output_split_sizes=received_rows, input_split_sizes=splits, group=self.group, async_op=True
        )
        handle = self._handle(work, "alltoall", source, out, label=label, step=step)
        return handle.then(lambda res: (res.to(tensor.device), received.cpu()))

    def send_async(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        staged = self._on_device(tensor.detach())
        work = dist.isend(staged, dst=self._global(dest), group=self.group, tag=tag)
        return WorkHandle(self._keep(work), tensor, "send")

    def recv_async_(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Handle:
        staged = self._on_device(tensor.detach())
        work = dist.irecv(staged, src=self._global(source), group=self.group, tag=tag)
        handle = WorkHandle(self._keep(work), staged, "recv")
        return handle.then(lambda out: tensor if out.data_ptr() == tensor.data_ptr() else tensor.copy_(out))
