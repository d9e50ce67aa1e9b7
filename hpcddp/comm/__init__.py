"""Collectives behind one interface: mpi (mpi4py), torchdist (nccl/gloo), local (one process)."""

from .base import Communicator, Handle, ReduceOp, parse_op

__all__ = ["Communicator", "Handle", "ReduceOp", "parse_op"]
