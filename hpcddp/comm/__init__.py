"""Collectives behind one interface: mpi (mpi4py), torchdist (nccl/gloo), local (one process).

The one road to MPI is here (``engine`` states its rules): ``mpi`` plans every collective on an
MPI communicator and its Engine runs them, for hpcddp's API, the Horovod API and the torch
backend alike. The tables every backend shares: ``reduction`` (hpcddp's, torch's and MPI's
reduction ops), ``dtypes`` (torch, numpy and MPI types) and ``names`` (what operations are called).
"""

from .base import Communicator, Handle, ReduceOp, parse_op

__all__ = ["Communicator", "Handle", "ReduceOp", "parse_op"]
