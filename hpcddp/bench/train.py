"""Time training steps: local compute, torch DDP (gloo/nccl, or over hpcddp's MPI backend, also with
torch's PowerSGD hook), Horovod (when importable), hpcddp (fp32, fp16, PowerSGD, int8 gradients), and
local SGD (parameters averaged every ``LOCAL_SGD_PERIOD`` steps)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import hpcddp

from .metrics import median
from .models import Workload

__all__ = ["VARIANTS", "TrainResult", "bench_train", "horovod_available"]

#: every variant, in the order each round runs them; "ddp-hpcddp" is torch DDP on the
#: ``hpcddp`` torch.distributed backend (hpcddp's MPI communicator), "ddp-powersgd" the same
#: with torch's PowerSGD hook
VARIANTS = (
    "local",
    "ddp",
    "ddp-hpcddp",
    "ddp-powersgd",
    "horovod",
    "hpcddp",
    "hpcddp-fp16",
    "hpcddp-powersgd",
    "hpcddp-int8",
    "hpcddp-reproducible",
    "local-sgd",
)
#: DistributedOptimizer's extra arguments per hpcddp variant; PowerSGD from the first step (the
#: timed steps follow a few untimed ones, and torch's hook starts at its earliest, step 2)
HPCDDP_VARIANTS = {
    "hpcddp": {},
    "hpcddp-fp16": {"compression": "fp16"},
    "hpcddp-powersgd": {"compression": hpcddp.PowerSGD(start_powerSGD_iter=0)},
    "hpcddp-int8": {"compression": "int8"},
    "hpcddp-reproducible": {"reproducible": True},
}

#: steps between parameter averages of the local-sgd variant
LOCAL_SGD_PERIOD = 4


@dataclass
class TrainResult:
    """One variant: median step time over repeats (each a median over steps, slowest rank)."""

    variant: str
    step_ms: float
    runs_ms: list[float]
    samples_per_s: float
    overhead: float | None = None
    vs_ddp: float | None = None
    #: hpcddp only: the last step's backward and bucket timestamps, ms after backward start
    timeline: dict[str, Any] = field(default_factory=dict)


def horovod_available() -> bool:
    """Return True when ``horovod.torch`` imports."""
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Horovod build counts as absent
        return False
    return True


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _make_step(variant: str, workload: Workload, hpcddp_options: dict) -> tuple[Callable[[], None], Any]:
    """Return (one training step, the optimizer) of ``variant`` on a fresh copy of the model."""
    model = copy.deepcopy(workload.model)
    if variant == "local":
        optimizer = _optimizer(model)
        runner = model
    elif variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from ._torchdist import ensure_process_group

        ensure_process_group()
        device = next(model.parameters()).device
        runner = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        optimizer = _optimizer(runner)
    elif variant in ("ddp-hpcddp", "ddp-powersgd"):
        from torch.nn.parallel import DistributedDataParallel

        from ._torchdist import hpcddp_process_group

        group = hpcddp_process_group()
        runner = DistributedDataParallel(model, process_group=group)
        if variant == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=group, start_powerSGD_iter=2)
            runner.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        optimizer = _optimizer(runner)
    elif variant == "horovod":
        import horovod.torch as hvd

        hvd.init()
        optimizer = hvd.DistributedOptimizer(_optimizer(model), named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        runner = model
    elif variant in HPCDDP_VARIANTS:
        options = {**hpcddp_options, **HPCDDP_VARIANTS[variant]}
        if variant == "hpcddp-reproducible":  # it refuses compression: --compression is the bucketed variants'
            options.pop("compression", None)
        optimizer = hpcddp.DistributedOptimizer(_optimizer(model), model.named_parameters(), **options)
        runner = model
    elif variant == "local-sgd":
        from ..collectives.averaging import PeriodicModelAverager

        hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = _AveragingOptimizer(_optimizer(model), model, PeriodicModelAverager(LOCAL_SGD_PERIOD))
        runner = model
    else:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")

    on_gpu = workload.inputs.is_cuda

    def step():
        optimizer.zero_grad()
        workload.loss(runner).backward()
        optimizer.step()
        if on_gpu:  # the step is over when the GPU is done, not when Python returns
            torch.cuda.synchronize()

    return step, optimizer


class _AveragingOptimizer:
    """A local optimizer whose ``step`` also averages the parameters every ``period`` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, averager) -> None:
        self.optimizer, self.parameters, self.averager = optimizer, list(model.parameters()), averager

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()
        self.averager.average_parameters(self.parameters)


def _time_run(step: Callable[[], None], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return median(samples)


def _timeline(optimizer) -> dict[str, Any]:
    times = getattr(optimizer, "times", None)
    if times is None or not times.bucket_launch:
        return {}
    zero = times.backward_start

    def ms(t):
        return round((t - zero) * 1e3, 3)

    return {
        "backward_end_ms": ms(times.backward_end),
        "bucket_launch_ms": [ms(t) for t in times.bucket_launch],
        "bucket_done_ms": [ms(t) for t in times.bucket_done],
        "bucket_mb": [round(b.nbytes / 2**20, 3) for b in optimizer.buckets],
    }


def bench_train(
    workload: Workload,
    variants: Sequence[str] = VARIANTS,
    steps: int = 20,
    warmup: int = 5,
    repeats: int = 5,
    hpcddp_options: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[TrainResult]:
    """Time training steps of each variant, interleaved round by round; every rank must call this.

    Each round runs every variant once (``warmup`` untimed steps, then the median of
    ``steps`` timed ones), so load on a shared machine falls on all variants alike;
    the result per variant is the median over ``repeats`` rounds of the slowest rank.

    Args:
        workload: the model and batch (see ``build_workload``).
        variants: names from ``VARIANTS``; "horovod" is skipped when it does not import.
        steps: timed steps per round.
        warmup: untimed steps before them.
        repeats: rounds.
        hpcddp_options: keyword arguments for ``hpcddp.DistributedOptimizer``.
        progress: called with a line after each round (on every rank).
    """
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got {', '.join(unknown)}")
    chosen = [v for v in VARIANTS if v in variants and (v != "horovod" or horovod_available())]
    built = {v: _make_step(v, workload, hpcddp_options or {}) for v in chosen}
    runs: dict[str, list[float]] = {v: [] for v in chosen}
    for round_index in range(repeats):
        for variant in chosen:
            hpcddp.barrier()
            seconds = _time_run(built[variant][0], steps, warmup)
            runs[variant].append(max(hpcddp.allgather_object(seconds)) * 1e3)
        if progress is not None:
            progress(f"round {round_index + 1}/{repeats}: " + ", ".join(f"{v} {runs[v][-1]:.1f} ms" for v in chosen))
    global_batch = workload.batch_size * hpcddp.size()
    results = []
    for variant in chosen:
        step_ms = median(runs[variant])
        results.append(TrainResult(variant, step_ms, runs[variant], global_batch / (step_ms / 1e3)))
    by_name = {r.variant: r for r in results}
    for result in results:
        if "local" in by_name:
            result.overhead = (result.step_ms - by_name["local"].step_ms) / by_name["local"].step_ms
        if "ddp" in by_name:
            result.vs_ddp = result.step_ms / by_name["ddp"].step_ms
    if "hpcddp" in built:
        by_name["hpcddp"].timeline = _timeline(built["hpcddp"][1])
    for variant in HPCDDP_VARIANTS:
        if variant in built:
            built[variant][1].close()
    return results
