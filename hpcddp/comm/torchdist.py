"""Collectives through torch.distributed (nccl on GPUs, gloo on CPUs)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import oplog
from ._cuda_events import GpuCompletion, is_cuda_tensor
from ._torchdist_work import Agreeing, WorkHandle, explain_timeout, work_ended
from .agreement import CollectiveCall, agreement_vector, describe_call, disagrees, mismatch_error
from .base import (
    Communicator,
    Handle,
    ReduceOp,
    alltoall_splits,
    as_splits,
    completed,
    even_splits,
    split_ranks_error,
    splits_error,
)
from .dtypes import dtype_name
from .reduction import check_average, to_torch
from .rendezvous import DEFAULT_GROUP_LOCK, made_default_group
from .torchdist_channel import GroupChannels, TorchDistGradientChannel

__all__ = ["TorchDistCommunicator"]


log = logging.getLogger("hpcddp")


class RunningWorks:
    """The Works a communicator launched that may still be running; completed ones are let go.

    A Work holds its tensors (one kept per launch held 1,024 results of ``hvd.allreduce``
    alive, on a GPU too), so a completed one is dropped at a later launch, while the
    interpreter is alive: from the front as they complete in order, and by a sweep of
    the whole when the table has doubled (a Work that never completes, an ``irecv`` whose
    message never comes, stays without holding the ones behind it).
    """

    _SWEEP_AT_LEAST = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: collections.deque = collections.deque()
        self._sweep_at = self._SWEEP_AT_LEAST

    def add(self, work) -> None:
        with self._lock:
            works = self._works
            while works and work_ended(works[0]):
                works.popleft()
            works.append(work)
            if len(works) >= self._sweep_at:
                self._works = collections.deque(w for w in works if not work_ended(w))
                self._sweep_at = max(self._SWEEP_AT_LEAST, 2 * len(self._works))

    def clear(self) -> None:
        """Drop every Work (on the calling thread, which should be the main one)."""
        with self._lock:
            self._works.clear()

    def __len__(self) -> int:
        return len(self._works)


class TorchDistCommunicator(Communicator):
    """Communicator over a torch.distributed process group (the default one unless ``group`` is given).

    torch.distributed cannot say which rank is missing: the operations are recorded
    in an OperationLog, which the stall inspector reads over MPI when MPI started the
    ranks (``hpcddp.fault.stall``).

    Under torchrun the script makes the default group itself: given ``join``, the
    communicator starts before the group exists and looks it up at its first
    collective, making it with ``join`` if the script has not (every rank reaches
    that point at the same collective).

    Args:
        backend: "gloo" or "nccl"; without ``join``, the process group must already be initialised.
        device: where the backend wants tensors (a CUDA device for nccl).
        group: a group from ``dist.new_group`` (see ``split``); None: the default group.
        rank: with ``join``, this process's rank in the default group to come.
        size: with ``join``, that group's size.
        join: makes the default group when hpcddp needs it before the script made it.
        adopt_backend: ``backend`` was hpcddp.init()'s "auto" choice: a default group the
            script made with another backend (``init_process_group("mpi")`` after
            ``hpcddp.init()``) is used as the script made it, and this communicator takes
            its name, instead of an error.
    """

    _groups_made = 0

    def __init__(
        self,
        backend: str,
        device: torch.device,
        *,
        group=None,
        rank: int | None = None,
        size: int | None = None,
        join: Callable[[], None] | None = None,
        adopt_backend: bool = False,
    ) -> None:
        if join is None:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialised: call hpcddp.init() first")
            rank, size = dist.get_rank(group), dist.get_world_size(group)
        elif rank is None or size is None:
            raise TypeError("a TorchDistCommunicator with join= needs rank= and size=")
        super().__init__(rank, size)
        self._group = group
        self._join = join
        self._adopt_backend = adopt_backend
        self.name = backend
        self.device = device
        self._running_works = RunningWorks()
        #: what the optimizers' gradient channels on this group share (``torchdist_channel``)
        self.gradient_channels = GroupChannels()
        # nccl's collectives in launch order, until their kernels ran (NCCL runs them in that order)
        self._gpu_running: collections.deque = collections.deque()
        self._gpu_lock = threading.Lock()
        members = tuple(range(self.size)) if group is None else tuple(dist.get_process_group_ranks(group))
        # Groups are made in the same order on every member: their count names them alike. The
        # members go in as a digest: the key travels in every stall-inspector reply (constant size).
        TorchDistCommunicator._groups_made += 1
        digest = hashlib.blake2b(repr(members).encode(), digest_size=6).hexdigest()
        self.log = oplog.OperationLog(f"{backend}:{TorchDistCommunicator._groups_made}:{digest}", members)
        oplog.register(self.log)
        if backend == "nccl":
            self.log.add_refresher(self._finish_gpu_work)

    @property
    def group(self):
        """The process group the collectives run on (None: the default group, joined here on first use)."""
        if self._join is not None:
            self._bind_default_group()
        return self._group

    def _bind_default_group(self) -> None:
        with DEFAULT_GROUP_LOCK:
            if self._join is None:
                return
            if not dist.is_initialized():
                self._join()
            self._check_default_group()  # until it passes, every collective raises again
            self._join = None

    def _check_default_group(self) -> None:
        found = (dist.get_rank(), dist.get_world_size())
        if found != (self.rank, self.size):
            raise RuntimeError(
                f"the default process group has rank {found[0]} of {found[1]}, but the launcher's RANK/WORLD_SIZE "
                f"say {self.rank} of {self.size}: call init_process_group without rank= and world_size= "
                "(env:// reads the launcher's)"
            )
        made = str(dist.get_backend())
        if self.name not in {part.rpartition(":")[2] for part in made.replace(",", " ").split()}:
            if self._adopt_backend:
                log.warning(
                    "hpcddp: the script made torch.distributed's default group with %r: hpcddp's collectives run on "
                    "it too (backend 'auto' had chosen %r)",
                    made,
                    self.name,
                )
                self.name = made
                return
            raise RuntimeError(
                f"the default process group is {made!r} but hpcddp.init() chose {self.name!r} for {self.device}: "
                f"use one backend for both (init_process_group({self.name!r}), or hpcddp.init(backend=...) "
                "or HPCDDP_BACKEND naming the script's)"
            )

    def _track(
        self, work, name: str, tensor: torch.Tensor | None = None, *, label: str = "", step: int | None = None
    ) -> GpuCompletion | None:
        """Record ``work`` for the stall inspector until it completes, and keep it (see ``_keep``).

        Returns its ``GpuCompletion`` on nccl with CUDA tensors (whose Work's future completes
        when the kernel is queued, not when it ran), else None.

        Args:
            work: the torch.distributed Work.
            name: the collective (``hpcddp.comm.names``).
            tensor: its tensor (shape and dtype are logged), if any.
            label: what it is for, e.g. "bucket 2 of step 7" (stall reports).
            step: the training step it belongs to.
        """
        shape, dtype = (None, None) if tensor is None else (tensor.shape, dtype_name(tensor.dtype))
        seq = self.log.start(oplog.describe(name, shape, dtype, label=label, step=step))
        self._keep(work)
        if self.name == "nccl" and is_cuda_tensor(tensor):
            completion = GpuCompletion(work, tensor)
            self._gpu_running.append((seq, completion))
            self._finish_gpu_work()
            return completion
        work.get_future().add_done_callback(lambda _future: self.log.finish(seq))
        return None

    def _finish_gpu_work(self) -> None:
        """Mark the collectives whose kernels ran as finished in the log (called at each launch and by the inspector)."""
        with self._gpu_lock:
            while self._gpu_running and self._gpu_running[0][1].query():
                self.log.finish(self._gpu_running.popleft()[0])

    def _handle(
        self, work, name: str, tensor: torch.Tensor, result: Any, *, label: str = "", step: int | None = None
    ) -> WorkHandle:
        """Return a WorkHandle over ``work`` that yields ``result``, tracked as ``_track`` does."""
        return WorkHandle(work, result, name, completion=self._track(work, name, tensor, label=label, step=step))

    def _keep(self, work):
        # gloo's worker thread may drop the last reference to a Work, whose destructor
        # takes the GIL (a Work launched in backward captured Python state); during
        # interpreter exit that thread then dies mid-destructor and std::terminate aborts
        # the process (seen 1 run in 2 with 4 buckets). Works still running are held
        # here, so that close() on the main thread destroys them.
        self._running_works.add(work)
        return work

    def _torch_op(self, op: ReduceOp):
        """Return the ``dist.ReduceOp`` to send ``op`` as: NCCL averages inside the collective itself."""
        # Dividing after the sum happens only in wait(): on nccl the Work completes with the
        # kernel, so a caller that polls an in-place average would read the sum (issue 34, item 8).
        return dist.ReduceOp.AVG if self.name == "nccl" and op is ReduceOp.AVERAGE else to_torch(op)

    def _divides_after(self, op: ReduceOp) -> bool:
        """True when an average travels as a sum that ``wait()`` divides (gloo has no AVG)."""
        return op is ReduceOp.AVERAGE and self.name != "nccl"

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device and tensor.is_contiguous():
            return tensor
        return tensor.to(self.device).contiguous()

    def allreduce_async_(
        self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        check_average(tensor.dtype, op)
        self._verify(check, "allreduce", tensor, label=label, step=step, reduce_op=op)
        staged = self._on_device(tensor)
        if self.size == 1:
            handle = completed(staged, "allreduce")
        else:
            work = dist.all_reduce(staged, op=self._torch_op(op), group=self.group, async_op=True)
            handle = self._handle(work, "allreduce", staged, staged, label=label, step=step)
        if self._divides_after(op):
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def broadcast_async_(
        self, tensor: torch.Tensor, root: int, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        self._verify(check, "broadcast", tensor, label=label, step=step, root=root)
        staged = self._on_device(tensor)
        work = dist.broadcast(staged, src=self._global(root), group=self.group, async_op=True)
        handle = self._handle(work, "broadcast", staged, staged, label=label, step=step)
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def allgather_async(
        self, tensor: torch.Tensor, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        source = self._on_device(tensor.detach())
        if source.dim() == 0:
            source = source.reshape(1)
        self._verify(check, "allgather", source, label=label, step=step)
        # torch.distributed gathers equal shapes only: pad the first dimension to
        # the longest rank's, then cut each piece back.
        rows = self._gather_objects(source.shape[0], label=label, step=step)
        padded = self._padded(source, max(rows))
        pieces = [torch.empty_like(padded) for _ in rows]
        work = dist.all_gather(pieces, padded, group=self.group, async_op=True)
        handle = self._handle(work, "allgather", padded, pieces, label=label, step=step)
        return handle.then(lambda out: torch.cat([p[:n] for p, n in zip(out, rows)]).to(tensor.device))

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

    @contextlib.contextmanager
    def _blocking(self, name: str, *, label: str = "", step: int | None = None) -> Iterator[None]:
        """Around a blocking torch.distributed call: stall records and timeout messages."""
        seq = self.log.start(oplog.describe(name, label=label, step=step), blocking=True)
        try:
            yield
        except RuntimeError as err:
            raise explain_timeout(err, name) from None
        finally:
            self.log.finish(seq)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        holder = [obj]
        with self._blocking("broadcast_object"):
            dist.broadcast_object_list(holder, src=self._global(root), group=self.group, device=self._object_device())
        return holder[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._gather_objects(obj)

    def _gather_objects(self, obj: Any, *, label: str = "", step: int | None = None) -> list[Any]:
        """``allgather_object``, logged as part of the collective of ``label`` and ``step``."""
        out: list[Any] = [None] * self.size
        with self._blocking("allgather_object", label=label, step=step):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        with self._blocking("gather_object"):
            dist.gather_object(obj, out, dst=self._global(root), group=self.group)
        return out

    def barrier(self) -> None:
        with self._blocking("barrier"):
            dist.barrier(group=self.group)

    def _object_device(self):
        return self.device if self.name == "nccl" else None

    def split(self, ranks: list[int]) -> TorchDistCommunicator | None:
        members = list(ranks)
        error = split_ranks_error(members, self.size)
        if error is None and members != sorted(members):
            # torch.distributed numbers a group's ranks in ascending order of their global ranks.
            error = f"ranks must be in ascending order for a {self.name} sub-communicator, got {members}: sort them"
        self._verify("" if self.check_collectives else None, "split", error=error, splits=None if error else members)
        global_members = [self._global(r) for r in members]
        if self.group is None:  # every rank of the default group must create every group
            group = dist.new_group(global_members)
        elif self.rank in members:
            group = dist.new_group(global_members, use_local_synchronization=True)
        else:
            group = None
        if self.rank not in members:
            return None
        child = TorchDistCommunicator(self.name, self.device, group=group)
        child.check_collectives = self.check_collectives
        return child

    def gradient_channel(self) -> TorchDistGradientChannel:
        """Return the step agreement of one optimizer's buckets, which run on this group (``torchdist_channel``)."""
        return TorchDistGradientChannel(self)

    def close(self) -> None:
        oplog.unregister(self.log)
        if self._group is not None:  # a sub-communicator: the default group stays
            if dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._running_works.clear()
            return
        # A group the script made stays the script's until the process ends.
        if dist.is_initialized() and (made_default_group() or self.process_ending):
            if self.size > 1:  # leave together: no peer is still inside a collective
                # Kept too: gloo's barrier holds the Works before it (see _keep).
                self._keep(dist.barrier(async_op=True)).wait()
            dist.destroy_process_group()
        # Also when the script destroyed the group itself: the kept Works (and what
        # they hold of the group) go now, on this thread, not during interpreter
        # teardown from whichever object happens to hold this communicator last.
        self._running_works.clear()
