"""Horovod's elastic state objects: what a job commits, restores after a failure and syncs to new ranks.

Names and semantics are Horovod 0.28's (``horovod.common.elastic`` and
``horovod.torch.elastic.state``). Under ``hpcddp run --min-np`` a commit is also kept in
node-local memory, because a lost MPI process ends its job: the ranks of the next start
resume from it (``hpcddp.elastic.session``).
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...elastic.protocol import HostUpdate
from ...elastic.session import worker_session
from ..basics import HostsUpdatedInterrupt, rank
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler

__all__ = [
    "ModelStateHandler",
    "ObjectState",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "State",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "set_handler_registry",
]


class State:
    """The state of an elastic job, kept across failures and changes of hosts.

    Args:
        bcast_object: broadcasts an object from rank 0 (``hvd.broadcast_object``).
        get_rank: returns this process's rank (``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable[[], int] = rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._serial = -1

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call ``callbacks`` after every reset (ranks added or removed), e.g. to scale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run after a reset: forget host messages, ``reset()``, then the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdate) -> None:
        """Record the driver's message that hosts were added or removed."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (in memory, and on the node under ``hpcddp run --min-np``), then ``check_host_updates()``.

        Commits copy every tracked tensor: commit every few batches, not every batch,
        trading the steps a failure loses against the time a commit takes.
        """
        self.save()
        self._keep()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank once rank 0 has heard that the hosts changed (collective)."""
        previous = last = self._last_updated_timestamp
        update = HostUpdate.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= result
        # Rank 0's view decides, so that every rank raises at the same commit.
        previous, self._last_updated_timestamp, update = self._bcast_object((previous, last, int(update)))
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(update == HostUpdate.removed)

    def save(self) -> None:
        """Save the state in memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Go back to the last saved state, dropping changes since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Give every rank rank 0's state (collective)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjust to a new set of ranks (before ``sync``); nothing by default."""

    def _snapshot(self) -> dict[str, Any]:
        """The saved state as plain objects (what a node keeps of a commit)."""
        raise NotImplementedError()

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Take a snapshot as the saved state and restore it."""
        raise NotImplementedError()

    def _keep(self) -> None:
        session = worker_session()
        if session is not None:
            self._serial += 1
            session.keep(self._serial, self._snapshot())


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments and kept as attributes.

    Args:
        bcast_object: broadcasts an object from rank 0 (``hvd.broadcast_object`` by default).
        get_rank: returns this process's rank (``hvd.rank`` by default).
        kwargs: the attributes to keep, with their first values.
    """

    def __init__(self, bcast_object: Callable = broadcast_object, get_rank: Callable[[], int] = rank, **kwargs) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)

    def _snapshot(self) -> dict[str, Any]:
        return {"objects": dict(self._saved_state)}

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = dict(snapshot["objects"])
        self.restore()


class StateHandler:
    """Keeps one kind of object's saved state for TorchState (``value`` is the live object)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value: Any) -> None:
        """Track ``value`` instead, and save it."""
        self.value = value
        self.save()

    @property
    def saved(self) -> Any:
        """The saved state as plain objects (for a node's copy of a commit)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be kept across restarts: define its saved property")

    @saved.setter
    def saved(self, state: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be kept across restarts: define its saved setter")


class _StateDictHandler(StateHandler):
    """A handler for objects with ``state_dict()`` / ``load_state_dict()``: saves a deep copy."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    @property
    def saved(self) -> Any:
        return self._saved

    @saved.setter
    def saved(self, state: Any) -> None:
        self._saved = state


class ModelStateHandler(_StateDictHandler):
    """Saves a module's ``state_dict``; sync broadcasts rank 0's parameters and buffers."""

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """Saves an optimizer's ``state_dict``; sync broadcasts rank 0's state and options."""

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    """Saves an ElasticSampler's position; sync gives every rank rank 0's."""

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """Return the ``(type, handler class)`` pairs TorchState consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the pairs TorchState consults."""
    global _handler_registry
    _handler_registry = registry


def _handler_for(value: Any) -> StateHandler | None:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training job: models, optimizers, ElasticSamplers and plain objects.

    Args:
        model: a module (optional).
        optimizer: an optimizer (optional).
        kwargs: more attributes: modules, optimizers and samplers get their handler,
            anything else is kept as a plain picklable object.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in getattr(self, "_handlers", {}) and hasattr(self, name):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self) -> dict[str, Any]:
        snapshot = super()._snapshot()
        snapshot["handlers"] = {name: handler.saved for name, handler in self._handlers.items()}
        return snapshot

    def _load_snapshot(self, snapshot: dict[str, Any]) -> None:
        missing = set(self._handlers) - set(snapshot.get("handlers", {}))
        if missing:
            raise RuntimeError(
                f"the last commit has no state for {', '.join(sorted(missing))}: "
                "give TorchState the same models, optimizers and samplers in every start of the job"
            )
        for name, handler in self._handlers.items():
            handler.saved = snapshot["handlers"][name]
            handler.restore()
        super()._load_snapshot(snapshot)
