"""Configuration of ``hpcddp.init``."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["BACKENDS", "STALL_ACTIONS", "InitConfig"]

BACKENDS = ("auto", "mpi", "nccl", "gloo")
STALL_ACTIONS = ("abort", "warn")


@dataclass(kw_only=True)
class InitConfig:
    """Everything ``hpcddp.init`` can be told; each field maps to one init argument."""

    backend: str = "auto"
    """"auto" (nccl with CUDA, else mpi), "mpi" (mpi4py), "nccl" or "gloo" (torch.distributed)."""

    num_threads: int | None = None
    """torch intra-op threads for this rank; None derives them from the CPUs it may use."""

    allow_gpu_sharing: bool = False
    """Let more ranks than GPUs share a node's GPUs instead of failing."""

    stall_timeout: float = 60.0
    """Seconds a collective may wait for the other ranks before the stall inspector
    reports which ranks are missing and why (mpi backend); 0 turns it off. On gloo
    and nccl it is torch.distributed's timeout (30 min when 0): the waiting
    collective fails without the report. Environment: HPCDDP_STALL_TIMEOUT."""

    stall_action: str = "abort"
    """What follows a stall report: "abort" ends the job, "warn" keeps waiting.
    Environment: HPCDDP_STALL_ACTION."""

    timeline: str | None = None
    """Write a Chrome-trace timeline of forward, backward, step and every bucket's
    reduction to this path (rank 0, at shutdown). Environment: HPCDDP_TIMELINE."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {self.backend!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        timeout = self.stall_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
            raise ValueError(f"stall_timeout must be a number of seconds >= 0 (0 turns it off), got {timeout!r}")
        if self.timeline is not None and (not isinstance(self.timeline, (str, os.PathLike)) or not str(self.timeline)):
            raise ValueError(f"timeline must be a file path, got {self.timeline!r}")
        if self.stall_action not in STALL_ACTIONS:
            raise ValueError(f"stall_action must be 'abort' or 'warn', got {self.stall_action!r}")
