"""Rank 0's work in the stall inspector for p ranks, simulated in one process (``hpcddp bench inspector``).

Every synthetic rank has the history a training job leaves (``HISTORY`` finished
bucket allreduces on one communicator over the whole job) and waits in the next one,
except one late rank, the last, which is still computing: the verdict is "slow" and
the report names that rank. Each rank's reply is pickled as the inspector sends it
(mpi4py pickles with the highest protocol) and unpickled as rank 0 receives it; then
rank 0 judges (``verdict.judge``) and reports (``report.explain_stall``).
"""

from __future__ import annotations

import pickle
import secrets
import time
import tracemalloc
from typing import NamedTuple

from ..comm import oplog

__all__ = ["HISTORY", "InspectorResult", "bench_inspector", "synthetic_replies"]

#: finished operations each synthetic rank has run before the stall (its log keeps the last 32)
HISTORY = 40
#: ranks per node, to name nodes in reports
RANKS_PER_NODE = 8


class InspectorResult(NamedTuple):
    """One size: rank 0's seconds to judge and report, the bytes one rank sends, rank 0's memory."""

    ranks: int
    verdict_s: float
    reply_bytes: int
    rank0_mib: float
    receive_s: float
    received_mib: float
    verdict: str
    report_lines: int


def _group_key(num_ranks: int, group: str) -> tuple[str, tuple[int, ...]]:
    """The communicator key and members the job's world communicator would have."""
    if group == "mpi":
        return secrets.token_hex(6), tuple(range(num_ranks))
    import torch

    from ..comm.torchdist import TorchDistCommunicator

    # The torch backend's default group (its key built by the communicator itself); made
    # with join= so that no process group is needed.
    comm = TorchDistCommunicator("gloo", torch.device("cpu"), rank=0, size=num_ranks, join=lambda: None)
    oplog.unregister(comm.log)
    return comm.log.key, comm.log.members


def _reply(rank: int) -> dict:
    """What a rank sends rank 0 (``StallInspector``'s reply where it has one, else its status)."""
    from ..fault.stall import inspector

    reply = getattr(inspector, "reply_status", None)
    return reply(rank) if reply is not None else oplog.rank_status(rank)


def synthetic_replies(num_ranks: int, group: str = "mpi") -> list[bytes]:
    """Return every rank's pickled reply but rank 0's: all wait in one allreduce but the last, which is late.

    Args:
        num_ranks: ranks in the job.
        group: "mpi" (hpcddp's MPI communicator) or "torch" (the torch backend's default group).
    """
    key, members = _group_key(num_ranks, group)
    late = num_ranks - 1
    replies = []
    for rank in range(num_ranks):
        log = oplog.OperationLog(key, members)
        oplog.register(log)
        try:
            for step in range(HISTORY + 1):
                pending = oplog.describe(
                    "allreduce", (1 << 20,), "float32", label=f"bucket 0 of step {step}", step=step
                )
                if step < HISTORY:
                    log.finish(log.start(pending))
                elif rank != late:
                    log.start(pending, blocking=True)
            reply = _reply(rank)
        finally:
            oplog.unregister(log)
        replies.append(pickle.dumps((secrets.token_hex(8), (1, reply)), protocol=pickle.HIGHEST_PROTOCOL))
    return replies


def _receive(replies: list[bytes]) -> dict:
    statuses = {}
    for data in replies:
        _token, (_episode, status) = pickle.loads(data)
        statuses[status["rank"]] = status
    return statuses


def _judge(statuses: dict, num_ranks: int, hosts: list[str]) -> tuple[str, str]:
    from ..fault.stall.report import explain_stall
    from ..fault.stall.verdict import judge

    verdict = judge(statuses, {}, set())
    return verdict, explain_stall(statuses, {}, num_ranks, 60.0, hosts, set())


def bench_inspector(num_ranks: int, group: str = "mpi") -> InspectorResult:
    """Simulate rank 0 judging a stall among ``num_ranks`` ranks, one late; time it and weigh it.

    Args:
        num_ranks: ranks in the job (at least 2).
        group: "mpi" or "torch": which communicator's key the ranks wait on.
    """
    if num_ranks < 2:
        raise ValueError(f"--ranks must be >= 2, got {num_ranks}")
    replies = synthetic_replies(num_ranks, group)
    hosts = [f"node{r // RANKS_PER_NODE}" for r in range(num_ranks)]
    # Timed without tracemalloc (it slows allocation several times), weighed in a second pass.
    started = time.perf_counter()
    statuses = _receive(replies)
    received = time.perf_counter()
    verdict, report = _judge(statuses, num_ranks, hosts)
    judged = time.perf_counter()
    del statuses
    tracemalloc.start()
    statuses = _receive(replies)
    _judge(statuses, num_ranks, hosts)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return InspectorResult(
        ranks=num_ranks,
        verdict_s=judged - received,
        reply_bytes=max(len(data) for data in replies[1:]),
        rank0_mib=peak / 2**20,
        receive_s=received - started,
        received_mib=sum(len(data) for data in replies[1:]) / 2**20,
        verdict=verdict,
        report_lines=report.count("\n") + 1,
    )
