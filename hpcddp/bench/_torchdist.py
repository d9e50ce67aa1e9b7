"""torch.distributed beside hpcddp's own backend, as the reference the benchmarks compare with."""

from __future__ import annotations

import datetime
import os

import hpcddp

__all__ = ["ensure_process_group"]


def ensure_process_group():
    """Return ``torch.distributed`` with a default process group (gloo on CPU, nccl on GPU).

    Reuses the group hpcddp (or the caller) made; otherwise joins one at the
    MASTER_ADDR/MASTER_PORT that ``hpcddp.init()`` exported.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    backend = "nccl" if hpcddp.device().type == "cuda" else "gloo"
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (address and port):
        if hpcddp.size() > 1:
            raise RuntimeError(
                "MASTER_ADDR/MASTER_PORT are not set although hpcddp.init() ran with "
                f"{hpcddp.size()} ranks: launch with mpirun or srun, or set both variables"
            )
        # A world of one: hpcddp exported nothing, and nobody else needs to find us.
        from ..env.mpi import find_free_port

        address, port = "127.0.0.1", str(find_free_port())
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=hpcddp.rank(),
        world_size=hpcddp.size(),
        timeout=datetime.timedelta(minutes=10),
        **({"device_id": hpcddp.device()} if backend == "nccl" else {}),
    )
    return dist
