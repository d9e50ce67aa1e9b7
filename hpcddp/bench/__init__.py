"""Benchmarks behind ``hpcddp bench``: allreduce sweeps, training-step timings, straggler tolerance.

from hpcddp.bench import build_workload, bench_train, sweep_allreduce, bench_straggler
"""

from .allreduce import PATHS, AllreduceResult, sweep_allreduce
from .machine import describe_machine
from .metrics import algbw, busbw, format_size, parse_size, size_sweep
from .models import MODELS, build_workload
from .straggler import StragglerConfig, StragglerRun, bench_straggler
from .train import VARIANTS, TrainResult, bench_train

__all__ = [
    "MODELS",
    "PATHS",
    "VARIANTS",
    "AllreduceResult",
    "StragglerConfig",
    "StragglerRun",
    "TrainResult",
    "algbw",
    "bench_straggler",
    "bench_train",
    "build_workload",
    "busbw",
    "describe_machine",
    "format_size",
    "parse_size",
    "size_sweep",
    "sweep_allreduce",
]
