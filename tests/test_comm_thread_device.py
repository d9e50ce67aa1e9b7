"""Communication threads work on the rank's GPU, not on cuda:0 (issue 50): a fake CUDA records set_device.

CUDA's current device is per thread and a new thread starts on device 0. hpcddp's
communication thread (``hpcddp.comm.mpi.engine``) and the torch backend's message-future
thread run future callbacks (a DDP comm hook's kernels), so each must first take the
device of the thread that made it. No GPU is needed: ``torch.cuda`` is patched.
"""

import threading
import time
import types

import numpy as np
import pytest
import torch

from hpcddp.comm import oplog
from hpcddp.comm.mpi.engine import Engine


class _CommOfOne:
    """The little of an mpi4py communicator that an Engine touches before its first collective."""

    def Get_size(self):  # noqa: N802 - mpi4py's name
        return 1


@pytest.fixture
def cuda_on_device_3(monkeypatch):
    """CUDA started on device 3 in this thread; every ``torch.cuda.set_device`` call recorded with its thread."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append((threading.current_thread().name, index)))
    return calls


def _wait_for(calls, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    return calls


def test_the_communication_thread_takes_the_device_of_the_thread_that_made_it(cuda_on_device_3):
    fake_mpi = types.SimpleNamespace(MIN=np.minimum)
    engine = Engine(_CommOfOne(), fake_mpi, oplog.OperationLog("test", (0,)), name="device-test")
    try:
        assert _wait_for(cuda_on_device_3) == [("hpcddp-device-test", 3)]
    finally:
        engine.close()


def test_a_thread_made_without_cuda_sets_no_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(index))
    engine = Engine(_CommOfOne(), types.SimpleNamespace(MIN=np.minimum), oplog.OperationLog("test", (0,)))
    engine.close()
    assert calls == []


def test_the_message_future_thread_takes_the_callers_device(cuda_on_device_3):
    from hpcddp.torch_backend._p2p import _MessageWork

    class _Arrived:
        """A message that completed already: its future's thread settles it at once."""

        def _block(self, timeout):
            return True

        def poll(self):
            return True

        def wait(self):
            return [torch.zeros(1)]

    work = _MessageWork(_Arrived(), None, "recv from rank 1")
    work.get_future().wait()
    assert _wait_for(cuda_on_device_3) == [("hpcddp-message-future", 3)]
