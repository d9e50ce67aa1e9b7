"""``ProcessGroupHPCDDP``: a torch.distributed process group over one hpcddp MPI communicator.

Its collectives are the communicator's (``hpcddp.comm.mpi``): this module checks torch's
arguments and names them in messages, the communicator plans the transfer and runs it on
its Engine like any other (``hpcddp.comm.mpi.engine``): the same queue and runner, the same
agreement first, the same transfer where the transfer is the same (an ``all_reduce``
here and ``hpcddp.allreduce_`` on another rank match and give the right sum). Its Works
complete their torch futures on the runner, so torch DDP's bucket callbacks run there
and a comm hook that issues further collectives (PowerSGD) has them run at once, in order.

A group made with a ``timeout=`` other than torch's default fails a collective that the
other ranks do not join in time with "Timed out", and every later operation on it
(rule 9 of ``hpcddp.comm.mpi.engine``); ``monitored_barrier`` is gloo's, over the
communicator's messages (``hpcddp.comm.mpi.monitored_barrier``).
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..comm.mpi.engine import Collective
from ..comm.mpi.p2p import describe_tensors as describe
from ..comm.reduction import from_torch
from ._compile import run_eagerly_under_compile
from ._futures import OrderedFuture, cuda_devices
from ._messages import MessageWork
from ._profiling import begin, end, end_when_done, wait_ended

__all__ = ["BACKEND_NAME", "ProcessGroupHPCDDP"]

#: the name to pass to ``init_process_group``
BACKEND_NAME = "hpcddp"


def like(argument: str, tensors: list[torch.Tensor], model: torch.Tensor, size: int) -> str | None:
    """What is wrong with ``tensors`` as ``size`` tensors like ``model``, naming torch's ``argument``; or None."""
    if len(tensors) != size:
        return f"{argument} must hold world_size={size} tensors, got {len(tensors)}"
    for t in tensors:
        if t.shape != model.shape or t.dtype != model.dtype:
            return f"{argument} must hold tensors like {describe([model])}, got {describe([t])}"
    return None


class _Work(dist.Work):
    """An operation of the engine; its torch future completes on the runner."""

    def __init__(self, handle, future: torch.futures.Future, profiled=None) -> None:
        super().__init__()
        self._handle = handle
        self._future = future
        self._profiled = profiled  # its profiler event (``_profiling.begin``), or None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        self._handle.wait(seconds or None)  # raises the operation's error, if any
        self._future.wait()  # the runner completes it right after the handle
        wait_ended(self._profiled)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The operation's output tensors, once it completed (torch's deprecated ``Work.result``)."""
        self.wait()
        return output_tensors(self._future.value())


class _CompletedWork(dist.Work):
    """A blocking operation that the calling thread ran to its end; its torch future is made when asked for.

    Args:
        engine: the engine it ran on (its future's callbacks queue there).
        value: the future's value.
        error: the operation's error: ``wait()`` raises it, as a queued operation's.
        profiled: its profiler event (``_profiling.begin``), already handed to be ended, or None.
    """

    def __init__(self, engine, value: Any = None, error: Exception | None = None, profiled=None) -> None:
        super().__init__()
        self._engine = engine
        self._value, self._error = value, error
        self._profiled = profiled
        self._future: OrderedFuture | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_ended(self._profiled)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = OrderedFuture(self._engine)
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._value)
            self._future = future
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The operation's output tensors (torch's deprecated ``Work.result``)."""
        self.wait()
        return output_tensors(self._value)


def output_tensors(value) -> list[torch.Tensor]:
    """A completed future's value as ``Work.result()`` gives it: a list of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in output_tensors(item)]  # all_gather's outputs: one list per input
    return []


class _Coalescing(threading.local):
    """Whether this thread is inside a coalesced call (``_coalesced``)."""

    #: a class default: read on every collective, where getattr(local, name, default) costs a failed lookup
    active = False


class ProcessGroupHPCDDP(dist.ProcessGroup):
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
        on_shutdown: called when torch destroys the group (a subgroup's owner releases
            its communicator there; the default group's forgets its timeout).
        timeout: the group's timeout (torch's ``timeout=``); the communicator enforces it,
            this group uses it as gloo does for ``monitored_barrier``. None: torch's default.
    """

    def __init__(
        self,
        comm,
        global_ranks: Sequence[int] | None = None,
        backend_name: str = "hpcddp",
        on_shutdown: Callable[[], None] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._global_ranks = list(global_ranks) if global_ranks is not None else list(range(comm.size))
        self._own_communicator = global_ranks is not None  # else the job's, shared with hpcddp's own collectives
        self._backend_name = backend_name
        self._on_shutdown = on_shutdown
        self._timeout = timeout if timeout is not None else default_pg_timeout
        self._name = ""
        self._within_coalesced = _Coalescing()  # its operations record no events of their own

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
        if self._own_communicator:  # errors may name the group
            self._comm.engine.agreement.label = f"process group {name!r} (global ranks {self._global_ranks})"

    @property
    def communicator(self):
        """The hpcddp communicator this group runs on."""
        return self._comm

    def shutdown(self) -> None:
        """Release the group's communicator and its thread (torch's destroy_process_group calls this)."""
        if self._on_shutdown is not None:
            self._on_shutdown()

    @property
    def timeout(self) -> datetime.timedelta:
        """The group's timeout (torch's ``timeout=``, or its default)."""
        return self._timeout

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """Block until every rank of the group arrives; raise RuntimeError naming those that did not (gloo's).

        Args:
            timeout: how long rank 0 waits for the others; None: the group's timeout.
            wait_all_ranks: rank 0 names every rank that did not arrive, not only the first.
        """
        self._comm.engine.check_open("monitored_barrier")
        limit = (timeout if timeout is not None else self._timeout).total_seconds()
        self._comm.monitored.wait(limit, self._timeout.total_seconds(), wait_all_ranks)

    def __repr__(self) -> str:
        return f"ProcessGroupHPCDDP(rank={self.rank()}, size={self.size()}, name={self._name!r})"

    # -- plumbing ---------------------------------------------------------------------
    def _start(
        self, collective: Collective, opts=None, result: Any = None, event: tuple[str, Sequence] = ("", ())
    ) -> _Work:
        """Run ``collective`` (planned by the communicator) on its engine; return its Work.

        Args:
            collective: from one of the communicator's ``plan_*`` methods.
            opts: torch's options; ``asyncOp`` False means the caller waits at once.
            result: the future's value, when it is not the collective's own result.
            event: the operation's profiler name (torch's: ``all_reduce``) and input tensors.
        """
        engine = self._comm.engine
        engine.check_open(event[0] or collective.name)
        within = self._within_coalesced.active
        profiled = begin(f"{self._backend_name}:{event[0]}", event[1]) if event[0] and not within else None
        devices = cuda_devices((event[1], result, collective.tensor))
        # A blocking call from Python waits at once: it runs the work itself, no thread wake-up.
        wake = True if opts is None else bool(getattr(opts, "asyncOp", True))
        # CUDA tensors keep the queued path (their future records stream events), and so do the parts
        # of a coalesced call, whose handles ``_coalesced`` chains (torch hands them its blocking opts).
        if not (wake or devices or within):
            return self._run(collective, result, profiled)
        future = OrderedFuture(engine, devices=devices)

        def complete(handle) -> None:
            if handle._error is not None:
                future.set_exception(handle._error)
            else:
                future.set_result(handle._result if result is None else result)

        handle = end_when_done(profiled, self._comm.start(collective, wake=wake, on_done=complete))
        future.handle = handle
        return _Work(handle, future, profiled)

    def _run(self, collective: Collective, result: Any, profiled) -> _CompletedWork:
        """Run the blocking ``collective`` in this thread when the queue is idle (``Engine.run``); return its Work.

        Args:
            collective: from one of the communicator's ``plan_*`` methods.
            result: the future's value, when it is not the collective's own result.
            profiled: its profiler event (``_profiling.begin``), or None.
        """
        try:
            value = self._comm.run(collective)
        except Exception as err:  # noqa: BLE001 - raised by the Work's wait(), as the queued path raises it
            return _CompletedWork(self._comm.engine, error=err, profiled=profiled)
        finally:
            end(profiled)
        return _CompletedWork(self._comm.engine, value if result is None else result, profiled=profiled)

    # -- collectives ------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        for tensor in tensors:
            if tensor.layout != torch.strided:
                raise ValueError(
                    f"all_reduce of a {tensor.layout} tensor is not supported by the {self._backend_name!r} backend: "
                    "reduce tensor.to_dense(), or use a gloo group for sparse gradients"
                )
        op = from_torch(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return self._start(self._comm.plan_allreduce(tensors, op), opts, event=("all_reduce", tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        options = dist.AllreduceOptions()
        options.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self.allreduce(tensors, options)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        root = opts.rootRank if opts is not None else 0
        return self._start(self._comm.plan_broadcast(tensors, root), opts, event=("broadcast", tensors))

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> _Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        collective = self._comm.plan_reduce(tensors, from_torch(opts.reduceOp), opts.rootRank)
        return self._start(collective, opts, event=("reduce", tensors))

    def barrier(self, opts=None) -> _Work:
        return self._start(self._comm.plan_barrier(), opts, event=("barrier", ()))

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> _Work:
        outputs, source = output_lists[0], inputs[0]
        error = like("output_tensor_list", outputs, source, self.size())
        collective = self._comm.plan_allgather_into(outputs, source, error=error)
        return self._start(collective, opts, output_lists, event=("all_gather", inputs))

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts=None) -> _Work:
        error = None
        if output.numel() != source.numel() * self.size() or output.dtype != source.dtype:
            error = (
                f"output_tensor must hold world_size x input ({self.size()} x {describe([source])}), "
                f"got {describe([output])}"
            )
        collective = self._comm.plan_allgather_into(output, source, error=error)
        return self._start(collective, opts, [output], event=("all_gather_into_tensor", [source]))

    def _allgather_base(self, output, source, opts=None) -> _Work:
        return self.all_gather_single(output, source, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> _Work:
        # torch's layout: output_lists[r][i] receives rank r's inputs[i]
        if len(output_lists) != self.size() or any(len(outputs) != len(inputs) for outputs in output_lists):
            shape = [len(outputs) for outputs in output_lists]
            raise ValueError(
                f"all_gather_coalesced: output_tensor_lists must hold world_size={self.size()} lists of "
                f"len(input_tensor_list)={len(inputs)} tensors, got lists of {shape}"
            )
        per_input = [[outputs[i] for outputs in output_lists] for i in range(len(inputs))]
        calls = [functools.partial(self.allgather, [o], [i]) for o, i in zip(per_input, inputs)]
        return self._coalesced("all_gather", inputs, calls, output_lists)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> _Work:
        calls = [functools.partial(self.all_gather_single, o, i) for o, i in zip(outputs, inputs)]
        return self._coalesced("all_gather", inputs, calls)  # gloo's name for it

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- the collectives where ranks exchange different parts -------------------------
    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        root, source = opts.rootRank if opts is not None else 0, inputs[0]
        outputs = output_lists[0] if self.rank() == root else []
        error = like("gather_list", outputs, source, self.size()) if self.rank() == root else None
        collective = self._comm.plan_gather_into(outputs, source, root, error=error)
        return self._start(collective, opts, output_lists, event=("gather", inputs))

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        root, target = opts.rootRank if opts is not None else 0, outputs[0]
        chunks = input_lists[0] if self.rank() == root else []
        error = like("scatter_list", chunks, target, self.size()) if self.rank() == root else None
        collective = self._comm.plan_scatter_into(target, chunks, root, error=error)
        return self._start(collective, opts, [target], event=("scatter", chunks))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        target, chunks = outputs[0], input_lists[0]
        error = like("input_list", chunks, target, self.size())
        return self._reduce_scatter(target, chunks, opts, error, ("reduce_scatter", chunks))

    def reduce_scatter_single(self, output: torch.Tensor, source: torch.Tensor, opts=None):
        error = None
        if source.numel() != output.numel() * self.size() or source.dtype != output.dtype:
            error = (
                f"input must hold world_size x output ({self.size()} x {describe([output])}), got {describe([source])}"
            )
        return self._reduce_scatter(output, source, opts, error, ("reduce_scatter_tensor", [source]))

    def _reduce_scatter_base(self, output, source, opts=None):
        return self.reduce_scatter_single(output, source, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        calls = [functools.partial(self.reduce_scatter_single, o, i, opts) for o, i in zip(outputs, inputs)]
        return self._coalesced("reduce_scatter_tensor_coalesced", inputs, calls)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, target, source, opts, error, event):
        op = from_torch(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        collective = self._comm.plan_reducescatter_into(target, source, op, error=error)
        return self._start(collective, opts, [target], event=event)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        error = None
        if len(outputs) != self.size() or len(inputs) != self.size():
            error = (
                f"input_tensor_list and output_tensor_list must hold world_size={self.size()} tensors each, "
                f"got {len(inputs)} and {len(outputs)}"
            )
        elif len({t.dtype for t in (*outputs, *inputs)}) > 1:
            error = f"input_tensor_list and output_tensor_list must hold one dtype, got {describe(inputs)} -> {describe(outputs)}"
        return self._start(
            self._comm.plan_alltoall_into(outputs, inputs, error=error), opts, event=("all_to_all", inputs)
        )

    def all_to_all_single(self, output, source, output_splits, input_splits, opts=None):
        size, error = self.size(), None
        rows_in, rows_out = (source.shape[0] if source.dim() else 1), (output.shape[0] if output.dim() else 1)
        input_splits = list(input_splits) or [rows_in // size] * size
        output_splits = list(output_splits) or [rows_out // size] * size
        if len(input_splits) != size or len(output_splits) != size:
            error = f"split sizes must list world_size={size} entries, got {input_splits} and {output_splits}"
        elif sum(input_splits) != rows_in or sum(output_splits) != rows_out:
            error = f"split sizes {input_splits} -> {output_splits} do not add up to the rows of {describe([source])} -> {describe([output])}"
        elif source.dtype != output.dtype or source.shape[1:] != output.shape[1:]:
            error = f"input and output must differ only in dim 0, got {describe([source])} -> {describe([output])}"
        collective = self._comm.plan_alltoall_into(output, source, output_splits, input_splits, error=error)
        return self._start(collective, opts, [output], event=("all_to_all", [source]))

    alltoall_base = all_to_all_single

    def _coalesced(self, name: str, inputs: Sequence[torch.Tensor], calls: list, result: Any = None) -> _Work:
        """Run ``calls`` (one operation each, in order) as one coalesced operation: one Work, one profiler event.

        Args:
            name: the profiler name of the whole call.
            inputs: its input tensors (the event's shapes).
            calls: functions starting each operation and returning its Work.
            result: the Work's future value instead of the last operation's own.
        """
        if not calls:
            raise ValueError(f"{name}: the input tensor list is empty: pass at least one tensor")
        event = begin(f"{self._backend_name}:{name}", inputs)
        self._within_coalesced.active = True
        try:
            works = [call() for call in calls]
        finally:
            self._within_coalesced.active = False
        for work in works[:-1]:
            work.wait()
        end_when_done(event, works[-1]._handle)
        works[-1]._profiled = event
        if result is not None:
            # value() first: a failed operation fails the returned future too
            works[-1]._future = works[-1]._future.then(lambda done: (done.value(), result)[1])
        return works[-1]

    # -- point-to-point messages ------------------------------------------------------
    # Not through the queue (rule 6 of ``hpcddp.comm.mpi.engine``): a rank that posts isend then irecv
    # while its peer does the same must not block in the first. The protocol is hpcddp's own
    # ``send_async``/``recv_async_``, so the two APIs' messages match.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> MessageWork:
        return self._message("send", f"to rank {dst}", tensors, lambda: self._comm.p2p.send(tensors[0], dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> MessageWork:
        return self._message("recv", f"from rank {src}", tensors, lambda: self._comm.p2p.recv(tensors[0], src, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> MessageWork:
        post = lambda: self._comm.p2p.recv(tensors[0], None, tag)  # noqa: E731
        return self._message("recvAnySource", "from any rank", tensors, post)

    def _message(self, op: str, peer: str, tensors: list[torch.Tensor], post) -> MessageWork:
        """Post a message (``post()``) on an open communicator, with its profiler event ``op`` (torch's name)."""
        engine = self._comm.engine
        engine.check_open("send" if op == "send" else "recv")
        event = begin(f"{self._backend_name}:{op}", tensors)
        describe = f"{op} {peer} on {engine.agreement.label}"
        return MessageWork(end_when_done(event, post()), engine.agreement.timeout, describe, event)


# torch.compile(DDP(model)): DDP's buffer broadcast calls these back from C++ (see _compile).
run_eagerly_under_compile(_Work, _CompletedWork, ProcessGroupHPCDDP)
