"""What the benchmarks ran on, recorded beside their numbers."""

from __future__ import annotations

import os
import platform
import socket

import torch

__all__ = ["describe_machine"]


def describe_machine() -> dict[str, object]:
    """Return host, CPU model, CPU counts (host, this rank) and the torch/mpi4py/MPI versions as a dict."""
    info: dict[str, object] = {
        "host": socket.gethostname(),
        "nproc": os.cpu_count(),
        # mpirun binds each rank to a core by default at up to 2 ranks: its thread
        # and hpcddp's communication thread then share that one core.
        "cpus_of_rank": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import mpi4py
        from mpi4py import MPI

        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    except ImportError:
        info["mpi4py"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
