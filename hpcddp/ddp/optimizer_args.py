"""The checks behind DistributedOptimizer's arguments: each error names the argument and the value."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.base import ReduceOp, parse_op
from .compression import Compressor, Int8, PowerSGD

__all__ = [
    "COMPRESSIONS",
    "OptimizerArguments",
    "check_arguments",
    "check_backward_passes",
    "check_positive",
    "collect_parameters",
]

#: compression name -> the dtype gradients travel in (None: as stored)
COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
#: compression name -> the compressor with its default settings
COMPRESSORS = {"powersgd": PowerSGD, "int8": Int8}


@dataclass(frozen=True)
class OptimizerArguments:
    """The checked, normalised arguments."""

    op: ReduceOp
    wire_dtype: torch.dtype | None
    compressor: Compressor | None = None


def check_arguments(
    optimizer,
    *,
    bucket_cap_mb,
    first_bucket_mb,
    backward_passes_per_step,
    compression,
    op,
    gradient_predivide_factor,
) -> OptimizerArguments:
    """Validate DistributedOptimizer's arguments; see its docstring for their meaning."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_positive("bucket_cap_mb", bucket_cap_mb)
    check_positive("first_bucket_mb", first_bucket_mb)
    check_backward_passes(backward_passes_per_step)
    compressor = _compressor(compression)
    key = compression.lower() if isinstance(compression, str) else compression
    if compressor is None and key not in COMPRESSIONS:
        raise ValueError(
            "compression must be one of None, 'fp16', 'bf16', 'powersgd', 'int8', hpcddp.PowerSGD(...) "
            f"or hpcddp.Int8(...), got {compression!r}"
        )
    reduce_op = parse_op(op)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"op must be 'average' or 'sum' for gradients, got {op!r}")
    if gradient_predivide_factor is not None:
        check_positive("gradient_predivide_factor", gradient_predivide_factor)
        if reduce_op is not ReduceOp.AVERAGE:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor!r} only applies to op='average', got op={op!r}"
            )
    return OptimizerArguments(reduce_op, None if compressor else COMPRESSIONS[key], compressor)


def _compressor(compression) -> Compressor | None:
    """The compressor ``compression`` names or is, or None for a dtype (or no) compression."""
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, type) and issubclass(compression, Compressor):
        return compression()
    if isinstance(compression, str) and compression.lower() in COMPRESSORS:
        return COMPRESSORS[compression.lower()]()
    return None


def check_backward_passes(passes) -> None:
    """Raise ValueError unless ``passes`` (backward_passes_per_step) is an integer >= 1."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")


def check_positive(name: str, value: float) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def collect_parameters(optimizer, named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    """Return the (name, parameter) pairs to reduce, in registration order (frozen ones too).

    Args:
        optimizer: the wrapped optimizer; every parameter it holds must be named.
        named_parameters: ``model.named_parameters()``, or None to number the
            optimizer's parameters.
    """
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if len({id(p) for p in in_optimizer}) != len(in_optimizer):
        position = next(i for i, p in enumerate(in_optimizer) if any(p is q for q in in_optimizer[:i]))
        raise ValueError(
            f"the optimizer lists parameter #{position} twice (torch only warns): pass each parameter once"
        )
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
    else:
        named = list(named_parameters)
        seen_names: set[str] = set()
        seen_params: dict[int, str] = {}
        for entry in named:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
                raise TypeError(
                    f"named_parameters must yield (name, parameter) pairs such as model.named_parameters(), got {entry!r:.80}"
                )
            name, param = entry
            if name in seen_names:
                raise ValueError(f"named_parameters lists the name {name!r} twice: names must be unique")
            if id(param) in seen_params:
                raise ValueError(
                    f"named_parameters lists one parameter twice, as {seen_params[id(param)]!r} and {name!r}: "
                    "pass each parameter once"
                )
            seen_names.add(name)
            seen_params[id(param)] = name
        missing = [p for p in in_optimizer if id(p) not in seen_params]
        if missing:
            raise ValueError(
                f"named_parameters is missing {len(missing)} of the optimizer's parameters: "
                "pass model.named_parameters() for the model the optimizer trains"
            )
    return named
