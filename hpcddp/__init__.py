"""hpcddp: data-parallel PyTorch training on HPC machines over MPI.

import hpcddp
hpcddp.init()
model.to(hpcddp.device())
optimizer = hpcddp.DistributedOptimizer(optimizer, model.named_parameters())
hpcddp.broadcast_parameters(model.state_dict(), root_rank=0)
"""

import sys as _sys

from . import _requirements  # noqa: F401 - first: an old torch fails here, naming the fix
from .checkpoint import TrainingProgress, load_checkpoint, restore_training_state, save_checkpoint, training_state
from .collectives.async_averaging import AsyncModelAverager
from .collectives.averaging import PeriodicModelAverager
from .collectives.parameters import broadcast_optimizer_state, broadcast_parameters
from .collectives.tensors import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    reducescatter,
    reducescatter_async,
)
from .comm.agreement import CollectiveMismatchError
from .comm.base import Handle, ReduceOp
from .ddp.compression import Int8, PowerSGD
from .ddp.join import join
from .ddp.optimizer import DistributedOptimizer
from .ddp.reducer import StepStoppedError
from .fault.abort import mark_configuration_error as _mark_configuration_error
from .fault.preemption import PreemptionHandler
from .observe import timeline as timeline  # hpcddp.timeline.start(path) / stop(): part of a run
from .observe.stragglers import straggler_report
from .reproducible.sampler import MicroBatch, MicroBatchSampler
from .runtime.config import InitConfig
from .runtime.lifecycle import init
from .runtime.state import (
    backend,
    communicator,
    device,
    is_initialized,
    local_rank,
    local_size,
    node_rank,
    num_nodes,
    rank,
    shutdown,
    size,
)
from .torch_backend.autoinit import enable as _complete_init_process_group

# init_process_group("mpi") calls hpcddp.init() when the script did not; env:// finds its variables.
_complete_init_process_group(init, _mark_configuration_error)

# ``import hpcddp.timeline`` / ``from hpcddp.timeline import start`` keep working: the
# module lives in observe/, and the import system looks in sys.modules first.
_sys.modules[f"{__name__}.timeline"] = timeline

__version__ = "0.1.0"

__all__ = [
    "AsyncModelAverager",
    "CollectiveMismatchError",
    "DistributedOptimizer",
    "Handle",
    "InitConfig",
    "Int8",
    "MicroBatch",
    "MicroBatchSampler",
    "PeriodicModelAverager",
    "PowerSGD",
    "PreemptionHandler",
    "ReduceOp",
    "StepStoppedError",
    "TrainingProgress",
    "__version__",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "communicator",
    "device",
    "init",
    "is_initialized",
    "join",
    "load_checkpoint",
    "local_rank",
    "local_size",
    "node_rank",
    "num_nodes",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "restore_training_state",
    "save_checkpoint",
    "shutdown",
    "size",
    "straggler_report",
    "training_state",
]
