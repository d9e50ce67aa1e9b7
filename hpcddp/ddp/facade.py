"""OptimizerFacade: an object that answers as the torch optimizer it wraps (groups, state, state dict)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerFacade"]


class OptimizerFacade(torch.optim.Optimizer):
    """Forward what makes a torch optimizer (param_groups, state, defaults, state dicts) to ``self._optimizer``.

    Subclasses set ``_optimizer`` in ``__init__`` and override ``step``; any other
    attribute they lack is looked up on the wrapped optimizer.
    """

    #: attributes never forwarded (a lookup before ``__init__`` set them must fail, not recurse)
    _own_attributes: tuple[str, ...] = ("_optimizer",)

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._own_attributes:
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self._optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self._optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict into the wrapped optimizer."""
        self._optimizer.load_state_dict(state_dict)
