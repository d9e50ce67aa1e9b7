"""MicroBatchSampler: each rank's micro-batches of every step, from one global order the world size does not change."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MicroBatch", "MicroBatchSampler"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: its place in the epoch's global order, its samples and its random seed."""

    #: the epoch it belongs to
    epoch: int
    #: the step of that epoch
    step: int
    #: its position among the epoch's micro-batches (the same at every world size)
    index: int
    #: dataset indices of its samples
    indices: list[int]
    #: the seed of its randomness (dropout, augmentation), from the sampler's seed, the epoch and ``index``
    seed: int

    @contextlib.contextmanager
    def rng(self) -> Iterator[None]:
        """Run the block with torch's random generators seeded by ``seed``, restoring them after.

        Dropout and other torch randomness in the block then follow the micro-batch,
        not the rank that runs it (CPU and the current CUDA device).
        """
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            torch.manual_seed(self.seed)
            yield


class MicroBatchSampler:
    """Hand each rank its micro-batches of each step from one seeded global order, as reproducible training needs.

    An epoch's samples are shuffled once (seeded by ``seed + epoch``, as
    ``DistributedSampler`` does) and cut into micro-batches of ``micro_batch_size``;
    step s takes the micro-batches ``s * micro_batches_per_step`` onwards, and the
    ranks split them in contiguous runs as evenly as they go (8 over 3 ranks: 3, 3,
    2; a rank may get none). Neither the order nor the micro-batches depend on the
    world size, so with ``DistributedOptimizer(reproducible=True)`` a run at any
    number of ranks takes the same steps.

    Iterating yields, per step, this rank's list of ``MicroBatch``. The sampler keeps
    its place: ``state_dict()`` after a step resumes, at any world size, with the
    next step. Call ``set_epoch(epoch)`` before each epoch (a new epoch starts at its
    first step; the epoch it is already in continues where it stopped); iterating a
    finished epoch again without it repeats that epoch's order, as ``DistributedSampler`` does.

    Args:
        num_samples: the dataset's length (or the dataset itself).
        micro_batch_size: samples per micro-batch.
        micro_batches_per_step: micro-batches summed into each step, over all ranks.
        shuffle: shuffle each epoch (else the dataset's order).
        seed: seed of the order and of every micro-batch's randomness.
        drop_last: drop the samples that do not fill a whole step (else the last
            step has fewer micro-batches, and the last micro-batch fewer samples).
        rank: this rank (default: ``hpcddp.rank()``, read when iterating).
        world_size: the number of ranks (default: ``hpcddp.size()``, read when iterating).
    """

    def __init__(
        self,
        num_samples: Any,
        micro_batch_size: int,
        micro_batches_per_step: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not isinstance(num_samples, int):
            num_samples = len(num_samples)
        for name, value in (("micro_batch_size", micro_batch_size), ("micro_batches_per_step", micro_batches_per_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither (then hpcddp's are used)")
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if drop_last and 0 < num_samples < micro_batch_size * micro_batches_per_step:
            raise ValueError(
                f"num_samples={num_samples} is less than one step of micro_batch_size={micro_batch_size} x "
                f"micro_batches_per_step={micro_batches_per_step} samples, so drop_last=True leaves no step: pass "
                "drop_last=False or fewer micro-batches per step"
            )
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.micro_batches_per_step = micro_batches_per_step
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self._place = (rank, world_size)
        self.epoch = 0
        #: the next step of ``epoch`` to hand out
        self.next_step = 0

    # -- the global order ------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per epoch, over all ranks."""
        if self.drop_last:
            return len(self) * self.micro_batches_per_step
        return -(-self.num_samples // self.micro_batch_size)

    def __len__(self) -> int:
        """Steps per epoch."""
        per_step = self.micro_batch_size * self.micro_batches_per_step
        return self.num_samples // per_step if self.drop_last else -(-self.num_samples // per_step)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def micro_batch_seed(self, index: int) -> int:
        """Return the seed of micro-batch ``index`` of the current epoch (the same at every world size)."""
        digest = hashlib.blake2b(f"{self.seed}:{self.epoch}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def step_range(self, step: int, rank: int, world_size: int) -> range:
        """Return the epoch's micro-batch indices that ``rank`` of ``world_size`` runs in ``step``."""
        first = step * self.micro_batches_per_step
        count = max(0, min(self.micro_batches_per_step, self.num_micro_batches - first))
        base, extra = divmod(count, world_size)
        start = first + rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))

    # -- iteration and position ------------------------------------------------------------
    def __iter__(self) -> Iterator[list[MicroBatch]]:
        rank, world_size = self._place
        if world_size is None:
            from ..runtime.state import rank as current_rank
            from ..runtime.state import size as current_size

            rank, world_size = current_rank(), current_size()
        if self.next_step >= len(self):  # iterated again without set_epoch: the same order again, as torch's
            self.next_step = 0
        order = self._order()
        size = self.micro_batch_size
        for step in range(self.next_step, len(self)):
            self.next_step = step + 1
            yield [
                MicroBatch(
                    self.epoch, step, index, order[index * size : (index + 1) * size], self.micro_batch_seed(index)
                )
                for index in self.step_range(step, rank, world_size)
            ]

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order; a new epoch starts at its first step, the current one continues."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.next_step = 0

    def state_dict(self) -> dict[str, int]:
        """Return the position (epoch and next step) and the settings it is valid for.

        After an epoch's last step the position is the next epoch's first step.
        """
        done = self.next_step >= len(self)
        return {
            "epoch": self.epoch + done,
            "next_step": 0 if done else self.next_step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "num_samples": self.num_samples,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches_per_step": self.micro_batches_per_step,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (saved at any world size); its settings must be this sampler's."""
        for key in ("seed", "shuffle", "drop_last", "num_samples", "micro_batch_size", "micro_batches_per_step"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"the sampler state was saved with {key}={state.get(key)!r}, this sampler has "
                    f"{key}={getattr(self, key)!r}: build the sampler as the run that saved it did"
                )
        self.epoch = int(state["epoch"])
        self.next_step = int(state["next_step"])
