"""``ProcessGroupHPCDDP``: a torch.distributed process group over one hpcddp MPI communicator.

Its collectives are operations of the communicator's Engine like any other
(``hpcddp.comm.engine``): the same queue and runner, the same agreement first, the same
transfer code where the transfer is the same (an ``all_reduce`` here and
``hpcddp.allreduce_`` on another rank match and give the right sum). Its Works complete
their torch futures on the runner, so torch DDP's bucket callbacks run there and a comm
hook that issues further collectives (PowerSGD) has them run at once, in order.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._buffers import describe, reduce_op_of, stage, unstage
from ._exchange import ExchangeCollectives
from ._futures import OrderedFuture
from ._p2p import PointToPoint

__all__ = ["ProcessGroupHPCDDP"]


class _Work(dist.Work):
    """An operation of the engine; its torch future completes on the runner."""

    def __init__(self, handle, future: torch.futures.Future) -> None:
        super().__init__()
        self._handle = handle
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        self._handle.wait(seconds or None)  # raises the operation's error, if any
        self._future.wait()  # the runner completes it right after the handle
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class ProcessGroupHPCDDP(ExchangeCollectives, PointToPoint, dist.ProcessGroup):
    """torch.distributed's collectives over one hpcddp MPI communicator.

    Each collective first agrees with the other ranks on shapes, dtypes, root and op
    (a mismatch raises ``CollectiveMismatchError`` on every rank, nothing
    transferred; off with HPCDDP_CHECK_COLLECTIVES=0, when a rank's errors about its
    own arguments still raise on that rank), then runs in call order.

    Args:
        comm: an ``hpcddp.comm.mpi.MPICommunicator`` over the group's ranks.
        global_ranks: the group's members as ranks of the default group (for messages).
        backend_name: what ``dist.get_backend`` reports ("hpcddp", or "mpi" when
            torch's MPI name was routed here).
        owns_comm: close ``comm`` when torch destroys the group (subgroups).
    """

    def __init__(
        self,
        comm,
        global_ranks: Sequence[int] | None = None,
        backend_name: str = "hpcddp",
        owns_comm: bool = False,
    ) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._mpi = comm.mpi_comm
        self._MPI = comm._MPI
        self._global_ranks = list(global_ranks) if global_ranks is not None else list(range(comm.size))
        self._backend_name = backend_name
        self._owns_comm = owns_comm
        self._name = ""

    # -- identity ---------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._backend_name

    def _get_backend_name(self) -> str:
        return self._backend_name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def communicator(self):
        """The hpcddp communicator this group runs on."""
        return self._comm

    def shutdown(self) -> None:
        """Release the group's communicator and its thread (torch's destroy_process_group calls this)."""
        if self._owns_comm:
            from .install import release

            release(self._comm)

    def __repr__(self) -> str:
        return f"ProcessGroupHPCDDP(rank={self.rank()}, size={self.size()}, name={self._name!r})"

    # -- plumbing ---------------------------------------------------------------------
    def _start(
        self,
        collective: str,
        body: Callable[[], Any],
        tensors: Sequence[torch.Tensor] = (),
        opts=None,
        error: str | None = None,
        **fields: Any,
    ) -> _Work:
        """Hand ``body()`` to the engine after the agreement on ``tensors`` and ``fields``; return its Work.

        Args:
            collective: its name; the same name as hpcddp's own collective only where
                the transfer is the same, so that mixing the APIs matches or fails cleanly.
            body: makes the MPI calls (on the runner) and returns the future's value.
            tensors: what every rank must pass alike (shapes and dtypes).
            opts: torch's options; ``asyncOp`` False means the caller waits at once.
            error: what is wrong with this rank's arguments, raised on every rank.
            fields: more for ``hpcddp.comm.agreement.signature`` (root, reduce_op, ...).
        """
        future = OrderedFuture()
        comm = self._comm
        first = tensors[0] if tensors else None
        sig = comm.signature_for(None, collective, first, error=error, **fields)
        if sig is not None and len(tensors) > 1:
            sig = sig._replace(shape=tuple(tuple(t.shape) for t in tensors))

        def complete(handle) -> None:
            if handle._error is not None:
                future.set_exception(handle._error)
            else:
                future.set_result(handle._result)

        # A blocking call from Python waits at once: it runs the work itself, no thread wake-up.
        wake = True if opts is None else bool(getattr(opts, "asyncOp", True))
        handle = comm.submit(collective, body, first, sig, wake=wake, on_done=complete)
        future.handle = handle
        return _Work(handle, future)

    # -- collectives ------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        op = reduce_op_of(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        mixed = len({t.dtype for t in tensors}) > 1
        error = f"tensors of one dtype are reduced together, got {describe(tensors)}" if mixed else None
        error = error or next(filter(None, map(self._comm.layout_error, tensors)), None)
        bodies = [] if error else [self._comm.allreduce_body(t, op) for t in tensors]

        def body():
            for reduce in bodies:
                reduce()
            return tensors

        return self._start("allreduce", body, tensors, opts, error=error, reduce_op=op)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        options = dist.AllreduceOptions()
        options.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self.allreduce(tensors, options)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        root = opts.rootRank if opts is not None else 0
        error = next(filter(None, map(self._comm.layout_error, tensors)), None)
        bodies = [] if error else [self._comm.broadcast_body(t, root) for t in tensors]

        def body():
            for broadcast in bodies:
                broadcast()
            return tensors

        return self._start("broadcast", body, tensors, opts, error=error, root=root)

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        root, op = opts.rootRank, reduce_op_of(opts.reduceOp)
        error = next(filter(None, map(self._comm.layout_error, tensors)), None)
        bodies = [] if error else [self._comm.reduce_body(t, op, root) for t in tensors]

        def body():
            for reduce in bodies:
                reduce()
            return tensors

        return self._start("reduce", body, tensors, opts, error=error, root=root, reduce_op=op)

    def barrier(self, opts=None) -> _Work:
        comm = self._mpi
        return self._start("barrier", lambda: comm.Barrier(), (), opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> _Work:
        outputs, source = output_lists[0], inputs[0]
        error = _same_shapes("output_tensor_list", outputs, source, self.size())
        staged, comm = stage(source), self._mpi

        def body():
            flat = torch.empty((self.size(), *staged.shape), dtype=staged.dtype)
            comm.Allgather(_bytes(staged), _bytes(flat))
            for out, part in zip(outputs, flat):
                unstage(out, part)
            return output_lists

        return self._start("all_gather", body, [source], opts, error=error)

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts=None) -> _Work:
        size, rank = self.size(), self.rank()
        error = None
        if output.numel() != source.numel() * size or output.dtype != source.dtype:
            error = (
                f"output_tensor must hold world_size x input ({size} x {describe([source])}), got {describe([output])}"
            )
        error = error or self._comm.layout_error(output)
        staged_out, comm, MPI = stage(output), self._mpi, self._MPI
        # FSDP2 and Megatron gather in place: the input is this rank's slice of the output.
        in_place = (
            error is None
            and staged_out is not None
            and output.is_contiguous()
            and source.is_contiguous()
            and source.data_ptr() == output.data_ptr() + rank * source.numel() * source.element_size()
        )
        staged_in = None if in_place else stage(source)

        def body():
            if in_place:
                comm.Allgather(MPI.IN_PLACE, _bytes(staged_out))
            else:
                comm.Allgather(_bytes(staged_in), _bytes(staged_out))
            return [unstage(output, staged_out)]

        return self._start("all_gather_into_tensor", body, [source], opts, error=error)

    def _allgather_base(self, output, source, opts=None) -> _Work:
        return self.all_gather_single(output, source, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> _Work:
        return self._sequence([self.allgather([o], [i]) for o, i in zip(output_lists, inputs)])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> _Work:
        return self._sequence([self.all_gather_single(o, i) for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _sequence(self, works: list[_Work]) -> _Work:
        """The last of ``works`` (the engine runs them in order), after checking the earlier ones."""
        for work in works[:-1]:
            work.wait()
        return works[-1]


def _bytes(tensor: torch.Tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _same_shapes(argument: str, outputs: list[torch.Tensor], source: torch.Tensor, size: int) -> str | None:
    if len(outputs) != size:
        return f"{argument} must hold world_size={size} tensors, got {len(outputs)}"
    for out in outputs:
        if out.shape != source.shape or out.dtype != source.dtype:
            return f"{argument} must hold tensors like the input ({describe([source])}), got {describe([out])}"
    return None
