"""Configuration of ``hpcddp.init``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BACKENDS", "InitConfig"]

BACKENDS = ("auto", "mpi", "nccl", "gloo")


@dataclass(kw_only=True)
class InitConfig:
    """Everything ``hpcddp.init`` can be told; each field maps to one init argument."""

    backend: str = "auto"
    """"auto" (nccl with CUDA, else mpi), "mpi" (mpi4py), "nccl" or "gloo" (torch.distributed)."""

    num_threads: int | None = None
    """torch intra-op threads for this rank; None derives them from the CPUs it may use."""

    allow_gpu_sharing: bool = False
    """Let more ranks than GPUs share a node's GPUs instead of failing."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {self.backend!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
