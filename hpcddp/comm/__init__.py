"""Collectives behind one interface: mpi (mpi4py), torchdist (nccl/gloo), local (one process).

The one road to MPI is the package ``mpi`` (``mpi.engine`` states its rules): ``MPICommunicator``
plans every collective on an MPI communicator and its Engine runs them, for hpcddp's API, the
Horovod API and the torch backend alike; everything only MPI uses lives in that package.
Here are what every backend shares: the interface (``base``), what the ranks compare before a
collective (``agreement``), the operation log (``oplog``) and the tables: ``reduction``
(hpcddp's, torch's and MPI's reduction ops), ``dtypes`` (torch, numpy and MPI types) and
``names`` (what operations are called).
"""

from .base import Communicator, Handle, ReduceOp, parse_op

__all__ = ["Communicator", "Handle", "ReduceOp", "parse_op"]
