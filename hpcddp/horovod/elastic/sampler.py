"""Horovod's ElasticSampler: shards a dataset over the ranks and re-shards what is left after a reset."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from ..basics import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, but it remembers how far the epoch went and re-shards the rest.

    Kept in a ``TorchState``, it survives a reset: the samples not processed yet in this
    epoch are spread over the new set of ranks. Call ``record_batch`` after each batch
    and ``set_epoch`` at the END of each epoch (Horovod's order: a reset in the middle of
    an epoch must not process its samples again).

    Args:
        dataset: the dataset (its length must not change).
        shuffle: shuffle the indices, the same way on every rank.
        seed: the shuffling seed, the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order when shuffling, and nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """Return the epoch and how many of its samples were processed."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a position from ``state_dict`` and re-shard the rest over the current ranks."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-shard the samples of this epoch not processed yet over the current ranks."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = self.remaining_indices[:]
        # Pad by repeating from the start so that every rank gets num_samples, as DistributedSampler does:
        # cyclically, since fewer samples than ranks may be left after a reset (one sample, three ranks).
        padding = self.total_size - len(indices)
        if padding > 0:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        self.indices = indices[self.rank : self.total_size : self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
