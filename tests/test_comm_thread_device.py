"""Communication threads work on the rank's GPU, not on cuda:0 (issue 50): a fake CUDA records set_device.

CUDA's current device is per thread and a new thread starts on device 0. hpcddp's
communication thread (``hpcddp.comm.mpi.engine``) and the torch backend's message-future
thread run future callbacks (a DDP comm hook's kernels), so each must first take the
rank's device (``init()`` records it), whatever device the thread that made it had
selected. No GPU is needed: ``torch.cuda`` is patched with a per-thread current device.
"""

import logging
import threading
import time
import types

import numpy as np
import pytest
import torch

import hpcddp
from hpcddp.comm import _cuda_events, oplog
from hpcddp.comm.mpi.engine import Collective, Engine

from .test_gpu_startup import fake_gpus, fresh, torchrun_rank  # noqa: F401 - fresh is a fixture

pytestmark = pytest.mark.unit


class _CommOfOne:
    """The little of an mpi4py communicator that an Engine touches before its first collective."""

    def Get_size(self):  # noqa: N802 - mpi4py's name
        return 1


class _FakeCuda:
    """CUDA's device selection as the driver keeps it: one current device per thread, 0 in a new thread."""

    def __init__(self) -> None:
        self._selected = threading.local()
        #: (thread name, index) of every set_device call
        self.calls: list[tuple[str, int]] = []
        #: set_device raises this when set
        self.error: Exception | None = None

    def current_device(self) -> int:
        return getattr(self._selected, "index", 0)

    def set_device(self, index) -> None:
        self.calls.append((threading.current_thread().name, index))
        if self.error is not None:
            raise self.error
        self._selected.index = index

    def exchange_device(self, index: int) -> int:  # what `with torch.cuda.device(k)` calls
        previous = self.current_device()
        if index >= 0:
            self._selected.index = index
        return previous


@pytest.fixture
def cuda(monkeypatch):
    """A fake CUDA, started, with this thread on device 3 as ``init()`` leaves a rank on its GPU."""
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "_exchange_device", fake.exchange_device)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", fake.exchange_device)
    monkeypatch.setattr(_cuda_events, "_rank_device", None)
    fake.set_device(3)
    _cuda_events.set_rank_cuda_device(3)
    fake.calls.clear()
    return fake


def _wait_for(calls, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    return calls


def _engine(name="device-test") -> Engine:
    """An engine whose communication thread started: a wait with a time limit leaves its first operation to it."""
    engine = Engine(_CommOfOne(), types.SimpleNamespace(MIN=np.minimum), oplog.OperationLog("test", (0,)), name=name)
    engine.submit(Collective("probe", lambda: None)).wait(timeout=5)
    return engine


def test_the_fake_keeps_one_current_device_per_thread(cuda):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_device()))
    thread.start()
    thread.join()
    assert seen == [0] and torch.cuda.current_device() == 3


def test_the_communication_thread_takes_the_ranks_device(cuda):
    engine = _engine()
    try:
        assert _wait_for(cuda.calls) == [("hpcddp-device-test", 3)]
    finally:
        engine.close()


def test_a_communicator_made_under_another_selected_device_still_works_on_the_ranks(cuda):
    with torch.cuda.device(1):  # the script's own choice for a while, not the rank's GPU
        assert torch.cuda.current_device() == 1
        engine = _engine()
    try:
        assert _wait_for(cuda.calls) == [("hpcddp-device-test", 3)]
    finally:
        engine.close()
    assert torch.cuda.current_device() == 3


def test_before_init_a_thread_takes_the_device_of_the_thread_that_made_it(cuda):
    _cuda_events.set_rank_cuda_device(None)
    with torch.cuda.device(2):
        engine = _engine()
    try:
        assert _wait_for(cuda.calls) == [("hpcddp-device-test", 2)]
    finally:
        engine.close()


def test_a_failed_set_device_is_reported_and_the_thread_goes_on(cuda, caplog):
    cuda.error = RuntimeError("CUDA error: invalid device ordinal")
    with caplog.at_level(logging.ERROR, logger="hpcddp"):
        engine = _engine()
        try:
            assert _wait_for(cuda.calls) == [("hpcddp-device-test", 3)]
            # The thread still serves its queue: a wait with a time limit leaves the operation to it.
            handle = engine.submit(Collective("probe", lambda: threading.current_thread().name))
            assert handle.wait(timeout=5) == "hpcddp-device-test"
        finally:
            engine.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("hpcddp-device-test could not select cuda:3" in e and "invalid device ordinal" in e for e in errors)


def test_init_records_the_ranks_device(fresh, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setattr(_cuda_events, "_rank_device", None)
    torchrun_rank(fresh, 1, 2)  # local rank 1 of a node with two GPUs: cuda:1
    chosen = fake_gpus(fresh, [("GPU-a", 1), ("GPU-b", 2)])
    hpcddp.init()
    assert chosen == [torch.device("cuda", 1)] and _cuda_events._rank_device == 1


def test_shutdown_forgets_the_ranks_device(fresh, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setattr(_cuda_events, "_rank_device", None)
    torchrun_rank(fresh, 1, 2)
    fake_gpus(fresh, [("GPU-a", 1), ("GPU-b", 2)])
    hpcddp.init()
    assert _cuda_events._rank_device == 1
    hpcddp.shutdown()
    # A thread made now (a later init's, the script's own) takes its maker's device, not cuda:1.
    assert _cuda_events._rank_device is None


def test_a_failed_start_forgets_the_ranks_device(fresh, monkeypatch):  # noqa: F811 - the fixture imported above
    from hpcddp.runtime import bootstrap

    monkeypatch.setattr(_cuda_events, "_rank_device", None)
    torchrun_rank(fresh, 1, 2)
    fake_gpus(fresh, [("GPU-a", 1), ("GPU-b", 2)])

    def no_rendezvous(*args, **kwargs):
        raise RuntimeError("no rendezvous here")

    monkeypatch.setattr(bootstrap, "export_rendezvous", no_rendezvous)
    with pytest.raises(RuntimeError, match="no rendezvous here"):
        hpcddp.init()
    assert _cuda_events._rank_device is None


def test_a_thread_made_without_cuda_sets_no_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(index))
    engine = _engine()
    engine.close()
    assert calls == []


def test_the_message_future_thread_takes_the_ranks_device(cuda):
    from hpcddp.torch_backend._messages import MessageWork

    class _Arrived:
        """A message that completed already: its future's thread settles it at once."""

        def _block(self, timeout):
            return True

        def poll(self):
            return True

        def wait(self):
            return [torch.zeros(1)]

    with torch.cuda.device(1):
        work = MessageWork(_Arrived(), None, "recv from rank 1")
        work.get_future().wait()
    assert _wait_for(cuda.calls) == [("hpcddp-message-future", 3)]
