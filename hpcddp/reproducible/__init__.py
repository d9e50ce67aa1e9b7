"""Bit-identical training at any world size: exact gradient sums, micro-batches from one global order.

- ``optimizer``: ``ReproducibleOptimizer``, what ``hpcddp.DistributedOptimizer(..., reproducible=True)`` makes;
- ``gradients``: each backward pass's gradients into exact sums, and their mean over all ranks at the step;
- ``fixed_point``: the exact, order-independent sum of float tensors (integer digits);
- ``sampler``: ``MicroBatchSampler``, each rank's micro-batches of a step, each seeded by its global index.
"""

from . import optimizer as _optimizer  # noqa: F401 - makes DistributedOptimizer(reproducible=True) this
from .sampler import MicroBatch, MicroBatchSampler

__all__ = ["MicroBatch", "MicroBatchSampler"]
