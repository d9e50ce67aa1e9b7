"""Configuration of ``hpcddp.init``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..env.settings import BACKENDS, STALL_ACTIONS

__all__ = ["BACKENDS", "STALL_ACTIONS", "InitConfig"]


@dataclass(kw_only=True)
class InitConfig:
    """Everything ``hpcddp.init`` can be told; each field maps to one init argument."""

    backend: str = "auto"
    """"auto" (nccl with CUDA, else mpi), "mpi" (mpi4py), "nccl" or "gloo" (torch.distributed).
    Environment: HPCDDP_BACKEND (used when the script passes "auto")."""

    interface: str | None = None
    """Network interface (e.g. "ib0") whose address rank 0 publishes for torch.distributed's
    rendezvous and that gloo and NCCL use (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, unless
    set); None picks one every node shares a subnet with. Environment: HPCDDP_IFACE."""

    num_threads: int | None = None
    """torch intra-op threads for this rank; None derives them from the CPUs it may use."""

    allow_gpu_sharing: bool = False
    """Let more ranks than GPUs share a node's GPUs (or MIG slices) instead of failing. NCCL takes
    one rank per GPU, so backend "auto" then picks mpi (or gloo without an MPI launcher) and
    says so in one line. Environment: HPCDDP_GPU_SHARING (0 or 1)."""

    stall_timeout: float = 60.0
    """Seconds a collective may wait for the other ranks before the stall inspector
    warns which ranks are missing and what they are doing; 0 turns the inspector off.
    It runs whenever MPI connects the ranks (any backend). Environment: HPCDDP_STALL_TIMEOUT."""

    stall_abort_after: float = 1800.0
    """Seconds a stalled collective may wait before the job is ended; 0 never ends it for
    a rank that is only slow. Ranks the inspector cannot reach (process dead, node down
    or cut off) end the job as soon as they are found. Environment: HPCDDP_STALL_ABORT_AFTER."""

    stall_action: str = "abort"
    """"abort" ends the job as ``stall_abort_after`` says; "warn" never ends it, only
    reports. Environment: HPCDDP_STALL_ACTION."""

    dist_timeout: float = 1800.0
    """torch.distributed's own timeout on gloo and nccl (``init_process_group(timeout=)``):
    a collective that waits longer fails with the collective's name and this knob.
    Environment: HPCDDP_DIST_TIMEOUT."""

    hierarchical_allreduce: bool | str = False
    """Allreduce in two levels on backend mpi: reduce-scatter inside each node, allreduce
    between nodes, allgather inside the node (``hpcddp.comm.mpi.hierarchy``). Off by default:
    Open MPI 5's own allreduce already crossed each link with 1x the buffer on the virtual
    cluster (docs/BENCHMARKS.md), so it only helps where the MPI's is not node-aware.
    "auto": two levels when the ranks span several nodes and a node holds several of
    them (one node, or one rank per node, has no second level to save).
    Environment: HPCDDP_HIERARCHICAL_ALLREDUCE (1, 0 or auto)."""

    timeline: str | None = None
    """Write a Chrome-trace timeline of forward, backward, step and every bucket's
    reduction to this path (rank 0, at shutdown). Environment: HPCDDP_TIMELINE."""

    check_collectives: bool = True
    """Before each collective called through hpcddp's API, let the ranks compare shapes,
    dtypes, roots and ops (one small message) and raise CollectiveMismatchError on every
    rank when they differ, instead of aborting or returning garbage; hpcddp's own gradient
    buckets are compared once per step (the step, the optimizer, bucket 0's shape), not
    one by one. Environment: HPCDDP_CHECK_COLLECTIVES (0 turns it off)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {self.backend!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        for name, meaning in (
            ("stall_timeout", "0 turns the stall inspector off"),
            ("stall_abort_after", "0 never aborts a slow rank"),
            ("dist_timeout", "torch.distributed's timeout"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= 0 ({meaning}), got {value!r}")
        if self.dist_timeout == 0:
            raise ValueError("dist_timeout must be > 0 seconds, got 0: torch.distributed needs a timeout")
        if self.interface is not None and (not isinstance(self.interface, str) or not self.interface.strip()):
            raise ValueError(f"interface must be a network interface name such as 'eth0', got {self.interface!r}")
        if self.timeline is not None and (not isinstance(self.timeline, (str, os.PathLike)) or not str(self.timeline)):
            raise ValueError(f"timeline must be a file path, got {self.timeline!r}")
        if not isinstance(self.hierarchical_allreduce, bool) and self.hierarchical_allreduce != "auto":
            raise ValueError(
                f"hierarchical_allreduce must be True, False or 'auto', got {self.hierarchical_allreduce!r}"
            )
        if not isinstance(self.allow_gpu_sharing, bool):
            raise ValueError(f"allow_gpu_sharing must be True or False, got {self.allow_gpu_sharing!r}")
        if not isinstance(self.check_collectives, bool):
            raise ValueError(f"check_collectives must be True or False, got {self.check_collectives!r}")
        if self.stall_action not in STALL_ACTIONS:
            raise ValueError(f"stall_action must be 'abort' or 'warn', got {self.stall_action!r}")
