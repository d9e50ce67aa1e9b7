"""The communicator of a world of one process: every collective is the identity."""

from __future__ import annotations

import collections
from typing import Any

import torch

from .base import Communicator, Handle, ReduceOp, as_splits, completed, even_splits, split_ranks_error, splits_error

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """Collectives for ``python train.py`` without a launcher; nothing leaves the process.

    Arguments are still validated as on many ranks, so that a script that runs
    alone fails alike when launched on several.
    """

    name = "local"

    def __init__(self) -> None:
        super().__init__(rank=0, size=1)
        # Messages to self, by tag: sends waiting for a receive, and receives waiting for a send.
        self._sent: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._receiving: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def allreduce_async_(
        self, tensor: torch.Tensor, op: ReduceOp, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        return completed(tensor, "allreduce")

    def broadcast_async_(
        self, tensor: torch.Tensor, root: int, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        self._check_rank(root, "root")
        return completed(tensor, "broadcast")

    def allgather_async(
        self, tensor: torch.Tensor, *, check: str | None = None, label: str = "", step: int | None = None
    ) -> Handle:
        return completed(tensor.detach().clone().reshape(-1, *tensor.shape[1:]), "allgather")

    def reduce_async_(self, tensor: torch.Tensor, op: ReduceOp, root: int, *, check: str | None = None) -> Handle:
        self._check_rank(root, "root")
        return completed(tensor, "reduce")

    def gather_async(self, tensor: torch.Tensor, root: int, *, check: str | None = None) -> Handle:
        self._check_rank(root, "root")
        return completed(tensor.detach().clone().reshape(-1, *tensor.shape[1:]), "gather")

    def scatter_async_(
        self, out: torch.Tensor, chunks: list[torch.Tensor] | None, root: int, *, check: str | None = None
    ) -> Handle:
        self._check_rank(root, "root")
        if chunks is None or len(chunks) != 1:
            raise ValueError(f"chunks must be a list of 1 tensor on the root, got {chunks!r:.80}")
        if chunks[0].numel() != out.numel() or chunks[0].dtype != out.dtype:
            raise ValueError(
                f"scatter: out ({list(out.shape)} {out.dtype}) and chunks[0] ({list(chunks[0].shape)} "
                f"{chunks[0].dtype}) differ: pass an out tensor like chunks[0]"
            )
        return completed(out.copy_(chunks[0].reshape(out.shape)), "scatter")

    def reducescatter_async(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        splits: list[int] | None = None,
        *,
        check: str | None = None,
        label: str = "",
        step: int | None = None,
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")
        splits = even_splits(tensor.shape[0], 1) if splits is None else as_splits(splits)
        error = splits_error(splits, tensor.shape[0], 1)
        if error is not None:
            raise ValueError(error)
        return completed(tensor.detach().clone(), "reducescatter")

    def alltoall_async(
        self,
        tensor: torch.Tensor,
        splits: list[int] | None = None,
        *,
        check: str | None = None,
        label: str = "",
        step: int | None = None,
    ) -> Handle:
        if tensor.dim() == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
        if splits is not None:
            error = splits_error(as_splits(splits), tensor.shape[0], 1)
            if error is not None:
                raise ValueError(error)
        received = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        return completed((tensor.detach().clone(), received), "alltoall")

    def send_async(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Handle:
        self._check_rank(dest, "dest")
        waiting = self._receiving[tag]
        if waiting:
            target, handle = waiting.popleft()
            _deliver(tensor, target, handle)
        else:
            self._sent[tag].append(tensor.detach().clone())
        return completed(tensor, "send")

    def recv_async_(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Handle:
        self._check_rank(source, "source")
        handle = Handle("recv")
        if self._sent[tag]:
            _deliver(self._sent[tag].popleft(), tensor, handle)
        else:
            self._receiving[tag].append((tensor, handle))
        return handle

    def split(self, ranks: list[int]) -> LocalCommunicator:
        error = split_ranks_error(ranks, 1)
        if error is not None:
            raise ValueError(error)
        child = LocalCommunicator()
        child.check_collectives = self.check_collectives
        return child

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, root: int) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        pass

    def _check_rank(self, value: int, argument: str) -> None:
        if value != 0:
            raise ValueError(f"{argument} must be a rank in [0, 1), got {value}")


def _deliver(message: torch.Tensor, target: torch.Tensor, handle: Handle) -> None:
    if message.numel() != target.numel() or message.dtype != target.dtype:
        handle.set_exception(
            ValueError(
                f"recv: the message ({list(message.shape)} {message.dtype}) does not fit the tensor "
                f"({list(target.shape)} {target.dtype}): pass a tensor of the sent message's shape and dtype"
            )
        )
        return
    target.detach().copy_(message.reshape(target.shape))
    handle.set_result(target)
