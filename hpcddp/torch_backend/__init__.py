"""torch.distributed on hpcddp's MPI communicator: the ``hpcddp`` process-group backend.

After ``hpcddp.init()`` under mpirun or ``srun --mpi=pmix``::

    import torch.distributed as dist
    dist.init_process_group("hpcddp")   # or "mpi": torch's wheels have no MPI, hpcddp serves it

and torch's own DistributedDataParallel, FSDP2, SyncBatchNorm, DistributedSampler and
torch.distributed.checkpoint run over MPI. Modules: ``group`` (the ProcessGroup: every
collective and message, and its Work), ``_messages`` (a message's Work), ``_futures`` (torch
futures of collectives), ``install`` (registration with torch). They check torch's arguments and name
them in messages; the transfers, the metadata check before each collective and the
op and dtype tables are the communicator's (``hpcddp.comm``: the one road to MPI).
"""

from ..comm.agreement import CollectiveMismatchError
from .group import ProcessGroupHPCDDP
from .install import BACKEND_NAME, install, mpi_routed, new_group_over

__all__ = ["BACKEND_NAME", "CollectiveMismatchError", "ProcessGroupHPCDDP", "install", "mpi_routed", "new_group_over"]
