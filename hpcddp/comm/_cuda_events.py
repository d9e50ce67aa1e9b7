"""When GPU work really finished, from CUDA events, on the host's ``perf_counter`` clock.

NCCL's ``Work.get_future()`` completes once the collective is queued on NCCL's stream
(torch marks it completed right after the launch, with CUDA events for stream-safe
readers), and ``Work.wait()`` only makes the caller's stream wait: neither says when the
GPU finished (issue 34, item 7). ``GpuCompletion`` records an event after the collective
on a side stream of its own, so that only that stream waits for NCCL's, never the
caller's compute, and turns the event's GPU time into ``perf_counter`` time through one
anchor event per device that the host waited for once. Reading a time never blocks unless
the caller asks to (``completion_time``).

Only CUDA calls live here; CPU-only torch never reaches them (``is_cuda_tensor`` guards).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

__all__ = ["GpuCompletion", "current_cuda_device", "is_cuda_tensor", "set_rank_cuda_device", "use_cuda_device"]

log = logging.getLogger("hpcddp")

_lock = threading.Lock()
#: the rank's GPU index, set by ``init()`` (``hpcddp.runtime.bootstrap``); None on the CPU
_rank_device: int | None = None
_side_streams: dict[torch.device, Any] = {}
_anchors: dict[torch.device, tuple[Any, float]] = {}


def is_cuda_tensor(value: Any) -> bool:
    """True for a CUDA tensor, or a list or tuple whose first item is one."""
    if isinstance(value, (list, tuple)):
        return bool(value) and is_cuda_tensor(value[0])
    return isinstance(value, torch.Tensor) and value.is_cuda


def set_rank_cuda_device(index: int | None) -> None:
    """Record the rank's GPU (``init()`` calls this after ``torch.cuda.set_device``), or None on the CPU.

    Args:
        index: the rank's CUDA device index, or None where the rank runs on the CPU.
    """
    global _rank_device
    _rank_device = index


def current_cuda_device() -> int | None:
    """The CUDA device a thread made now must work on, or None where CUDA was never started.

    The rank's GPU once ``init()`` chose one, whatever device the calling thread has
    selected at the moment: a communicator made inside ``with torch.cuda.device(k)`` must
    not send its communication thread's work to cuda:k for good. Before ``init()`` (or
    on the CPU), the calling thread's current device.
    """
    if not torch.cuda.is_initialized():
        return None
    return _rank_device if _rank_device is not None else torch.cuda.current_device()


def use_cuda_device(index: int | None) -> None:
    """Make ``index`` (from ``current_cuda_device()`` on the thread that made this one) this thread's CUDA device.

    The current device is per thread and a new thread starts on cuda:0: without this, a
    future callback run on a communication thread (a DDP comm hook's division, say) would
    queue its kernels on cuda:0 on a node where this rank owns another GPU. A failure is
    logged as an error naming the thread and the device, and the thread goes on on its
    current device: raised here, it would end a communication thread whose queue other
    threads wait for (a hang), with only a traceback on stderr to say why.

    Args:
        index: the device index, or None to leave the thread's device as it is.
    """
    if index is None:
        return
    try:
        torch.cuda.set_device(index)
    except Exception as err:  # noqa: BLE001 - reported, and the thread keeps serving its queue
        log.error(
            "hpcddp: thread %s could not select cuda:%d (%s: %s): its GPU work runs on its current device "
            "instead; check CUDA_VISIBLE_DEVICES and that device %d exists on this node",
            threading.current_thread().name, index, type(err).__name__, err, index,
        )  # fmt: skip


def _device_of(value: Any) -> torch.device:
    return _device_of(value[0]) if isinstance(value, (list, tuple)) else value.device


def _side_stream(device: torch.device):
    with _lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
        return stream


def _anchor(device: torch.device) -> tuple[Any, float]:
    """Return (an event, the perf_counter time it ran at), made once per device."""
    with _lock:
        anchor = _anchors.get(device)
        if anchor is None:
            # A fresh stream has nothing queued: the event runs as soon as it is recorded,
            # and the host waits for it once, here, not per collective.
            stream = torch.cuda.Stream(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            event.synchronize()
            anchor = _anchors[device] = (event, time.perf_counter())
        return anchor


class GpuCompletion:
    """The moment a torch.distributed Work's kernels finished on the GPU.

    Args:
        work: a Work of a CUDA backend (nccl), just launched.
        tensors: its tensor(s) (a CUDA tensor or a list of them): they name the device.
    """

    def __init__(self, work, tensors: Any) -> None:
        device = _device_of(tensors)
        self._anchor_event, self._anchor_time = _anchor(device)
        self._end = torch.cuda.Event(enable_timing=True)
        stream = _side_stream(device)
        with torch.cuda.stream(stream):
            work.wait()  # the side stream waits for NCCL's kernels; the host and the caller's stream do not
        self._end.record(stream)
        self._at: float | None = None

    def query(self) -> bool:
        """True once the GPU finished the work (never blocks)."""
        return self._at is not None or self._end.query()

    @property
    def completed_at(self) -> float | None:
        """perf_counter time the GPU finished the work, or None while it has not (never blocks)."""
        if self._at is None and self._end.query():
            self._at = self._anchor_time + self._anchor_event.elapsed_time(self._end) / 1e3
        return self._at

    def completion_time(self) -> float:
        """Wait for the GPU to finish the work (this event only) and return when it did."""
        if self._at is None:
            self._end.synchronize()
        return self.completed_at  # type: ignore[return-value]
