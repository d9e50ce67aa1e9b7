"""The CUDA-only branches' rules, checked on the CPU with fakes (the GPU suite, tests/gpu, runs them on CUDA)."""

import pytest
import torch
import torch.distributed as dist

from hpcddp.comm.base import ReduceOp
from hpcddp.comm.torchdist import TorchDistCommunicator

pytestmark = pytest.mark.unit


class _QueuedWork:
    """An NCCL Work as seen from the host: its future is complete once the kernel is queued."""

    def __init__(self):
        self.future = torch.futures.Future()
        self.future.set_result(None)

    def get_future(self):
        return self.future

    def is_completed(self):
        return True

    def wait(self, timeout=None):
        return True


@pytest.fixture
def nccl_like(monkeypatch, tmp_path):
    """A TorchDistCommunicator named nccl, of 2 ranks whose all_reduce is NCCL's arithmetic on equal tensors."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sent_ops = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sent_ops.append(op)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)  # two ranks holding the same values
        elif op != dist.ReduceOp.AVG:
            raise AssertionError(f"unexpected op {op}")
        return _QueuedWork()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    comm = TorchDistCommunicator("nccl", torch.device("cpu"))
    comm.size = 2
    try:
        yield comm, sent_ops
    finally:
        comm.close()
        dist.destroy_process_group()


def test_an_nccl_average_is_complete_when_its_handle_is(nccl_like):
    comm, sent_ops = nccl_like
    tensor = torch.full((4,), 3.0)
    handle = comm.allreduce_async_(tensor, ReduceOp.AVERAGE)
    assert handle.poll()
    # Read without wait(), as a script that polls an in-place average does.
    torch.testing.assert_close(tensor, torch.full((4,), 3.0))
    torch.testing.assert_close(handle.wait(), torch.full((4,), 3.0))
    assert sent_ops == [dist.ReduceOp.AVG]


def test_an_nccl_reducescatter_average_is_not_divided_twice(nccl_like):
    comm, _ = nccl_like
    out = comm.reducescatter_async(torch.arange(4.0), ReduceOp.AVERAGE).wait()
    torch.testing.assert_close(out, torch.arange(2.0))


class _FakeGpuCompletion:
    """Stands in for the CUDA events of ``hpcddp.comm._cuda_events.GpuCompletion``: the test says when kernels ran."""

    ran_at: float | None = None

    def __init__(self, work, tensors):
        self.work = work

    def query(self):
        return self.ran_at is not None

    @property
    def completed_at(self):
        return self.ran_at

    def completion_time(self):
        return self.ran_at


def test_the_stall_inspector_sees_an_nccl_collective_running_until_its_kernel_ran(nccl_like, monkeypatch):
    import hpcddp.comm.torchdist as torchdist

    comm, _ = nccl_like
    monkeypatch.setattr(torchdist, "is_cuda_tensor", lambda tensor: True)
    monkeypatch.setattr(torchdist, "GpuCompletion", _FakeGpuCompletion)
    handle = comm.allreduce_async_(torch.ones(4), ReduceOp.SUM)
    # The Work's future is complete (queued), the kernel has not run: the collective is still running.
    running, _ = comm.log.running()
    assert running is not None and running.op == "allreduce"
    assert handle.completed_at is None
    _FakeGpuCompletion.ran_at = 123.0
    try:
        assert comm.log.running()[0] is None
        assert handle.completed_at == 123.0
    finally:
        _FakeGpuCompletion.ran_at = None


def test_reduction_times_read_a_bucket_end_known_only_after_wait_when_asked():
    from hpcddp.comm.base import Handle
    from hpcddp.ddp.buckets import build_buckets
    from hpcddp.ddp.timing import ReductionTimes

    class KernelsStillRunning(Handle):
        def completion_time(self):  # what the CUDA event says once the host waits for it
            return 42.0

    (bucket,) = build_buckets([torch.nn.Parameter(torch.zeros(3))], 1 << 20, 1 << 20)
    times = ReductionTimes()
    times.begin(1)
    handle = KernelsStillRunning("allreduce")
    times.done([bucket], [handle], copy_out_start=7.0, recorder=None, step=0)
    assert times.bucket_done == [42.0]


def test_async_averaging_refuses_nccl_in_one_line_naming_the_fix():
    from hpcddp.collectives.async_averaging import AsyncModelAverager

    class NcclOfTwo:
        name, rank, size = "nccl", 0, 2

    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"cannot run on the nccl backend .*backend='mpi'") as caught:
        AsyncModelAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), communicator=NcclOfTwo())
    assert "\n" not in str(caught.value)


def test_the_allreduce_benchmark_waits_for_the_gpu_after_each_hpcddp_allreduce(monkeypatch):
    from hpcddp.bench.allreduce import _synchronized

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    on_gpu = _synchronized(lambda: calls.append("allreduce"), torch.device("cuda", 0))
    on_gpu()
    assert calls == ["allreduce", ("synchronize", torch.device("cuda", 0))]
    on_cpu = _synchronized(lambda: calls.append("cpu allreduce"), torch.device("cpu"))
    on_cpu()
    assert calls[-1] == "cpu allreduce"
