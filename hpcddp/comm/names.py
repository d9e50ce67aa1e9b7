"""The one naming of operations: how oplog entries, the agreement and error messages call each one.

A name stands for one way of moving data. hpcddp's API, the Horovod API and the torch
backend use the same name where they move data the same way, so that one API's call on
one rank and another's on the next match (``hpcddp.allreduce_`` here, ``dist.all_reduce``
there: one sum). Where the transfers differ, so do the names, and the agreement fails
cleanly instead of pairing unrelated messages. hpcddp's collectives learn the sizes of
what they receive; the ``_into`` forms (torch.distributed's) write into outputs that every
rank sized itself, so nothing is exchanged before the data.
"""

from __future__ import annotations

__all__ = ["COLLECTIVES", "ROWS_MAY_DIFFER"]

#: every collective an hpcddp communicator runs, and who calls it
COLLECTIVES = {
    "allreduce": "reduce every rank's tensor into every rank's (hpcddp, Horovod, gradient buckets, torch's all_reduce)",
    "broadcast": "copy root's tensor into every rank's (hpcddp, Horovod, torch's broadcast)",
    "reduce": "reduce every rank's tensor into root's (hpcddp, torch's reduce)",
    "allgather": "concatenate every rank's rows on every rank, row counts exchanged first (hpcddp, Horovod)",
    "gather": "concatenate every rank's rows on root, row counts gathered first (hpcddp)",
    "scatter": "send root's chunks to the ranks, their sizes first (hpcddp)",
    "reducescatter": "reduce, each rank keeping its rows of the result (hpcddp, Horovod)",
    "alltoall": "send rows to each rank, row counts exchanged first (hpcddp, Horovod)",
    "allgather_into": "every rank's tensor into every rank's output (torch's all_gather, all_gather_into_tensor)",
    "gather_into": "every rank's tensor into root's outputs (torch's gather)",
    "scatter_into": "root's chunks into every rank's output (torch's scatter)",
    "reducescatter_into": "reduce, each rank's block into its output (torch's reduce_scatter, reduce_scatter_tensor)",
    "alltoall_into": "parts to every rank into its outputs, sizes checked pairwise (torch's all_to_all, all_to_all_single)",
    "barrier": "wait for every rank (hpcddp, torch's barrier)",
    "broadcast_object": "root's picklable object to every rank",
    "allgather_object": "every rank's picklable object to every rank",
    "gather_object": "every rank's picklable object to root",
    "share_bytes": "root's bytes into one buffer per node, or per rank (checkpoint load)",
    "split": "make a communicator over some of the ranks",
    "duplicate": "make a communicator over the same ranks (an optimizer's gradient buckets: ``hpcddp.comm.mpi.gradient_channel``)",
    "join": "stand in for a rank that ran out of data (Horovod's join)",
}

#: collectives whose first dimension may differ between ranks: the agreement compares the rest of the shape
ROWS_MAY_DIFFER = frozenset({"allgather", "gather", "scatter", "alltoall", "alltoall_into"})
