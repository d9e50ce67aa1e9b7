"""Collectives through mpi4py, run by an ``Engine`` (see ``hpcddp.comm.mpi.engine`` for the rules).

``MPICommunicator`` plans every collective on an MPI communicator: allreduce, broadcast,
allgather, objects, barrier and join; the rooted and vector collectives (reduce, gather,
scatter, reducescatter, alltoall); and torch.distributed's ``_into`` forms, where every rank
sized its outputs. For those nothing is exchanged before the data (``hpcddp.comm.names``):
the agreement compares the shapes, and the transfer is one MPI call of equal blocks
(allgather, gather, scatter, reduce-scatter), or of counts that every rank first checks
against its peers' (alltoall). The torch backend (``hpcddp.torch_backend``) plans them, and
hpcddp's API may too.
"""

from __future__ import annotations

import functools
import secrets
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...env.mpi_import import import_mpi, require_thread_multiple
from .. import oplog
from ..agreement import (
    JOINED,
    JOINED_VECTOR,
    CollectiveCall,
    CollectiveMismatchError,
    all_joined,
    continues_while_joined,
    describe_call,
)
from ..base import (
    Communicator,
    Handle,
    ReduceOp,
    alltoall_splits,
    as_splits,
    even_splits,
    split_ranks_error,
    splits_error,
)
from ..dtypes import dtype_named
from ..reduction import check_reducible, divide_average_, mpi_op
from .bucket_sums import BucketSums
from .buffers import (
    bytes_view,
    displacements,
    empty_like,
    for_each_piece,
    layout_error,
    mpi_buffer,
    result_buffer,
    result_buffer_async,
    row_bytes,
    staged,
    write_back,
)
from .engine import Collective, Engine, EngineHandle
from .gradient_channel import GradientChannel
from .hierarchy import HIERARCHY_MIN_BYTES, hierarchy_for
from .monitored_barrier import MonitoredBarrier
from .p2p import PointToPoint, describe_tensors
from .planned_allreduce import PlannedAllreduces
from .shared_window import NodeSharedBytes
from .waits import wait_for_request

__all__ = ["MPICommunicator"]


def _run_each(bodies: list[Callable[[], Any]], result: Any) -> Callable[[], Any]:
    def body() -> Any:
        for run in bodies:
            run()
        return result

    return body


def _not_run() -> None:
    raise AssertionError("a collective with an argument error reached the runner")  # the agreement raises first


def _listed(tensors) -> list[torch.Tensor]:
    return tensors if isinstance(tensors, list) else [tensors]


def _write_parts(outputs: list[torch.Tensor], parts) -> None:
    """Copy each of ``parts`` (contiguous, in order) into the matching output."""
    for out, part in zip(outputs, parts):
        write_back(out)(part.reshape(out.shape))


def _row_bytes(tensor: torch.Tensor) -> int:
    # One row's bytes from the shape, never from numel / rows: a rank may send nothing (MoE routing).
    return row_bytes(tensor) if tensor.dim() else tensor.element_size()


def _sent(tensor, splits) -> tuple[torch.Tensor, list[int]]:
    """The bytes an alltoall sends, and how many go to each rank."""
    if isinstance(tensor, list):
        parts = [staged(t).reshape(-1).view(torch.uint8) for t in tensor]
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)), [p.numel() for p in parts]
    return staged(tensor).reshape(-1).view(torch.uint8), [int(n) * _row_bytes(tensor) for n in splits]


class MPICommunicator(Communicator):
    """Communicator over an MPI communicator (COMM_WORLD by default).

    Collectives run in submission order on a communication thread (or in the thread
    that waits for them, when the queue is idle), each after the ranks agreed on its
    metadata: Open MPI's blocking Allreduce moved 16 MiB 2.7x faster than its
    non-blocking Iallreduce (libnbc) here, and the thread lets it overlap the
    caller's compute while mpi4py releases the GIL. Tensors on a GPU are staged
    through host memory. Sends and receives bypass the queue (``p2p``).

    Args:
        comm: an mpi4py communicator; it is duplicated, so hpcddp's traffic never
            mixes with the caller's. Creating the communicator is collective over it.
        hierarchical: allreduce in two levels (inside nodes, then between them; see
            ``hpcddp.comm.mpi.hierarchy``); "auto" when the job spans nodes of several ranks.
        thread_name: its communication thread is ``hpcddp-<thread_name>``.
    """

    name = "mpi"
    agrees_in_background = True

    def __init__(self, comm=None, *, hierarchical: bool | str = False, thread_name: str = "mpi") -> None:
        MPI = import_mpi()
        require_thread_multiple(MPI)
        self._MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self._side = self._comm.Dup()  # for barrier_now, beside the collectives' communicator
        super().__init__(self._comm.Get_rank(), self._comm.Get_size())
        self._hierarchy = hierarchy_for(self._comm, MPI, hierarchical)
        self._node = None  # the ranks of this node, made on first use (node_comm)
        world = MPI.COMM_WORLD.Get_group()
        #: this communicator's ranks as ranks of the whole job
        self.global_ranks = tuple(self._comm.Get_group().Translate_ranks(list(range(self.size)), world))
        world.Free()
        key = self._comm.bcast(secrets.token_hex(6) if self.rank == 0 else None, root=0)
        self.log = oplog.OperationLog(key, self.global_ranks)
        oplog.register(self.log)
        self.p2p = PointToPoint(self._comm, MPI, self.log, self.global_ranks)
        self.engine = Engine(self._comm, MPI, self.log, name=thread_name, messages=self.p2p)
        #: in-place allreduces planned once per signature (the latency path; gradient buckets)
        self.planned_allreduces = PlannedAllreduces(
            self._comm, MPI, self.call_for, self.engine.agreement, hierarchical=self._hierarchy is not None
        )
        #: gloo's monitoredBarrier over this communicator's messages (``hpcddp.comm.mpi.monitored_barrier``)
        self.monitored = MonitoredBarrier(self.p2p)
        self._duplicates: weakref.WeakSet[MPICommunicator] = weakref.WeakSet()

    @property
    def check_collectives(self) -> bool:  # type: ignore[override]
        """Whether every collective first agrees on its metadata (``hpcddp.comm.mpi.engine``, rule 4)."""
        return self.engine.agreement.check_collectives

    @check_collectives.setter
    def check_collectives(self, value: bool) -> None:
        self.engine.agreement.check_collectives = bool(value)

    @property
    def mpi_comm(self):
        """The (duplicated) mpi4py communicator this backend talks on."""
        return self._comm

    # -- plumbing: the one way in (hpcddp.comm.mpi.engine) ----------------------------------
    def call_for(
        self,
        check: str | None,
        op: str,
        tensor=None,
        error: str | None = None,
        *,
        label: str = "",
        step: int | None = None,
        **fields,
    ) -> CollectiveCall | None:
        """Return what the ranks agree on before ``op``, or None when checks are off (then ``error`` raises here).

        Args:
            check: the tensor's name, for messages.
            op: the collective (``hpcddp.comm.names``).
            tensor: its tensor, or its tensors, if any.
            error: what is wrong with this rank's arguments: every rank raises it.
            label: what the collective is for (the optimizer's buckets: "bucket 2 of step 7"), named
                in messages when ``check`` is empty.
            step: the training step it belongs to, compared across ranks.
            fields: more for ``hpcddp.comm.agreement.describe_call`` (root, reduce_op, splits).
        """
        if not self.engine.agreement.runs or self.size == 1:
            if error is not None:
                raise ValueError(error)
            return None
        return describe_call(op, tensor, error=error, name=check or label, step=step, **fields)

    def start(
        self, collective: Collective, *, wake: bool = True, on_done: Callable[[Handle], None] | None = None
    ) -> EngineHandle:
        """Queue ``collective`` on the engine, after the agreement on its call; return its handle.

        Every API on this communicator runs its collectives through here or ``run``.

        Args:
            collective: from a ``plan_*`` method.
            wake: False when the caller waits at once (it then runs the queue itself).
            on_done: called with the completed handle, on the runner (a torch future's completion).
        """
        return self.engine.submit(collective, wake=wake, on_done=on_done)

    def run(self, collective: Collective) -> Any:
        """Run ``collective`` now and return its result (blocking; in this thread when the queue is idle)."""
        return self.engine.run(collective)

    def group_over(self, ranks: list[int]) -> MPICommunicator:
        """Return a communicator over ``ranks`` (this communicator's, renumbered in list order); members only.

        Collective over ``ranks`` only (``MPI_Comm_create_group``, as torch's
        ``new_group`` is called by members alone), so it is not an operation of this
        communicator's order: it runs on the side communicator, outside the queue.
        """
        with oplog.waiting(self.log, "new_group"):
            return self._child(self._side.Create_group(self._side.Get_group().Incl(list(ranks))))

    def _child(self, sub, hierarchical: bool = False, thread_name: str = "mpi") -> MPICommunicator:
        """Return a communicator over the mpi4py communicator ``sub`` (which it duplicates; ``sub`` is freed)."""
        try:
            child = MPICommunicator(sub, hierarchical=hierarchical, thread_name=thread_name)
        finally:
            sub.Free()
        child.check_collectives = self.check_collectives
        return child

    def duplicate(self, thread_name: str = "mpi") -> MPICommunicator:
        """Return a communicator over the same ranks, reducing as this one does; closed with this one. Collective."""
        call = self.call_for("", "duplicate")
        sub = self.run(Collective("duplicate", self._comm.Dup, None, call))
        child = self._child(sub, hierarchical=self._hierarchy is not None, thread_name=thread_name)
        self._duplicates.add(child)
        return child

    def gradient_channel(self) -> GradientChannel | None:
        """Return a communicator of its own for one optimizer's buckets, agreed once per step (``gradient_channel``)."""
        return GradientChannel(self) if self.size > 1 else None

    def close(self) -> None:
        if self.engine.closed:
            return
        for child in list(self._duplicates):
            child.close()
        self.engine.close()
        oplog.unregister(self.log)
        if self._hierarchy is not None:
            self._hierarchy.free()
        if self._node is not None:
            self._node.Free()
        self._side.Free()
        if not self.engine.failed:  # else its abandoned agreement still refers to it (engine rule 9)
            self._comm.Free()

    # -- allreduce ------------------------------------------------------------------------
    def reduce_in_place(self, buffer: torch.Tensor, op) -> None:
        """Allreduce a contiguous CPU tensor in place (flat or two-level, in pieces MPI can count); on the runner."""
        if self.size == 1:
            return
        hierarchy = self._hierarchy if buffer.nbytes >= HIERARCHY_MIN_BYTES else None
        for piece in for_each_piece(mpi_buffer(self._MPI, buffer)):
            if hierarchy is not None:
                hierarchy.allreduce(piece, op)
            else:
                self._comm.Allreduce(self._MPI.IN_PLACE, piece, op=op)

    def allreduce_body(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], torch.Tensor]:
        """Return the runner's work for an in-place allreduce of ``tensor``: reduce, divide, copy back."""
        check_reducible(tensor.dtype, op)
        (buffer, write, ready), reduce, size = (
            result_buffer_async(tensor),
            mpi_op(self._MPI, tensor.dtype, op),
            self.size,
        )

        def body() -> torch.Tensor:
            if ready is not None:  # a GPU tensor's copy to host, queued by the caller
                ready.synchronize()
            self.reduce_in_place(buffer, reduce)
            divide_average_(buffer, op, size)
            if write is not None:
                write(buffer)
            return tensor

        return body

    def plan_allreduce(
        self,
        tensors,
        op: ReduceOp,
        *,
        check: str | None = None,
        error: str | None = None,
        label: str = "",
        step: int | None = None,
    ):
        """Return the in-place allreduce of ``tensors`` (a tensor, or a list of one dtype: one operation).

        Args:
            tensors: what to reduce; the result is this argument.
            op: the reduction.
            check: the tensor's name, for messages.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
            label: what it is for, e.g. "bucket 2 of step 7" (stall reports).
            step: the training step it belongs to, compared across ranks.
        """
        if error is None and self.size > 1:
            planned = self.planned_allreduces.plan(tensors, op, check, label=label, step=step)
            if planned is not None:
                return planned
        if not isinstance(tensors, torch.Tensor) and len({t.dtype for t in tensors}) > 1:
            error = error or f"tensors of one dtype are reduced together, got {describe_tensors(tensors)}"
        make = functools.partial(self.allreduce_body, op=op)
        return self.plan_each(
            "allreduce", tensors, make, check=check, error=error, label=label, step=step, reduce_op=op
        )

    def allreduce_async_(
        self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        return self.start(self.plan_allreduce(tensor, op, check=check, label=label, step=step))

    def bucket_sums(self, tensors, before_send=None):
        return BucketSums(self, tensors, before_send) if self.size > 1 else super().bucket_sums(tensors, before_send)

    def allreduce_(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        return self.run(self.plan_allreduce(tensor, op, check=check))

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None) -> torch.Tensor:
        check_reducible(tensor.dtype, op)
        call = self.call_for(check, "allreduce", tensor, reduce_op=op)
        source = staged(tensor)
        out = empty_like(source)  # out of place as MPI does it: no copy first
        reduce = mpi_op(self._MPI, tensor.dtype, op)

        def body() -> torch.Tensor:
            if self.size == 1 or (self._hierarchy is not None and out.nbytes >= HIERARCHY_MIN_BYTES):
                out.copy_(source)
                self.reduce_in_place(out, reduce)
            else:
                sends = for_each_piece(mpi_buffer(self._MPI, source))
                for send, receive in zip(sends, for_each_piece(mpi_buffer(self._MPI, out))):
                    self._comm.Allreduce(send, receive, op=reduce)
            divide_average_(out, op, self.size)
            return out if tensor.device.type == "cpu" else out.to(tensor.device)

        return self.run(Collective("allreduce", body, tensor, call))

    # -- broadcast, allgather, objects, barrier ---------------------------------------------
    def broadcast_body(self, tensor: torch.Tensor, root: int) -> Callable[[], torch.Tensor]:
        """Return the runner's work for broadcasting root's ``tensor`` into every rank's ``tensor``."""
        self._check_root(root)
        buffer, write = result_buffer(tensor)
        if self.rank == root:
            write = None  # the root's tensor is the result already

        def body() -> torch.Tensor:
            for piece in for_each_piece(bytes_view(buffer)):
                self._comm.Bcast(piece, root=root)
            if write is not None:
                write(buffer)
            return tensor

        return body

    def plan_broadcast(
        self,
        tensors,
        root: int,
        *,
        check: str | None = None,
        error: str | None = None,
        label: str = "",
        step: int | None = None,
    ):
        """Return the broadcast of root's ``tensors`` (a tensor or a list: one operation) into every rank's."""
        self._check_root(root)
        make = functools.partial(self.broadcast_body, root=root)
        return self.plan_each("broadcast", tensors, make, check=check, error=error, label=label, step=step, root=root)

    def broadcast_async_(
        self, tensor: torch.Tensor, root: int, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        return self.start(self.plan_broadcast(tensor, root, check=check, label=label, step=step))

    def allgather_async(
        self, tensor: torch.Tensor, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        call = self.call_for(check, "allgather", source, label=label, step=step)
        comm, MPI = self._comm, self._MPI

        def body() -> torch.Tensor:
            rows = comm.allgather(source.shape[0])
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            counts = [r * row_bytes(source) for r in rows]
            comm.Allgatherv(bytes_view(source), [bytes_view(out), counts, displacements(counts), MPI.BYTE])
            return out.to(tensor.device)

        return self.start(Collective("allgather", body, tensor, call, label=label, step=step))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        self._check_root(root)
        call = self.call_for("", "broadcast_object", root=root)
        return self.run(Collective("broadcast_object", lambda: self._comm.bcast(obj, root=root), None, call))

    def allgather_object(self, obj: Any) -> list[Any]:
        call = self.call_for("", "allgather_object")
        return self.run(Collective("allgather_object", lambda: self._comm.allgather(obj), None, call))

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        self._check_root(root)
        call = self.call_for("", "gather_object", root=root)
        return self.run(Collective("gather_object", lambda: self._comm.gather(obj, root=root), None, call))

    def plan_barrier(self) -> Collective:
        """Return a barrier over the communicator, in its order (``barrier_now`` is outside it)."""
        return Collective("barrier", self._comm.Barrier, None, self.call_for("", "barrier"))

    def barrier(self) -> None:
        self.run(self.plan_barrier())

    def barrier_now(self) -> None:
        """Block until every rank reaches this call, without waiting for this rank's queued collectives.

        Horovod's barrier: a rank may pass it with an allreduce still pending, which
        the others submit after the barrier. It runs on a communicator of its own.
        """
        with oplog.waiting(self.log, "barrier_now"):
            wait_for_request(self._side.Ibarrier())

    # -- join (Horovod's) ---------------------------------------------------------------------
    def join(self) -> int:
        """Stand in for this rank in the others' collectives until every rank joins (Horovod's join).

        Sum and average allreduces of the others go on with zeros from this rank (an
        average still divides by ``size``); any other collective raises
        CollectiveMismatchError on the ranks that called it. Collective; returns the
        rank that joined last, the same on every rank.
        """
        comm, engine = self._comm, self.engine

        def body() -> int:
            rounds = 0
            joined = np.array(JOINED_VECTOR, dtype=np.int64)
            while not all_joined(engine.agreement.exchange(joined)):
                rounds += 1
                calls = comm.allgather(JOINED)
                if continues_while_joined(calls):
                    call = next(c for c in calls if c.op != JOINED.op)
                    zeros = torch.zeros(call.shape, dtype=dtype_named(call.dtype))
                    # The same algorithm as the ranks still reducing (flat or two-level).
                    self.reduce_in_place(zeros, mpi_op(self._MPI, zeros.dtype, ReduceOp(call.reduce_op)))
            waited = comm.allgather(rounds)
            return min(range(self.size), key=lambda r: (waited[r], -r))

        return self.run(Collective("join", body))

    # -- bytes shared within nodes ---------------------------------------------------------------
    def share_bytes(self, nbytes: int, root: int) -> NodeSharedBytes:
        """Return a buffer of ``nbytes`` bytes held once per node (shared memory) that ``root`` fills."""
        self._check_root(root)
        return NodeSharedBytes(self, nbytes, root)

    def node_comm(self):
        """Return the mpi4py communicator of this rank's node (shared memory); on the runner, collective at first."""
        if self._node is None:
            self._node = self._comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        return self._node

    def plan_shared_bytes(self, body: Callable[[], Any], root: int) -> Collective:
        """Return one step of ``NodeSharedBytes`` (``body``, its MPI calls) as a collective in this communicator's order."""
        return Collective("share_bytes", body, None, self.call_for("", "share_bytes", root=root))

    # -- point-to-point -------------------------------------------------------------------------
    def send_async(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        return self.p2p.send(tensor, dest, tag)

    def recv_async_(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Handle:
        return self.p2p.recv(tensor, source, tag)

    # -- reduce, gather, scatter, reducescatter, alltoall ----------------------------------------
    def _check_root(self, root: int) -> None:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in [0, {self.size}), got {root!r}")

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        return self.start(self.plan_reduce(tensor, op, root, check=check))

    def plan_reduce(self, tensors, op: ReduceOp, root: int, *, check: str | None = None, error: str | None = None):
        """Return the reduction of ``tensors`` (a tensor or a list: one operation) onto root's."""
        self._check_root(root)
        make = functools.partial(self.reduce_body, op=op, root=root)
        return self.plan_each("reduce", tensors, make, check=check, error=error, root=root, reduce_op=op)

    def plan_each(
        self, name: str, tensors, make_body, *, check, error, label: str = "", step: int | None = None, **fields
    ) -> Collective:
        """Return one collective over ``tensors`` (a tensor, or a list: one operation, one agreement).

        Args:
            name: the collective (``hpcddp.comm.names``).
            tensors: its tensor or tensors; the result is this argument.
            make_body: the runner's work for one tensor.
            check: the tensor's name, for messages.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
            label: what it is for (stall reports).
            step: the training step it belongs to, compared across ranks.
            fields: more for the agreement (root, reduce_op).
        """
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        error = error or next(filter(None, map(layout_error, listed)), None)
        call = self.call_for(check, name, listed, error=error, label=label, step=step, **fields)
        bodies = [] if error else [make_body(t) for t in listed]
        body = bodies[0] if len(bodies) == 1 and listed[0] is tensors else _run_each(bodies, tensors)
        return Collective(name, body, listed[0] if listed else None, call, label=label, step=step)

    def reduce_body(self, tensor: torch.Tensor, op: ReduceOp, root: int):
        """Return the runner's work for reducing ``tensor`` onto ``root`` (the others' tensors stay)."""
        self._check_root(root)
        check_reducible(tensor.dtype, op, "reduce")
        buf, write = result_buffer(tensor)
        spec, reduce, comm, MPI = mpi_buffer(self._MPI, buf), mpi_op(self._MPI, tensor.dtype, op), self._comm, self._MPI
        is_root = self.rank == root

        def body() -> torch.Tensor:
            if not is_root:
                comm.Reduce(spec, None, op=reduce, root=root)
                return tensor
            comm.Reduce(MPI.IN_PLACE, spec, op=reduce, root=root)
            divide_average_(buf, op, self.size)
            if write is not None:
                write(buf)
            return tensor

        return body

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        self._check_root(root)
        source = tensor.detach().cpu().contiguous()
        if source.dim() == 0:
            source = source.reshape(1)
        call = self.call_for(check, "gather", source, root=root)
        comm, MPI = self._comm, self._MPI

        def body() -> torch.Tensor | None:
            rows = comm.gather(source.shape[0], root=root)
            if self.rank != root:
                comm.Gatherv(bytes_view(source), None, root=root)
                return None
            out = torch.empty((sum(rows), *source.shape[1:]), dtype=source.dtype)
            counts = [r * row_bytes(source) for r in rows]
            comm.Gatherv(bytes_view(source), [bytes_view(out), counts, displacements(counts), MPI.BYTE], root=root)
            return out.to(tensor.device)

        return self.start(Collective("gather", body, tensor, call))

    def scatter_async_(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, check: str | None = None
    ) -> Handle:
        self._check_root(root)
        error = send = counts = None
        if self.rank == root:
            if chunks is None or len(chunks) != self.size:
                length = "None" if chunks is None else f"{len(chunks)} tensors"
                error = f"chunks must be a list of {self.size} tensors on the root, got {length}"
            elif any(c.dtype != out.dtype for c in chunks):
                error = f"chunks must have out's dtype {out.dtype}, got {sorted({str(c.dtype) for c in chunks})}"
            else:
                send = torch.cat([c.detach().cpu().reshape(-1) for c in chunks])
                counts = [c.numel() * c.element_size() for c in chunks]
        # The root's errors are reported by every rank (below), so nothing is raised here.
        call = self.call_for(check, "scatter", out, root=root)
        target = staged(out)
        nbytes = target.numel() * target.element_size()
        comm, MPI, engine = self._comm, self._MPI, self.engine

        def body() -> torch.Tensor:
            # The root's sizes first, so that a wrong-sized ``out`` is an error, not a half-filled tensor.
            sizes = comm.scatter(counts or [None] * self.size if self.rank == root else None, root=root)
            if sizes is None:
                mismatch = error or "the root's chunks are invalid"
            else:
                mismatch = None if sizes == nbytes else f"out holds {nbytes} bytes but root sends {sizes}"
            if call is not None:
                engine.agreement.agree(call._replace(error=mismatch))
            elif sizes is None:
                raise ValueError(f"scatter was not run: {mismatch}")
            receive = target if mismatch is None else torch.empty(sizes, dtype=torch.uint8)
            sendspec = None if send is None else [bytes_view(send), counts, displacements(counts), MPI.BYTE]
            comm.Scatterv(sendspec, bytes_view(receive), root=root)
            if mismatch is not None:
                raise ValueError(f"scatter: {mismatch}: pass an out tensor the size of chunks[{self.rank}]")
            if target is not out:
                with torch.no_grad():
                    out.copy_(target)
            return out

        # Agreed twice: on the call before any MPI call (rule 4: another API's collective on
        # a rank fails cleanly), and inside the body on the sizes the root sent.
        return self.start(Collective("scatter", body, out, call))

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
        check_reducible(tensor.dtype, op, "reducescatter")
        rows = tensor.shape[0]
        splits = even_splits(rows, self.size) if splits is None else as_splits(splits)
        error = splits_error(splits, rows, self.size)
        call = self.call_for(check, "reducescatter", tensor, error, label=label, step=step, reduce_op=op, splits=splits)
        buf = staged(tensor)
        row_numel = int(np.prod(tensor.shape[1:], dtype=np.int64))
        out = torch.empty((splits[self.rank], *tensor.shape[1:]), dtype=tensor.dtype) if error is None else None
        counts = [int(s) * row_numel for s in splits] if error is None else None
        comm, MPI, reduce = self._comm, self._MPI, mpi_op(self._MPI, tensor.dtype, op)

        def body() -> torch.Tensor:
            comm.Reduce_scatter(mpi_buffer(MPI, buf), mpi_buffer(MPI, out), counts, op=reduce)
            divide_average_(out, op, self.size)
            return out.to(tensor.device)

        return self.start(Collective("reducescatter", body, tensor, call, label=label, step=step))

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
        source = tensor.detach().cpu().contiguous()
        rows = source.shape[0]
        splits, error = alltoall_splits(splits, rows, self.size)
        call = self.call_for(check, "alltoall", source, error=error, label=label, step=step)
        comm, MPI = self._comm, self._MPI

        def body():
            sent_rows = np.array(splits, dtype=np.int64)
            received_rows = np.empty(self.size, dtype=np.int64)
            comm.Alltoall(sent_rows, received_rows)
            out = torch.empty((int(received_rows.sum()), *source.shape[1:]), dtype=source.dtype)
            size = row_bytes(source)
            send_counts = [int(r) * size for r in sent_rows]
            recv_counts = [int(r) * size for r in received_rows]
            comm.Alltoallv(
                [bytes_view(source), send_counts, displacements(send_counts), MPI.BYTE],
                [bytes_view(out), recv_counts, displacements(recv_counts), MPI.BYTE],
            )
            return out.to(tensor.device), torch.from_numpy(received_rows)

        return self.start(Collective("alltoall", body, tensor, call, label=label, step=step))

    # -- torch.distributed's _into forms: every rank sized its outputs -------------------------
    def plan_allgather_into(self, out, tensor: torch.Tensor, *, error: str | None = None) -> Collective:
        """Return the gathering of every rank's ``tensor`` into every rank's ``out``, in rank order.

        Args:
            out: ``size`` tensors like ``tensor``, or one tensor of ``size`` times its
                elements; gathered in place when ``tensor`` is this rank's slice of a
                contiguous ``out`` (FSDP2 and Megatron gather so).
            tensor: this rank's part; the same shape and dtype on every rank.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        outs = _listed(out)
        error = error or next(filter(None, map(layout_error, outs)), None)
        call = self.call_for(None, "allgather_into", tensor, error=error)
        if error is not None:
            return Collective("allgather_into", _not_run, tensor, call)
        comm, MPI, size = self._comm, self._MPI, self.size
        if isinstance(out, list):
            source = staged(tensor)

            def body() -> list[torch.Tensor]:
                flat = torch.empty((size, *source.shape), dtype=source.dtype)
                comm.Allgather(bytes_view(source), bytes_view(flat))
                _write_parts(out, flat)
                return out

            return Collective("allgather_into", body, tensor, call)
        buffer, write = result_buffer(out)
        nbytes = tensor.numel() * tensor.element_size()
        in_place = (
            out.is_contiguous() and tensor.is_contiguous() and tensor.data_ptr() == out.data_ptr() + self.rank * nbytes
        )
        source = None if in_place else staged(tensor)

        def gather_into_out() -> torch.Tensor:
            comm.Allgather(MPI.IN_PLACE if in_place else bytes_view(source), bytes_view(buffer))
            if write is not None:
                write(buffer)
            return out

        return Collective("allgather_into", gather_into_out, tensor, call)

    def plan_gather_into(
        self, outs: list[torch.Tensor] | None, tensor: torch.Tensor, root: int, *, error: str | None = None
    ) -> Collective:
        """Return the gathering of every rank's ``tensor`` into root's ``outs`` (``size`` tensors like it; root only)."""
        self._check_root(root)
        outs = list(outs or []) if self.rank == root else []
        error = error or next(filter(None, map(layout_error, outs)), None)
        call = self.call_for(None, "gather_into", tensor, error=error, root=root)
        source, comm, size, is_root = staged(tensor), self._comm, self.size, self.rank == root

        def body() -> list[torch.Tensor]:
            flat = torch.empty((size, *source.shape), dtype=source.dtype) if is_root else None
            comm.Gather(bytes_view(source), None if flat is None else bytes_view(flat), root=root)
            if flat is not None:
                _write_parts(outs, flat)
            return outs

        return Collective("gather_into", _not_run if error else body, tensor, call)

    def plan_scatter_into(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, error: str | None = None
    ) -> Collective:
        """Return the scattering of root's ``chunks`` (``size`` tensors like ``out``; root only) into every rank's ``out``."""
        self._check_root(root)
        error = error or layout_error(out)
        call = self.call_for(None, "scatter_into", out, error=error, root=root)
        (buffer, write), comm, is_root = result_buffer(out), self._comm, self.rank == root

        def body() -> torch.Tensor:
            flat = torch.stack([c.detach().cpu() for c in chunks]) if is_root else None
            comm.Scatter(None if flat is None else bytes_view(flat), bytes_view(buffer), root=root)
            if write is not None:
                write(buffer)
            return out

        return Collective("scatter_into", _not_run if error else body, out, call)

    def plan_reducescatter_into(self, out: torch.Tensor, source, op: ReduceOp, *, error: str | None = None):
        """Return the reduction of every rank's ``source``, each rank's block of it written into its ``out``.

        Args:
            out: this rank's block of the result.
            source: ``size`` tensors like ``out``, or one tensor of ``size`` times its elements.
            op: the reduction.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        check_reducible(out.dtype, op, "reducescatter_into")
        error = error or layout_error(out)
        call = self.call_for(None, "reducescatter_into", out, error=error, reduce_op=op)
        if error is not None:
            return Collective("reducescatter_into", _not_run, out, call)
        flat = torch.stack([c.detach().cpu() for c in source]) if isinstance(source, list) else staged(source)
        (buffer, write), comm, MPI, size = result_buffer(out), self._comm, self._MPI, self.size
        reduce = mpi_op(MPI, out.dtype, op)

        def body() -> torch.Tensor:
            comm.Reduce_scatter_block(mpi_buffer(MPI, flat.contiguous()), mpi_buffer(MPI, buffer), op=reduce)
            divide_average_(buffer, op, size)
            if write is not None:
                write(buffer)
            return out

        return Collective("reducescatter_into", body, out, call)

    def plan_alltoall_into(self, out, tensor, out_splits=None, in_splits=None, *, error: str | None = None):
        """Return the exchange that sends this rank's parts to every rank and receives theirs into ``out``.

        Every rank's byte counts are checked against its peers' before anything moves
        (CollectiveMismatchError on every rank).

        Args:
            out: the parts received, in rank order: a list of tensors, or one tensor
                whose first dimension ``out_splits`` divides (rows from each rank).
            tensor: the parts sent, likewise (``in_splits``); its dtype and the shape
                after the first dimension agree across ranks.
            out_splits: rows from each rank when ``out`` is one tensor.
            in_splits: rows to each rank when ``tensor`` is one tensor.
            error: what the caller found wrong with this rank's arguments: every rank raises it.
        """
        error = error or next(filter(None, map(layout_error, _listed(out))), None)
        model = tensor if isinstance(tensor, torch.Tensor) else (tensor[0] if tensor else None)
        if model is not None and model.dim() == 0:
            model = model.reshape(1, -1)
        call = self.call_for(None, "alltoall_into", model, error=error)
        if error is not None:
            return Collective("alltoall_into", _not_run, model, call)
        send, send_counts = _sent(tensor, in_splits)
        if isinstance(out, list):
            recv_counts = [t.numel() * t.element_size() for t in out]
            buffer, write = torch.empty(sum(recv_counts), dtype=torch.uint8), None
        else:
            recv_counts = [int(n) * _row_bytes(out) for n in out_splits]
            buffer, write = result_buffer(out)
        comm, MPI, ranks = self._comm, self._MPI, self.global_ranks

        def body():
            # What rank i sends to rank j must be what rank j expects from rank i.
            every = comm.allgather((send_counts, recv_counts))
            wrong = [
                f"rank {ranks[i]} sends {sends[j]} bytes to rank {ranks[j]}, which expects {every[j][1][i]}"
                for i, (sends, _) in enumerate(every)
                for j in range(len(every))
                if sends[j] != every[j][1][i]
            ]
            if wrong:
                raise CollectiveMismatchError(
                    f"alltoall_into: split sizes disagree ({'; '.join(wrong)}); nothing was transferred"
                )
            comm.Alltoallv(
                [bytes_view(send), send_counts, displacements(send_counts), MPI.BYTE],
                [bytes_view(buffer), recv_counts, displacements(recv_counts), MPI.BYTE],
            )
            if isinstance(out, list):
                _write_parts(out, (p.view(o.dtype) for o, p in zip(out, torch.split(buffer, recv_counts))))
            elif write is not None:
                write(buffer)
            return out

        return Collective("alltoall_into", body, model, call)

    # -- sub-communicators ------------------------------------------------------------------------
    def split(self, ranks: list[int]) -> MPICommunicator | None:
        members = list(ranks)
        error = split_ranks_error(members, self.size)
        call = self.call_for("", "split", error=error, splits=members if error is None else None)
        MPI, comm = self._MPI, self._comm

        def body():
            if self.rank in members:
                return comm.Split(0, members.index(self.rank))
            return comm.Split(MPI.UNDEFINED, 0)

        sub = self.run(Collective("split", body, None, call))
        return None if sub == MPI.COMM_NULL else self._child(sub)
