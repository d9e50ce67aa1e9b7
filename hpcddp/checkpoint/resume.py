"""What an exact resume needs: model, optimizer, position and every rank's RNG streams.

state = hpcddp.training_state(model, optimizer, epoch=epoch, batch_in_epoch=i, step=step)
progress = hpcddp.restore_training_state(state, model, optimizer)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from .identity import check_resumable, this_run

__all__ = ["TrainingProgress", "rank_and_size", "restore_training_state", "training_state"]

_FORMAT = 1

# Optimizer state that torch.optim keeps in its parameter's shape (Adam, SGD, RMSprop,
# Adagrad, Adadelta, Adamax, ASGD, Rprop). Others have shapes of their own (Adafactor's
# factored rows and columns), so only these are compared with the parameter.
_PARAMETER_SHAPED = frozenset(
    ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum", "exp_inf")
    + ("grad_avg", "ax", "prev", "step_size")
)
_SHOWN = 3  # differences named in one error


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


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else "integer or bool"


def _model_misfits(saved: Any, live: dict[str, Any]) -> list[str]:
    """How the checkpoint's model state differs from ``live`` in what ``load_state_dict`` would refuse."""
    if not isinstance(saved, dict):
        return [f"it holds a {type(saved).__name__}, not a model's state_dict"]
    misfits = []
    for name, value in live.items():
        if name not in saved:
            misfits.append(f"{name}: missing from the checkpoint")
            continue
        other = saved[name]
        if not isinstance(value, torch.Tensor) or not isinstance(other, torch.Tensor):
            continue
        if other.shape != value.shape:
            misfits.append(f"{name}: shape {list(other.shape)} in the checkpoint, {list(value.shape)} here")
        elif _kind(other.dtype) != _kind(value.dtype):  # float32 into bfloat16 is a cast; float into int is not
            misfits.append(f"{name}: dtype {other.dtype} in the checkpoint, {value.dtype} here")
    misfits += [f"{name}: not in this model" for name in saved if name not in live]
    return misfits


def _optimizer_misfits(saved: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """How the checkpoint's optimizer state differs from ``optimizer``'s groups and parameters."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return [f"it holds a {type(saved).__name__}, not an optimizer's state_dict"]
    groups, live = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live):
        return [f"{len(groups)} parameter group(s) in the checkpoint, {len(live)} here"]
    misfits = [
        f"parameter group {i} holds {len(g['params'])} parameter(s) in the checkpoint, {len(h['params'])} here"
        for i, (g, h) in enumerate(zip(groups, live))
        if len(g["params"]) != len(h["params"])
    ]
    if misfits:
        return misfits
    parameters = {key: p for g, h in zip(groups, live) for key, p in zip(g["params"], h["params"])}
    for key, entry in saved.get("state", {}).items():
        param = parameters.get(key)
        if param is None or not isinstance(entry, dict):
            continue
        misfits += [
            f"{name} of parameter {key}: shape {list(value.shape)} in the checkpoint, the parameter's "
            f"{list(param.shape)} here"
            for name, value in entry.items()
            if name in _PARAMETER_SHAPED and isinstance(value, torch.Tensor) and value.shape != param.shape
        ]
    return misfits


def _check_fits(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise ValueError, before anything is loaded, when ``state`` was saved from another model or optimizer.

    ``load_state_dict`` would raise only after loading what fits: the model half restored.
    """
    checks = [
        (
            "model",
            _model_misfits(state.get("model"), model.state_dict()),
            "restore a checkpoint of this model, or build the model it was saved from",
        ),
    ]
    if optimizer is not None:
        checks.append(
            (
                "optimizer",
                _optimizer_misfits(state.get("optimizer"), optimizer),
                "build the optimizer as the saving job did (the same parameters, groups and order)",
            )
        )
    for what, misfits, fix in checks:
        if misfits:
            more = f"; and {len(misfits) - _SHOWN} more" if len(misfits) > _SHOWN else ""
            raise ValueError(
                f"the checkpoint's {what} does not fit this {what} ({'; '.join(misfits[:_SHOWN])}{more}): {fix}; "
                "nothing was restored"
            )


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

    Each rank's RNG states (python, numpy, torch CPU and CUDA) are gathered to rank 0,
    which ``save_checkpoint`` writes, so ranks that draw different random numbers
    resume with their own streams; on the other ranks ``state["rng"]`` holds their
    own streams only (None in the others' places). The run
    (HPCDDP_RUN_ID) and the number of ranks are recorded: ``restore_training_state``
    resumes only this run's checkpoints at this size unless told otherwise.

    Args:
        model: the model (its ``state_dict()``).
        optimizer: the optimizer or DistributedOptimizer (its ``state_dict()``).
        epoch: the epoch in progress (what ``sampler.set_epoch`` was given).
        batch_in_epoch: batches of ``epoch`` already done; a resume skips them.
        step: optimizer steps done so far (names the checkpoint file).
        extra: anything else to keep (ints, floats, strings, tensors, lists, dicts).
    """
    rank, size = rank_and_size()
    rng = _rng_state()
    rng_per_rank = [rng]
    if size > 1:
        from ..runtime.state import communicator

        # Only the writer (rank 0, save_checkpoint) needs every rank's streams: gathering them
        # to every rank moved p x 14 KiB to each (57 MiB per rank at 4,096 ranks).
        rng_per_rank = communicator().gather_object(rng, 0)
        if rng_per_rank is None:
            rng_per_rank = [rng if r == rank else None for r in range(size)]
    return {
        "format": _FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "world_size": size,
        "run_id": this_run(),
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
    *,
    resume: str | None = None,
) -> TrainingProgress:
    """Load model, optimizer and this rank's RNG states from ``state``; return the position.

    Before anything is loaded, ``state`` must belong to this run and have been saved by
    as many ranks as this job has (``hpcddp.checkpoint.identity``), and its model and
    optimizer states must fit ``model`` and ``optimizer`` (the same keys and shapes, the
    same kind of dtype, the same parameter groups); every rank raises the same error
    otherwise, and nothing is changed.

    Args:
        state: a dict from ``training_state`` (e.g. via ``load_checkpoint``).
        model: receives ``state["model"]``.
        optimizer: receives ``state["optimizer"]``; None leaves it alone.
        resume: what may differ from the job that saved ``state``: ``"strict"``
            (nothing), ``"any-run"`` (another run's checkpoint), ``"any-size"``
            (another number of ranks: ranks the saving job had continue their RNG
            streams, the others keep theirs) or ``"any"``; None reads HPCDDP_RESUME,
            ``"strict"`` when unset.

    Raises:
        ValueError: ``state`` belongs to another run or another number of ranks and
            ``resume`` does not allow it, was saved from another model or optimizer, or
            does not come from ``training_state``.
    """
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"state must come from hpcddp.training_state (format {_FORMAT}), got {type(state).__name__}")
    rank, size = rank_and_size()
    check_resumable(state, rank, size, resume)
    _check_fits(state, model, optimizer)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    rngs = state["rng"]
    if rank < len(rngs):
        _set_rng_state(rngs[rank])
    return TrainingProgress(state["epoch"], state["batch_in_epoch"], state["step"], dict(state.get("extra", {})))
