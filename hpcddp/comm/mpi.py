"""Collectives through mpi4py, run in order on one communication thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._mpi import import_mpi
from ..stall import CollectiveLog, StallInspector
from ._mpi_buffers import NUMPY_DTYPE_NAMES, MPIOps, bytes_view, dtype_name, empty_like, explain_failure, staged
from ._mpi_ops import VectorOps
from ._workqueue import QueuedHandle, WorkQueue
from .agreement import (
    JOINED,
    JOINED_VECTOR,
    Signature,
    agreement_vector,
    all_joined,
    mismatch_error,
    signature,
    some_joined,
)
from .base import Communicator, Handle, ReduceOp, split_ranks_error
from .hierarchy import HIERARCHY_MIN_BYTES, hierarchy_for

__all__ = ["MPICommunicator"]


class MPICommunicator(VectorOps, Communicator):
    """Communicator over an MPI communicator (COMM_WORLD by default).

    Blocking MPI collectives run on a dedicated thread in submission order: Open
    MPI's blocking Allreduce moved 16 MiB 2.7x faster than its non-blocking
    Iallreduce (libnbc) here, and the thread lets it overlap the caller's compute
    while mpi4py releases the GIL. Tensors on a GPU are staged through host memory.
    Point-to-point sends and receives bypass the thread (non-blocking requests), so
    a receive that waits for its peer never holds up the collectives.

    Args:
        comm: an mpi4py communicator; it is duplicated, so hpcddp's traffic never
            mixes with the caller's.
        stall_timeout: seconds a collective may wait before the stall inspector
            reports the missing ranks (see ``hpcddp.stall``); 0 turns it off.
        stall_action: "abort" or "warn" (see ``hpcddp.stall.StallInspector``).
        stall_abort_after: seconds a stall may last before the job ends; 0 never.
        hierarchical: allreduce in two levels (inside nodes, then between them; see
            ``hpcddp.comm.hierarchy``).
    """

    name = "mpi"

    def __init__(
        self,
        comm=None,
        *,
        stall_timeout: float = 0,
        stall_action: str = "abort",
        stall_abort_after: float = 0,
        hierarchical: bool = False,
    ) -> None:
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._side = self._comm.Dup()  # for barrier_now, beside the collectives' communicator
        super().__init__(self._comm.Get_rank(), self._comm.Get_size())
        self._ops = MPIOps(MPI)
        self._plain_ops = self._ops.plain
        self._stall = {
            "stall_timeout": stall_timeout,
            "stall_action": stall_action,
            "stall_abort_after": stall_abort_after,
        }
        self._hierarchy = hierarchy_for(self._comm, MPI, hierarchical)
        self._queue = WorkQueue()
        self._agreement_vectors: dict[tuple, tuple[Signature, np.ndarray]] = {}
        self._reduced = np.empty(len(JOINED_VECTOR), dtype=np.int64)  # used by one thread at a time (the runner)
        self._submit_lock = threading.Lock()
        self.collectives = CollectiveLog()
        self._inspector = None
        if stall_timeout > 0 and self.size > 1:
            self._inspector = StallInspector(
                self._comm.Dup(), self.collectives, stall_timeout, stall_action, stall_abort_after
            )
        self._thread = threading.Thread(target=self._serve, name="hpcddp-mpi", daemon=True)
        self._thread.start()

    @property
    def mpi_comm(self):
        """The (duplicated) mpi4py communicator this backend talks on."""
        return self._comm

    # -- the communication thread ------------------------------------------------
    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._execute(item)

    def _execute(self, item) -> None:
        work, handle, desc = item
        self.collectives.start(desc)
        handle.started_at = time.perf_counter()
        try:
            handle.set_result(work())
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            handle.set_exception(explain_failure(err, desc))
        finally:
            self.collectives.finish()
            self._queue.release()

    def _help_until(self, handle: Handle) -> None:
        """Run queued collectives in this thread, in order, until ``handle``'s is done or another thread runs one."""
        while not handle.poll():
            item = self._queue.steal()
            if item is None:
                return
            self._execute(item)

    def _agree(self, sig: Signature) -> None:
        """Compare ``sig`` across ranks (a collective); raise CollectiveMismatchError on every rank if they differ."""
        self._agree_vector(np.array(agreement_vector(sig), dtype=np.int64), sig)

    def agree(self, sig: Signature, *, sleep_while_waiting: bool = False) -> None:
        """Check now that every rank describes its next collective as ``sig`` (unless checks are off).

        For ``run_async`` work that makes its own MPI calls: call it first, on the
        communication thread. Raises CollectiveMismatchError on every rank alike.

        Args:
            sig: this rank's description of the collective.
            sleep_while_waiting: wait for late ranks in short sleeps instead of
                MPI's busy polling, which takes half of a core that this thread
                shares with the training thread (torch DDP launches a bucket, then
                goes on with backward while the other ranks catch up).
        """
        if self.check_collectives and self.size > 1:
            vector = np.array(agreement_vector(sig), dtype=np.int64)
            self._agree_vector(vector, sig, sleep_while_waiting)

    def _agree_allreduce(self, tensor: torch.Tensor, op: ReduceOp, check: str) -> None:
        # The hot path: a training loop reduces the same shapes again and again, and
        # hashing a signature costs more than the small Allreduce it feeds.
        key = (tensor.shape, tensor.dtype, op, check)
        cached = self._agreement_vectors.get(key)
        if cached is None:
            if len(self._agreement_vectors) > 1024:
                self._agreement_vectors.clear()
            sig = signature("allreduce", tensor, reduce_op=op, name=check)
            cached = self._agreement_vectors[key] = (sig, np.array(agreement_vector(sig), dtype=np.int64))
        self._agree_vector(cached[1], cached[0])

    def _agree_vector(self, vector: np.ndarray, sig: Signature, sleep_while_waiting: bool = False) -> None:
        reduced = self._reduced
        if sleep_while_waiting:
            _wait_sleeping(self._comm.Iallreduce(vector, reduced, op=self._MPI.MIN))
        else:
            self._comm.Allreduce(vector, reduced, op=self._MPI.MIN)
        low, minus_high, minus_error, _, minus_joined = reduced.tolist()
        if low != -minus_high or minus_error or minus_joined:
            signatures = self._comm.allgather(sig)
            if not (some_joined(reduced) and _continues_while_joined(signatures)):
                raise mismatch_error(signatures)

    def join(self) -> int:
        """Stand in for this rank in the others' checked collectives until every rank joins (Horovod's join).

        Sum and average allreduces of the others go on with zeros from this rank (an
        average still divides by ``size``); any other checked collective raises
        CollectiveMismatchError on the ranks that called it. Collective; returns the
        rank that joined last, the same on every rank.
        """
        comm, MPI = self._comm, self._MPI

        def work():
            rounds = 0
            while True:
                reduced = np.empty(len(JOINED_VECTOR), dtype=np.int64)
                comm.Allreduce(np.array(JOINED_VECTOR, dtype=np.int64), reduced, op=MPI.MIN)
                if all_joined(reduced):
                    break
                rounds += 1
                signatures = comm.allgather(JOINED)
                if _continues_while_joined(signatures):
                    sig = next(s for s in signatures if s.op != JOINED.op)
                    zeros = torch.zeros(sig.shape, dtype=getattr(torch, sig.dtype))
                    op = ReduceOp(sig.reduce_op)
                    # The same algorithm as the ranks still reducing (flat or two-level).
                    self._reduce_in_place(self._ops.buffer(zeros), self._ops.op(zeros.dtype, op), zeros.nbytes)
            waited = comm.allgather(rounds)
            return min(range(self.size), key=lambda r: (waited[r], -r))

        return self._submit(work, "join").wait()

    def _submit(
        self,
        work: Callable[[], Any],
        name: str,
        tensor: torch.Tensor | None = None,
        wake: bool = True,
        sig: Signature | None = None,
    ) -> Handle:
        if sig is not None:
            unchecked = work

            def work():
                self._agree(sig)
                return unchecked()

        handle = QueuedHandle(name, self._help_until)
        with self._submit_lock:
            shape, dtype = (None, None) if tensor is None else (tensor.shape, dtype_name(tensor.dtype))
            self._queue.put((work, handle, self.collectives.submit(name, shape, dtype)), wake)
        return handle

    def run_async(
        self, work: Callable[[], Any], name: str, tensor: torch.Tensor | None = None, wake: bool = True
    ) -> Handle:
        """Run ``work()`` on the communication thread after the collectives queued before it.

        For callers that make their own MPI calls on ``mpi_comm`` (the torch.distributed
        backend): they keep the order every rank must follow and the stall inspector sees them.

        Args:
            work: makes the MPI calls; its return value is the handle's result.
            name: the collective's name, for the stall inspector.
            tensor: its shape and dtype go into the stall report.
            wake: False when the caller waits for the handle at once (it then runs
                ``work`` itself unless the thread is busy).
        """
        if not self._thread.is_alive():
            raise RuntimeError(
                f"{name}: hpcddp.shutdown() closed this communicator: call dist.destroy_process_group() "
                "before hpcddp.shutdown(), not torch.distributed collectives after it"
            )
        return self._submit(work, name, tensor, wake)

    def _checked(self, check: str | None, op: str, tensor=None, error: str | None = None, **fields) -> Signature | None:
        """Return the signature to agree on before ``op``, or None; raise ``error`` at once when unchecked."""
        if not self._checking(check):
            if error is not None:
                raise ValueError(error)
            return None
        return signature(op, tensor, error=error, name=check, **fields)

    def close(self) -> None:
        if self._inspector is not None:
            self._inspector.stop()
            self._inspector._comm.Free()
            self._inspector = None
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            if self._hierarchy is not None:
                self._hierarchy.free()
            self._side.Free()
            self._comm.Free()

    # -- collectives ----------------------------------------------------------------
    def allreduce_async_(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> Handle:
        return self._allreduce(tensor, op, True, check)

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        if self._reduce_now(tensor, tensor, op, check):
            return tensor.div_(self.size) if op is ReduceOp.AVERAGE else tensor
        return self._allreduce(tensor, op, False, check).wait()

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        # Out of place as MPI does it (send buffer to receive buffer): no copy first.
        out = empty_like(tensor)
        if self._reduce_now(tensor, out, op, check):
            return out.div_(self.size) if op is ReduceOp.AVERAGE else out
        return self._allreduce(out.copy_(tensor), op, False, check).wait()

    def _reduce_now(self, source: torch.Tensor, out: torch.Tensor, op: ReduceOp, check: str | None) -> bool:
        """Reduce ``source`` into ``out`` in this thread if nothing is queued; False if it cannot."""
        # The caller waits at once, so it runs the collective itself: no wake-up
        # of the communication thread (see WorkQueue.put). With nothing queued it
        # skips the handle and queue too: that Python costs ~50 us per call once a
        # MiB-sized message has flushed the caches, 15-20% of a 1-2 MiB allreduce.
        # Every line here runs with caches just flushed by the last message: keep it short.
        dtype = source.dtype
        name = NUMPY_DTYPE_NAMES.get(dtype)
        if name is None or self.size == 1 or source.is_cuda or not source.is_contiguous():
            return False
        if op is ReduceOp.AVERAGE and not dtype.is_floating_point:
            raise TypeError(f"op='average' needs a floating-point tensor, got {dtype}: use op='sum'")
        with self._submit_lock:
            desc = self._queue.claim() and self.collectives.submit("allreduce", source.shape, name, start=True)
        if not desc:
            return False
        try:
            if check is not None and self.check_collectives:
                self._agree_allreduce(source, op, check)
            mpi_op = self._plain_ops[op]
            if source is out:
                self._reduce_in_place(out.numpy(), mpi_op, out.nbytes)
            elif self._hierarchy is not None and out.nbytes >= HIERARCHY_MIN_BYTES:
                self._hierarchy.allreduce(out.copy_(source).numpy(), mpi_op)
            else:
                self._comm.Allreduce(source.numpy(), out.numpy(), op=mpi_op)
        except BaseException as err:
            raise explain_failure(err, desc) from None
        finally:
            self.collectives.finish()
            self._queue.release()
        return True

    def _reduce_in_place(self, spec, mpi_op, nbytes: int) -> None:
        if self._hierarchy is not None and nbytes >= HIERARCHY_MIN_BYTES:
            self._hierarchy.allreduce(spec, mpi_op)
        else:
            self._comm.Allreduce(self._MPI.IN_PLACE, spec, op=mpi_op)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, wake: bool, check: str | None) -> Handle:
        self._ops.check_reducible(tensor.dtype, op)
        sig = self._checked(check, "allreduce", tensor, reduce_op=op)
        buf = staged(tensor)
        spec, mpi_op = self._ops.buffer(buf), self._ops.op(tensor.dtype, op)

        def work():
            if self.size > 1:
                self._reduce_in_place(spec, mpi_op, buf.nbytes)
            return buf

        handle = self._submit(work, "allreduce", tensor, wake, sig)
        if op is ReduceOp.AVERAGE:
            handle.then(lambda out: out.div_(self.size))
        return handle.then(lambda out: out if out is tensor else tensor.copy_(out))

    def broadcast_async_(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        sig = self._checked(check, "broadcast", tensor, root=root)
        buf = staged(tensor)
        raw, comm = bytes_view(buf), self._comm

        def work():
            comm.Bcast(raw, root=root)
            return buf

        return self._submit(work, "broadcast", tensor, sig=sig).then(
            lambda out: out if out is tensor else tensor.copy_(out)
        )

    def allgather_async(self, tensor: torch.Tensor, *, check: str | None = None) -> Handle:
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        sig = self._checked(check, "allgather", source, rows_may_differ=True)
        comm = self._comm

        def work():
            rows = comm.allgather(source.shape[0])
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            row_bytes = int(np.prod(source.shape[1:], dtype=np.int64)) * source.element_size()
            counts = [r * row_bytes for r in rows]
            displs = np.cumsum([0, *counts[:-1]]).tolist()
            comm.Allgatherv(bytes_view(source), [bytes_view(out), counts, displs, self._MPI.BYTE])
            return out

        return self._submit(work, "allgather", tensor, sig=sig).then(lambda out: out.to(tensor.device))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self._submit(lambda: self._comm.bcast(obj, root=root), "broadcast_object").wait()

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._submit(lambda: self._comm.allgather(obj), "allgather_object").wait()

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return self._submit(lambda: self._comm.gather(obj, root=root), "gather_object").wait()

    def barrier(self) -> None:
        self._submit(self._comm.Barrier, "barrier").wait()

    def barrier_now(self) -> None:
        """Block until every rank reaches this call, without waiting for this rank's queued collectives.

        Horovod's barrier: a rank may pass it with an allreduce still pending, which
        the others submit after the barrier.
        """
        self._side.Barrier()

    def split(self, ranks: list[int]) -> MPICommunicator | None:
        members = list(ranks)
        error = split_ranks_error(members, self.size)
        sig = self._checked("", "split", error=error, splits=members if error is None else None)
        MPI, comm = self._MPI, self._comm

        def work():
            if self.rank in members:
                return comm.Split(0, members.index(self.rank))
            return comm.Split(MPI.UNDEFINED, 0)

        sub = self._submit(work, "split", sig=sig).wait()
        if sub == MPI.COMM_NULL:
            return None
        try:
            child = MPICommunicator(sub, **self._stall)
        finally:
            sub.Free()
        child.check_collectives = self.check_collectives
        return child


def _wait_sleeping(request, longest_sleep: float = 250e-6) -> None:
    """Complete ``request``, sleeping between tests: 10 us at first, doubling to ``longest_sleep``.

    The cap bounds the delay after the last rank arrives; waking 4000 times a second
    costs a few percent of a core, far less than MPI's polling.
    """
    pause = 10e-6
    while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, longest_sleep)


def _continues_while_joined(signatures: list[Signature]) -> bool:
    """Return True when the ranks that have not joined agree on a sum or average allreduce."""
    active = [s for s in signatures if s.op != JOINED.op]
    return (
        bool(active)
        and len({s.compared() for s in active}) == 1
        and not any(s.error for s in active)
        and active[0].op == "allreduce"
        and active[0].reduce_op in (ReduceOp.SUM.value, ReduceOp.AVERAGE.value)
    )
