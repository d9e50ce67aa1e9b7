"""``ProcessGroupHPCDDP``: a torch.distributed process group whose collectives run on hpcddp's MPI thread."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm.agreement import signature
from ._buffers import bytes_view, describe, reduce_spec, reduction_buffer, stage, unstage
from ._exchange import ExchangeCollectives
from ._p2p import PointToPoint

__all__ = ["ProcessGroupHPCDDP"]


class _Work(dist.Work):
    """A collective queued on the communication thread.

    Its future completes on that thread (torch DDP chains its bucket callbacks
    there and overlaps the next buckets' backward); ``wait()`` from the caller
    runs the collective itself when the thread has not started it.
    """

    def __init__(self, handle, future: torch.futures.Future) -> None:
        super().__init__()
        self._handle = handle
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        try:
            self._handle.wait(seconds or None)
        except TimeoutError:
            raise
        except Exception:  # noqa: BLE001 - the future holds the same error, raised below
            pass
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class ProcessGroupHPCDDP(ExchangeCollectives, PointToPoint, dist.ProcessGroup):
    """torch.distributed's collectives over one hpcddp MPI communicator.

    Each collective first agrees with the other ranks on shapes, dtypes, root
    and op (``hpcddp.comm.agreement``: one small MIN-allreduce; a mismatch raises
    ``CollectiveMismatchError`` on every rank, with nothing transferred; off with
    HPCDDP_CHECK_COLLECTIVES=0), then runs on the communicator's thread in call order.

    Args:
        comm: an ``hpcddp.comm.mpi.MPICommunicator`` over the group's ranks.
        global_ranks: the group's members as ranks of the default group (for messages).
        backend_name: what ``dist.get_backend`` reports ("hpcddp", or "mpi" when
            torch's MPI name was routed here).
    """

    def __init__(
        self,
        comm,
        global_ranks: Sequence[int] | None = None,
        backend_name: str = "hpcddp",
    ) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._mpi = comm.mpi_comm
        from .._mpi import import_mpi

        self._MPI = import_mpi()
        self._global_ranks = list(global_ranks) if global_ranks is not None else list(range(comm.size))
        self._backend_name = backend_name
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

    def __repr__(self) -> str:
        return f"ProcessGroupHPCDDP(rank={self.rank()}, size={self.size()}, name={self._name!r})"

    # -- plumbing ---------------------------------------------------------------------
    def _start(
        self,
        collective: str,
        body: Callable[[], Any],
        tensors: Sequence[torch.Tensor] = (),
        opts=None,
        **fields: Any,
    ) -> _Work:
        """Queue ``body()`` after the metadata agreement on ``tensors`` and ``fields``; return its Work.

        Args:
            collective: torch's name for it, for messages and the stall inspector.
            body: makes the MPI calls (on the communication thread); returns the future's value.
            tensors: what every rank must pass alike (shapes and dtypes).
            opts: torch's options; ``asyncOp`` False means the caller waits at once.
            fields: more for ``hpcddp.comm.agreement.signature`` (root, reduce_op, error, ...).
        """
        future = torch.futures.Future()
        sig = signature(collective, tensors[0] if tensors else None, **fields)
        if len(tensors) > 1:
            sig = sig._replace(shape=tuple(tuple(t.shape) for t in tensors))
        comm = self._comm

        def work():
            try:
                comm.agree(sig, sleep_while_waiting=True)
                result = body()
            except BaseException as err:
                future.set_exception(err)
                raise
            future.set_result(result)
            return result

        # A blocking call from Python waits at once: it runs the work itself, no thread wake-up.
        wake = True if opts is None else bool(opts.asyncOp)
        handle = comm.run_async(work, collective, tensors[0] if tensors else None, wake=wake)
        return _Work(handle, future)

    def _reduce_spec(self, dtype: torch.dtype, op):
        return reduce_spec(self._MPI, dtype, op)

    # -- collectives ------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        spec = self._reduce_spec(tensors[0].dtype, opts.reduceOp)
        mixed = len({t.dtype for t in tensors}) > 1
        error = f"tensors of one dtype are reduced together, got {describe(tensors)}" if mixed else None
        staged = [stage(t) for t in tensors]
        comm, MPI, size = self._mpi, self._MPI, self.size()

        def body():
            for tensor, buffer in zip(tensors, staged):
                if size > 1:
                    comm.Allreduce(MPI.IN_PLACE, reduction_buffer(MPI, buffer), op=spec.mpi_op)
                unstage(tensor, spec.finish_(buffer, size))
            return tensors

        return self._start("all_reduce", body, tensors, opts, reduce_op=spec.name, error=error)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        options = dist.AllreduceOptions()
        options.reduceOp = reduce_op
        return self.allreduce(tensors, options)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        root = opts.rootRank if opts is not None else 0
        staged = [stage(t) for t in tensors]
        comm = self._mpi

        def body():
            for tensor, buffer in zip(tensors, staged):
                comm.Bcast(bytes_view(buffer), root=root)
                unstage(tensor, buffer)
            return tensors

        return self._start("broadcast", body, tensors, opts, root=root)

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        root, spec = opts.rootRank, self._reduce_spec(tensors[0].dtype, opts.reduceOp)
        staged = [stage(t) for t in tensors]
        comm, MPI, size, rank = self._mpi, self._MPI, self.size(), self.rank()

        def body():
            for tensor, buffer in zip(tensors, staged):
                if rank == root:
                    comm.Reduce(MPI.IN_PLACE, reduction_buffer(MPI, buffer), op=spec.mpi_op, root=root)
                    unstage(tensor, spec.finish_(buffer, size))
                else:
                    comm.Reduce(reduction_buffer(MPI, buffer), None, op=spec.mpi_op, root=root)
            return tensors

        return self._start("reduce", body, tensors, opts, root=root, reduce_op=spec.name)

    def barrier(self, opts=None) -> _Work:
        comm = self._mpi
        return self._start("barrier", lambda: comm.Barrier(), (), opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> _Work:
        outputs, source = output_lists[0], inputs[0]
        error = _same_shapes("output_tensor_list", outputs, source, self.size())
        staged, comm = stage(source), self._mpi

        def body():
            flat = torch.empty((self.size(), *staged.shape), dtype=staged.dtype)
            comm.Allgather(bytes_view(staged), bytes_view(flat))
            for out, part in zip(outputs, flat):
                unstage(out, part)
            return output_lists

        return self._start("all_gather", body, [source], opts, error=error)

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts=None) -> _Work:
        error = None
        if output.numel() != source.numel() * self.size() or output.dtype != source.dtype:
            error = f"output_tensor must hold world_size x input ({self.size()} x {describe([source])}), got {describe([output])}"
        staged_in, staged_out, comm = stage(source), stage(output), self._mpi

        def body():
            comm.Allgather(bytes_view(staged_in), bytes_view(staged_out))
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
        """The last of ``works`` (the thread runs them in order), after checking the earlier ones."""
        for work in works[:-1]:
            work.wait()
        return works[-1]


def _same_shapes(argument: str, outputs: list[torch.Tensor], source: torch.Tensor, size: int) -> str | None:
    if len(outputs) != size:
        return f"{argument} must hold world_size={size} tensors, got {len(outputs)}"
    for out in outputs:
        if out.shape != source.shape or out.dtype != source.dtype:
            return f"{argument} must hold tensors like the input ({describe([source])}), got {describe([out])}"
    return None
