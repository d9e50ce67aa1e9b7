"""Horovod's PyTorch API on hpcddp: ``import hpcddp.horovod as hvd`` in place of ``horovod.torch``.

Names, argument names and defaults follow Horovod 0.28's ``horovod.torch``; the work is
done by hpcddp (MPI on CPU, NCCL on GPU). As in Horovod, each collective's metadata is
compared across the ranks first: mismatched shapes, dtypes, roots or splits raise
RuntimeError (hpcddp.CollectiveMismatchError) on every rank and the job goes on, and a
second operation under a name still in flight raises ValueError. Where it differs:

- handles from the ``*_async`` functions are objects, not ints; pass them to
  ``synchronize`` and ``poll`` as before;
- collectives run in the order each rank calls them (Horovod matches them by name):
  every rank must call them in the same order;
- custom compressors in ``DistributedOptimizer`` raise ValueError saying so;
- ``Adasum`` gathers every rank's tensor (``size()`` times its traffic) and reduces over
  all ranks on every device, where Horovod built with NCCL sums GPU tensors within a node
  first; ``DistributedOptimizer(op=Adasum)`` steps and reduces in ``step()``, not during
  backward;
- ``DistributedOptimizer`` fuses gradients into DDP-sized buckets (``num_groups`` and
  ``groups`` are accepted and ignored) and waits, instead of failing, when
  ``zero_grad()`` comes while a reduction is in flight;
- ``join`` with a live ``DistributedOptimizer`` shadows its gradient reductions and takes
  its optimizer steps too; without one (mpi backend) a joined rank adds zeros to the
  others' allreduces, and their other collectives raise, as in Horovod.
"""

from . import elastic  # hvd.elastic, as in horovod.torch
from .basics import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .compression import BF16Compressor, Compression, Compressor, FP16Compressor, NoneCompressor
from .functions import allgather_object, barrier, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from .optimizer import DistributedOptimizer, join
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm
from .vector_ops import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)

__all__ = [
    "Adasum", "Average", "BF16Compressor", "Compression", "Compressor", "DistributedOptimizer", "FP16Compressor",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "NoneCompressor", "Product", "ProcessSet", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "elastic", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]  # fmt: skip
