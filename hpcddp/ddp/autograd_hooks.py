"""Autograd plumbing: the end of the outermost backward pass, also when checkpoints nest one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["at_end_of_backward", "queue_on_outer_backward"]

#: backward pass (autograd graph task) -> the callbacks to run when it ends, in the order queued
_ends: dict[int, list[Callable[[], None]]] = {}
_ends_lock = threading.Lock()


def _queue_at_end(callback: Callable[[], None]) -> None:
    """Queue ``callback`` at the end of the running backward pass, with every other one queued here.

    Autograd stops running a pass's final callbacks at the first that raises. One
    optimizer's reduction that raises there (a refused step) would leave the others'
    passes open on some ranks only, so each pass gets one final callback that runs all
    of them and then raises the first error.
    """
    current = getattr(torch._C, "_current_graph_task_id", None)
    task = -1 if current is None else current()
    if task < 0:
        Variable._execution_engine.queue_callback(callback)
        return
    with _ends_lock:
        queued = _ends.get(task)
        if queued is not None:
            queued.append(callback)
            return
        if len(_ends) >= 1024:  # passes that raised never ran their final callbacks: forget the oldest
            del _ends[next(iter(_ends))]
        _ends[task] = [callback]
    Variable._execution_engine.queue_callback(lambda: _run_ends(task))


def _run_ends(task: int) -> None:
    with _ends_lock:
        callbacks = _ends.pop(task, [])
    first: BaseException | None = None
    for callback in callbacks:  # a callback may queue more: they join the list of the pass running them
        try:
            callback()
        except BaseException as err:  # noqa: BLE001 - raised below, after the others ran
            first = first or err
    if first is not None:
        raise first


def queue_on_outer_backward(node, callback: Callable[[], None], still_wanted: Callable[[], bool]) -> bool:
    """Queue ``callback`` at the end of the backward pass that runs ``node``; return False if impossible.

    Called from the end of a reentrant backward (``torch.utils.checkpoint`` with
    ``use_reentrant=True`` runs one inside the outer backward's ``node``): a final
    callback queued there would run at the end of the nested pass. A pre-hook on
    the nodes after ``node`` runs in the outer pass instead, and queues ``callback``
    on it (once, and only if ``still_wanted()`` then).

    Args:
        node: the outer backward's node that is running the nested backward
            (``torch._C._current_autograd_node()``).
        callback: what to run when the outer backward ends.
        still_wanted: asked when a next node runs; False drops the callback.
    """
    handles: list[Any] = []
    queued: list[bool] = []

    def queue(grad_outputs):
        for handle in handles:
            handle.remove()
        if not queued and still_wanted():
            queued.append(True)
            _queue_at_end(callback)

    handles.extend(fn.register_prehook(queue) for fn, _ in node.next_functions if fn is not None)
    return bool(handles)


def at_end_of_backward(callback: Callable[[], None], still_wanted: Callable[[], bool]) -> None:
    """Run ``callback`` when the backward pass running now ends: the outermost one, not a nested one.

    A pass that opens inside a reentrant backward (``torch.utils.checkpoint`` with
    ``use_reentrant=True``) ends with the outer backward, not with the nested one.
    Every callback queued on one pass runs, also when one before it raised; the pass
    then raises the first error.

    Args:
        callback: what to run at the end (from autograd's thread).
        still_wanted: asked before moving the callback to an outer pass; False drops it.
    """

    def at_end() -> None:
        node = torch._C._current_autograd_node()
        if node is None or not queue_on_outer_backward(node, at_end, still_wanted):
            callback()

    _queue_at_end(at_end)
