"""The communicator of a world of one process: every collective is the identity."""

from __future__ import annotations

from typing import Any

import torch

from .base import Communicator, Handle, ReduceOp, completed

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """Collectives for ``python train.py`` without a launcher; nothing leaves the process."""

    name = "local"

    def __init__(self) -> None:
        super().__init__(rank=0, size=1)

    def allreduce_async_(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        return completed(tensor, "allreduce")

    def broadcast_async_(self, tensor: torch.Tensor, root: int) -> Handle:
        return completed(tensor, "broadcast")

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        return completed(tensor.detach().clone().reshape(-1, *tensor.shape[1:]), "allgather")

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        pass
