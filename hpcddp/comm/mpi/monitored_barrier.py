"""A monitored barrier over a communicator's point-to-point messages, as gloo's ``monitoredBarrier``.

Every rank but 0 sends rank 0 a check-in and waits for its answer. Rank 0 waits for
the check-ins until ``timeout`` and names the ranks that did not come (the first one,
or with ``wait_all_ranks`` all of them), then answers the ranks whose check-in came:
"passed" when all came, "failed" otherwise, so that they raise at once instead of
waiting out their own timeout. A rank other than 0 waits for its answer as long as its
group's timeout (gloo waits as long), because rank 0 may start late.

The messages are hpcddp's own (``hpcddp.comm.mpi.p2p``), outside the collectives' queue, on
a tag from ``PointToPoint.reserved_tag`` that no user message can carry. Ranks do not
number their calls alike (a rank that skipped a failed barrier would be a call behind
for good, as gloo's per-rank tags leave it): each check-in carries its rank's own call
number and each answer echoes it. A rank's check-ins reach rank 0 in order, so each is
taken by the next call of rank 0 that waits for one; a rank ignores an answer that
echoes an earlier call of its own (one it stopped waiting for). When the barrier fails,
the receives still waiting are cancelled (``Message.withdraw``): they can never take a
user's message or a later barrier's, and rank 0 sends each of those ranks a notice that
it gave up on it. A rank that finds the notice while it waits for its answer waits only
``timeout`` more, then raises: a rank that came late raises soon after it comes (gloo's
raises at once, rank 0 having closed its connection), where it used to wait as long as
the group's timeout; a rank that skipped the failed barrier still passes the next one,
if rank 0 calls it in time. A send cannot be withdrawn in MPI, so the late check-in stays
and is taken by rank 0's next monitored barrier: rank 0's next call does not wait for
that rank.

The messages name ranks of the communicator (the group's ranks), as gloo's do.
"""

from __future__ import annotations

import itertools
import time

import torch

from .p2p import Message, PointToPoint

__all__ = ["MonitoredBarrier"]

_PASSED, _FAILED, _GAVE_UP = 0, 1, 2  # _GAVE_UP: rank 0's notice to a rank it stopped waiting for
_TAG_NUMBER = 0  # the reserved tag of monitored barriers (check-ins and answers go opposite ways)


class MonitoredBarrier:
    """The monitored barriers of one communicator.

    Args:
        p2p: the communicator's point-to-point layer.
    """

    def __init__(self, p2p: PointToPoint) -> None:
        self._p2p = p2p
        self._tag = p2p.reserved_tag(_TAG_NUMBER)
        self._calls = itertools.count()

    def wait(self, timeout: float, peer_timeout: float | None, wait_all_ranks: bool = False) -> None:
        """Block until every rank of the communicator reaches this call; raise RuntimeError naming those that did not.

        Args:
            timeout: seconds rank 0 waits for the others' check-ins.
            peer_timeout: seconds another rank waits for rank 0's answer (None: as long as it takes).
            wait_all_ranks: rank 0 names every rank that did not come, not only the first.
        """
        call = next(self._calls)
        if self._p2p.comm.Get_size() == 1:
            return
        if self._p2p.rank == 0:
            self._collect(timeout, wait_all_ranks)
        else:
            self._check_in(call, timeout, peer_timeout)

    def _check_in(self, call: int, timeout: float, peer_timeout: float | None) -> None:
        rank, p2p = self._p2p.rank, self._p2p
        sent = p2p.send(torch.tensor([call]), 0, self._tag, reserved=True)
        deadline = None if peer_timeout is None else time.monotonic() + peer_timeout
        problem = f"no answer from rank 0 within {peer_timeout:g} s, the group's timeout"
        answer = torch.empty(2, dtype=torch.int64)  # verdict, the call it answers
        while True:
            received = p2p.recv(answer, 0, self._tag, reserved=True)
            if not received._block(None if deadline is None else max(0.0, deadline - time.monotonic())):
                received.withdraw()
                break
            verdict, answered = received.wait().tolist()
            if verdict == _GAVE_UP:
                # This rank came after rank 0 gave up on it (or skipped that barrier): rank 0 answers
                # only if it calls again within timeout (gloo's late rank raises at once, its pair closed).
                late = time.monotonic() + timeout
                deadline = late if deadline is None else min(deadline, late)
                problem = (
                    f"rank 0 had given up on this rank in an earlier monitored barrier (it came later than "
                    f"timeout=) and did not answer within {timeout:g} s"
                )
                continue
            if answered == call:
                problem = None if verdict == _PASSED else "rank 0 reported that some rank did not come"
                break
        if problem is None:
            sent.wait()
            return
        sent.withdraw()
        raise RuntimeError(
            f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
            f"from rank 0 ({problem}). Please check rank 0 logs for faulty rank."
        )

    def _collect(self, timeout: float, wait_all_ranks: bool) -> None:
        start, size = time.monotonic(), self._p2p.comm.Get_size()
        check_ins = {
            r: self._p2p.recv(torch.empty(1, dtype=torch.int64), r, self._tag, reserved=True) for r in range(1, size)
        }
        try:
            missing = _missing(check_ins, start, timeout, wait_all_ranks)
        except RuntimeError:
            self._answer(_FAILED, check_ins)
            raise
        if missing:
            self._answer(_FAILED, check_ins)
            raise RuntimeError(
                f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in "
                f"{int(timeout * 1000)} ms: find why they did not call it (hung, exited, or later than timeout=)"
            )
        self._answer(_PASSED, check_ins)

    def _answer(self, verdict: int, check_ins: dict[int, Message]) -> None:
        """Answer every rank whose check-in came; withdraw the other check-ins and tell those ranks (on failure)."""
        came = {r: m for r, m in check_ins.items() if not m.withdraw()}
        answers = []
        for rank, message in came.items():
            echo = int(message.wait())
            answers.append(self._p2p.send(torch.tensor([verdict, echo]), rank, self._tag, reserved=True))
        for answer in answers:  # 16 bytes to a rank that waits for them: MPI sends them at once
            answer.wait()
        for rank in check_ins.keys() - came.keys():
            # Nobody may ever take it (a rank that skipped the barrier, or exited): rank 0 does not wait.
            self._p2p.send(torch.tensor([_GAVE_UP, -1]), rank, self._tag, reserved=True).withdraw()


def _missing(check_ins: dict[int, Message], start: float, timeout: float, wait_all_ranks: bool) -> list[int]:
    """The ranks whose check-in did not come by ``start + timeout`` (all, or raise at the first as gloo does)."""
    ms = int(timeout * 1000)
    deadline = start + timeout
    came: list[int] = []
    missing: list[int] = []
    for rank, message in check_ins.items():
        remaining = deadline - time.monotonic()
        if message.poll() or message._block(max(remaining, 0.0)):
            came.append(rank)
            continue
        if wait_all_ranks:
            missing.append(rank)
        elif remaining <= 0:  # gloo's check before each wait: no time was left to wait for this rank at all
            processed = f"successfully processed ranks: {', '.join(map(str, came))}" if came else "no ranks passed"
            raise RuntimeError(
                f"Rank 0 timed out in monitoredBarrier after {ms} ms ({processed}): "
                "pass a timeout= that leaves the other ranks time to arrive"
            )
        else:
            raise RuntimeError(
                f"[Rank 0]: Rank {rank} failed to pass monitoredBarrier in {ms} ms: find why it did not call it "
                "(hung, exited, or later than timeout=)"
            )
    return missing
