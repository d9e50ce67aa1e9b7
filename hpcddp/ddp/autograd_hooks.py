"""Autograd plumbing: the end of the outermost backward pass, also when checkpoints nest one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

__all__ = ["at_end_of_backward", "queue_on_outer_backward"]


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
            Variable._execution_engine.queue_callback(callback)

    handles.extend(fn.register_prehook(queue) for fn, _ in node.next_functions if fn is not None)
    return bool(handles)


def at_end_of_backward(callback: Callable[[], None], still_wanted: Callable[[], bool]) -> None:
    """Run ``callback`` when the backward pass running now ends: the outermost one, not a nested one.

    A pass that opens inside a reentrant backward (``torch.utils.checkpoint`` with
    ``use_reentrant=True``) ends with the outer backward, not with the nested one.

    Args:
        callback: what to run at the end (from autograd's thread).
        still_wanted: asked before moving the callback to an outer pass; False drops it.
    """

    def at_end() -> None:
        node = torch._C._current_autograd_node()
        if node is None or not queue_on_outer_backward(node, at_end, still_wanted):
            callback()

    Variable._execution_engine.queue_callback(at_end)
