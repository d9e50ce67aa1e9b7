"""Horovod's PyTorch API on hpcddp: ``import hpcddp.horovod as hvd`` in place of ``horovod.torch``.

Names, argument names and defaults follow Horovod 0.28's ``horovod.torch``; the work is
done by hpcddp (MPI on CPU, NCCL on GPU). Where it differs:

- handles from the ``*_async`` functions are objects, not ints; pass them to
  ``synchronize`` and ``poll`` as before;
- only the global process set exists; ``Adasum``, custom compressors and
  ``sparse_as_dense=True`` raise NotImplementedError or ValueError saying so;
- ``DistributedOptimizer`` fuses gradients into DDP-sized buckets (``num_groups`` and
  ``groups`` are accepted and ignored) and waits, instead of failing, when
  ``zero_grad()`` comes while a reduction is in flight;
- ``join`` shadows the gradient reductions of one live ``DistributedOptimizer``
  (joined ranks contribute zeros and the average divides by ``size()``, as in
  Horovod) and takes its optimizer steps too, so every rank ends with the same
  parameters; other collectives of the ranks still training are not shadowed:
  reduce metrics after ``join`` returns.
"""

from .basics import (
    Adasum,
    Average,
    Max,
    Min,
    Sum,
    cross_rank,
    cross_size,
    cuda_built,
    global_process_set,
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
from .ops import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    poll,
    synchronize,
)
from .optimizer import DistributedOptimizer, join

__all__ = [
    "Adasum", "Average", "BF16Compressor", "Compression", "Compressor", "DistributedOptimizer", "FP16Compressor",
    "Max", "Min", "NoneCompressor", "Sum", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "cross_rank",
    "cross_size", "cuda_built", "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized",
    "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll",
    "rank", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
