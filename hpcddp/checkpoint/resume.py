"""What an exact resume needs: model, optimizer, position and every rank's RNG streams.

state = hpcddp.training_state(model, optimizer, epoch=epoch, batch_in_epoch=i, step=step)
progress = hpcddp.restore_training_state(state, model, optimizer)
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TrainingProgress", "rank_and_size", "restore_training_state", "training_state"]

log = logging.getLogger("hpcddp")

_FORMAT = 1


def rank_and_size() -> tuple[int, int]:
    """Return (rank, size) of the job, or (0, 1) before ``hpcddp.init()``."""
    from ..runtime.state import is_initialized, rank, size

    return (rank(), size()) if is_initialized() else (0, 1)


def _rng_state() -> dict[str, Any]:
    # Plain ints, lists and tensors only, so that torch.load(weights_only=True) accepts it.
    version, internal, gauss = random.getstate()
    rng: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return rng
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return rng


def _set_rng_state(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(rng["torch"].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, cached))


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    batch_in_epoch: int,
    step: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Capture everything an exact resume needs; call it on every rank at a step boundary.

    Each rank's RNG states (python, numpy, torch CPU and CUDA) are gathered, so
    ranks that draw different random numbers resume with their own streams.

    Args:
        model: the model (its ``state_dict()``).
        optimizer: the optimizer or DistributedOptimizer (its ``state_dict()``).
        epoch: the epoch in progress (what ``sampler.set_epoch`` was given).
        batch_in_epoch: batches of ``epoch`` already done; a resume skips them.
        step: optimizer steps done so far (names the checkpoint file).
        extra: anything else to keep (ints, floats, strings, tensors, lists, dicts).
    """
    from ..runtime.state import is_initialized, size

    rng = _rng_state()
    rng_per_rank = [rng]
    if is_initialized() and size() > 1:
        from ..collectives.tensors import allgather_object

        rng_per_rank = allgather_object(rng)
    return {
        "format": _FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "world_size": len(rng_per_rank),
        "rng": rng_per_rank,
        "extra": dict(extra or {}),
    }


@dataclass
class TrainingProgress:
    """Where a restored run continues: skip ``batch_in_epoch`` batches of ``epoch``."""

    epoch: int
    batch_in_epoch: int
    step: int
    extra: dict[str, Any] = field(default_factory=dict)


def restore_training_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrainingProgress:
    """Load model, optimizer and this rank's RNG states from ``state``; return the position.

    Args:
        state: a dict from ``training_state`` (e.g. via ``load_checkpoint``).
        model: receives ``state["model"]``.
        optimizer: receives ``state["optimizer"]``; None leaves it alone.
    """
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"state must come from hpcddp.training_state (format {_FORMAT}), got {type(state).__name__}")
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    rank, size = rank_and_size()
    rngs = state["rng"]
    if len(rngs) != size:
        log.warning(
            "hpcddp: checkpoint was saved by %d rank(s), this job has %d: every rank restores rank 0's RNG "
            "state, so random draws will not match the original run",
            len(rngs),
            size,
        )
    _set_rng_state(rngs[rank] if len(rngs) == size else rngs[0])
    return TrainingProgress(state["epoch"], state["batch_in_epoch"], state["step"], dict(state.get("extra", {})))
