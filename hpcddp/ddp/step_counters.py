"""Optimizer step counters where torch keeps them, after loading a state onto a GPU.

torch keeps Adam's (AdamW's, ...) ``state["step"]`` on the CPU unless the param group is
``fused`` or ``capturable``, and its ``load_state_dict`` leaves a loaded counter where it
finds it. ``torch.load(map_location=<cuda device>)`` moves the counters to the GPU with the
rest, and every step then reads each one back with a host sync (issue 34, item 11).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["keep_step_counters_on_cpu_"]

# Deep enough for {"optimizer": state_dict} and a list of optimizers inside a training state.
_MAX_DEPTH = 4


def keep_step_counters_on_cpu_(state: Any, _depth: int = 0) -> Any:
    """Move the step counters of every optimizer state dict found in ``state`` to the CPU, in place; return ``state``.

    An optimizer state dict is a dict with "state" and "param_groups"; a group that is
    ``fused`` or ``capturable`` keeps its counters on its device, as torch does.

    Args:
        state: what ``torch.load`` returned (an optimizer state dict, or a dict or list holding some).
    """
    if _depth > _MAX_DEPTH:
        return state
    if isinstance(state, dict) and isinstance(state.get("state"), dict) and isinstance(state.get("param_groups"), list):
        _move_counters(state)
        return state
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in values:
        keep_step_counters_on_cpu_(value, _depth + 1)
    return state


def _move_counters(optimizer_state: dict) -> None:
    on_device = set()
    for group in optimizer_state["param_groups"]:
        if isinstance(group, dict) and (group.get("fused") or group.get("capturable")):
            on_device.update(group.get("params", ()))
    for key, param_state in optimizer_state["state"].items():
        if key in on_device or not isinstance(param_state, dict):
            continue
        step = param_state.get("step")
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":
            param_state["step"] = step.cpu()
