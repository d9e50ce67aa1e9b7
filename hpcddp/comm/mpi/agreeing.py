"""The agreement every collective starts with (rule 4 of ``hpcddp.comm.mpi.engine``) and the timeout measured there (rule 9).

The agreement is where a rank waits for late ranks before any data moves, so a
group's timeout is measured there: with ``timeout`` set it runs even when checks are
off, and when the other ranks do not join in time it raises "Timed out" and marks the
communicator failed. MPI cannot cancel the agreement's collective request, so the ranks
are out of step from then on: the engine refuses every later operation with the same
error (``failure``) instead of pairing it with another rank's wrong one.
"""

from __future__ import annotations

import time

import numpy as np

from ..agreement import CollectiveCall, agreement_vector, continues_while_joined, mismatch_error, some_joined
from .waits import Receives, abandon, describe_members, timed_out, wait_for_request

__all__ = ["Agreement"]


class Agreement:
    """The agreement of one communicator's collectives; its methods run on the engine's runner.

    Args:
        comm: the mpi4py communicator.
        MPI: the mpi4py ``MPI`` module.
        members: the communicator's ranks as ranks of the whole job (for messages).
        messages: the point-to-point layer, whose receives in flight a wait moves on (engine rule 6).
    """

    def __init__(self, comm, MPI, members, messages: Receives | None = None) -> None:
        self.comm, self._MPI, self._messages = comm, MPI, messages
        self._MIN = MPI.MIN
        self.size = comm.Get_size()
        #: run the agreement before each collective (rule 4)
        self.check_collectives = True
        #: seconds an agreement may wait for the other ranks (rule 9); None: as long as it takes
        self.timeout: float | None = None
        #: how errors name this communicator's group
        self.label = f"the group of {describe_members(members)}"
        #: the error of the agreement that timed out, once one did
        self.failure: RuntimeError | None = None
        self._reduced = np.empty(5, dtype=np.int64)
        self._confirmation, self._confirmed = np.zeros(1, dtype=np.int64), np.empty(1, dtype=np.int64)
        self._vectors: dict[CollectiveCall, np.ndarray] = {}  # a training loop agrees on the same few again and again

    @property
    def runs(self) -> bool:
        """Whether collectives agree first: checks are on, or the timeout is measured here."""
        return self.check_collectives or self.timeout is not None

    def exchange(self, vector: np.ndarray, op: str = "join") -> np.ndarray:
        """MIN-reduce this rank's agreement ``vector`` over all ranks (the one primitive); "Timed out" past ``timeout``.

        With a timeout the ranks then confirm, in a second small allreduce, that they all
        got the result: a rank that gave up has left its request behind, and a late rank
        completes its exchange against it, so without the confirmation the late rank
        would go on into the data, which the other rank never sends, and wait for good.
        It now waits for a confirmation that never comes and times out too.

        Args:
            vector: this rank's vector.
            op: the collective it is for (for the timeout's message).
        """
        if self.timeout is None:
            wait_for_request(self.comm.Iallreduce(vector, self._reduced, op=self._MIN), self._messages)
            return self._reduced
        self._within_timeout(vector, self._reduced, op)
        self._within_timeout(self._confirmation, self._confirmed, op)
        return self._reduced

    def _within_timeout(self, vector: np.ndarray, reduced: np.ndarray, op: str) -> None:
        """MIN-reduce ``vector`` into ``reduced`` within the timeout (set); on timeout fail the communicator for good (rule 9) and raise."""
        request = self.comm.Iallreduce(vector, reduced, op=self._MIN)
        deadline = time.monotonic() + self.timeout
        if not wait_for_request(request, self._messages, deadline):
            self.failure = timed_out(op, self.label, self.timeout)
            abandon(request, vector, reduced)
            self._reduced = np.empty(5, dtype=np.int64)  # the abandoned request may still write the old one
            raise self.failure

    def agree(self, call: CollectiveCall) -> None:
        """Check that every rank describes its next collective as ``call``.

        Raises CollectiveMismatchError (CollectiveArgumentError for a rank's bad
        arguments) on every rank alike when they differ. Ranks that joined (Horovod's
        join) let sum and average allreduces of the others go on.
        """
        if not self.runs:
            return  # switched off after the collective was planned
        if self.size == 1:
            if call.error is not None:
                raise mismatch_error([call])
            return
        vector = self._vectors.get(call)
        if vector is None:
            if len(self._vectors) > 4096:
                self._vectors.clear()
            vector = self._vectors[call] = np.array(agreement_vector(call), dtype=np.int64)
        reduced = self.exchange(vector, call.op)
        low, minus_high, minus_error, _, minus_joined = reduced.tolist()
        if low != -minus_high or minus_error or minus_joined:
            calls = self.comm.allgather(call)
            if not (some_joined(reduced) and continues_while_joined(calls)):
                raise mismatch_error(calls)
