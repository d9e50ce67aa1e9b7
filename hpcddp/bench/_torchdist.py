"""torch.distributed beside hpcddp's own backend, as the reference the benchmarks compare with."""

from __future__ import annotations

import hpcddp

__all__ = ["ensure_process_group", "hpcddp_process_group"]


def ensure_process_group():
    """Return ``torch.distributed`` with a default process group (gloo on CPU, nccl on GPU).

    Reuses the group hpcddp (or the caller) made; otherwise joins one at the
    MASTER_ADDR/MASTER_PORT that ``hpcddp.init()`` exported.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    from ..comm.rendezvous import join_process_group

    backend = "nccl" if hpcddp.device().type == "cuda" else "gloo"
    from ..runtime.state import launcher_comm

    join_process_group(
        backend, hpcddp.rank(), hpcddp.size(), timeout_s=600, device=hpcddp.device(), mpi_comm=launcher_comm()
    )
    return dist


def hpcddp_process_group():
    """Return a torch.distributed group over every rank on the ``hpcddp`` backend (hpcddp's MPI communicator)."""
    dist = ensure_process_group()
    if dist.get_backend() == "hpcddp":
        return dist.group.WORLD
    return dist.new_group(backend="hpcddp")
