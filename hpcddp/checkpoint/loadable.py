"""What ``load_checkpoint``'s default, ``torch.load(weights_only=True)``, can read back.

torch's safe unpickler accepts tensors, plain Python values, dicts, lists, tuples and
sets of them, and a few torch types (``torch.Size``, dtypes, devices). Anything else,
a numpy scalar in ``extra`` for one, saves without complaint and then fails to load, at
the resume that needed it. ``check_loadable`` finds such a value before anything is
written and names where it sits in the state.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import torch

__all__ = ["check_loadable"]

# Exact types: a subclass (an IntEnum, a namedtuple, np.float64 is a float) pickles by its
# own class name, which the safe unpickler refuses.
_PLAIN = {type(None), bool, int, float, complex, str, bytes, bytearray, torch.Size, torch.device, torch.dtype}
_TENSORS = {torch.Tensor, torch.nn.Parameter}
_MAPPINGS = {dict, collections.OrderedDict, collections.Counter}
_SEQUENCES = {list, tuple, set}


def _reads_back(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back (a type the user allowed with add_safe_globals)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return False
    return True


def _key(where: str, key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


def _check(value: Any, where: str, seen: set[int]) -> None:
    kind = type(value)
    if kind in _PLAIN or kind in _TENSORS:
        return
    if kind in _MAPPINGS or kind in _SEQUENCES:
        if id(value) in seen:  # a container met twice (or holding itself) is checked once
            return
        seen.add(id(value))
        if kind in _MAPPINGS:
            for key, item in value.items():
                _check(key, f"a key of {where or 'the state'}", seen)
                _check(item, _key(where, key), seen)
        else:
            for index, item in enumerate(value):
                _check(item, f"an element of {where}" if kind is set else f"{where}[{index}]", seen)
        return
    if _reads_back(value):
        return
    raise TypeError(
        f"{where or 'state'} is a {kind.__module__}.{kind.__qualname__}, which load_checkpoint (torch.load with "
        "weights_only=True) cannot read back: convert it with float(...), int(...) or .item() (a numpy or other "
        "scalar) or torch.as_tensor(...) (an array), keeping to plain Python values and tensors; or save and load "
        "it with weights_only=False"
    )


def check_loadable(state: Any) -> None:
    """Raise TypeError naming the first value in ``state`` that ``torch.load(weights_only=True)`` cannot read.

    Args:
        state: what ``save_checkpoint`` is about to write.
    """
    _check(state, "", set())
