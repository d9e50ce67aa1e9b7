"""Judge a stall from every rank's status: lost, exited, deadlocked, or only slow.

Pure functions over the dicts of ``oplog.rank_status`` (one per rank, None for a rank
that did not answer) and the exits ranks announced. The rule that keeps a healthy job
alive: an abort needs certainty.

- **lost**: a rank did not answer the inspector, did not say it was leaving, and is
  not busy: a rank on its node does not see its process use the CPU (``liveness``).
  A busy rank holds the GIL in a long C call; it is alive, and only slow.
- **exited**: a rank left (``sys.exit``, the end of its script, ``hpcddp.shutdown()``)
  before starting an operation that another rank is running on a communicator they
  share: that operation can never complete.
- **deadlock**: every rank blocks in hpcddp, each in operations that cannot complete
  (a member of the communicator has not started it, or a message has no partner), and
  the inspector saw exactly this state twice (``stable``): since every change on a rank
  bumps its progress counter, two equal snapshots taken one after the other show one
  instant at which all ranks were stuck at once. A rank whose threads outside hpcddp
  used more than half a core together between the two snapshots is not stuck,
  whatever its waiting threads say: they compute, and may yet send what a peer waits
  for. Threads inside hpcddp do not count (MPI may busy-poll while they wait). A transfer that is merely slow (all
  members inside the same operation) is completable and never a deadlock.
- **slow**: anything else (a rank computing, busy or not, a long transfer): warned
  about, aborted only after ``stall_abort_after``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Exit", "Stuck", "judge", "longest_wait", "stable", "stuck_operations"]


class Exit(NamedTuple):
    """A rank that left: how, its exit code if known, and how far it got on each communicator."""

    how: str
    code: int | None
    started: dict


class Stuck(NamedTuple):
    """An operation that can never complete because a member left before starting it."""

    rank: int
    key: str
    desc: object
    exited: int


def _started(statuses: dict, exits: dict, rank: int, key: str) -> int:
    if rank in exits:
        return exits[rank].started.get(key, 0)
    status = statuses.get(rank)
    if status is None:
        return 0
    comm = status["comms"].get(key)
    return 0 if comm is None else comm["started"]


def _running_at(statuses: dict, rank: int, key: str, seq: int):
    status = statuses.get(rank)
    comm = None if status is None else status["comms"].get(key)
    if comm is None:
        return None
    return next((desc for desc, _ in comm["running"] if desc.seq == seq), None)


def _collective_completable(statuses: dict, exits: dict, key: str, desc, members) -> bool:
    for member in members:
        if _started(statuses, exits, member, key) < desc.seq:
            return False
        there = _running_at(statuses, member, key, desc.seq)
        if there is not None and there.match_key() != desc.match_key() and not _joins(there, desc):
            return False
    return True


def _joins(a, b) -> bool:
    # A joined rank shadows the others' allreduces (hpcddp.comm.agreement.continues_while_joined):
    # "join" beside "allreduce" is a pair that completes, however long the allreduce takes.
    return {a.op, b.op} == {"join", "allreduce"}


def _pending(statuses: dict, rank: int):
    status = statuses.get(rank)
    if status is None:
        return
    for comm in status["comms"].values():
        for kind, peer, tag, _age in comm["p2p"]:
            yield kind, peer, tag


def _message_completable(statuses: dict, rank: int, kind: str, peer: int | None, tag: int) -> bool:
    wanted = "send" if kind == "recv" else "recv"
    peers = [peer] if peer is not None else [r for r in statuses if r != rank]
    for other in peers:
        for their_kind, their_peer, their_tag, *_ in _pending(statuses, other):
            if their_kind == wanted and their_peer in (rank, None) and their_tag == tag:
                return True
    return False


def stuck_operations(statuses: dict, exits: dict) -> list[Stuck]:
    """Return the running operations that a rank which exited will never join."""
    stuck = []
    for rank, status in statuses.items():
        if status is None or rank in exits:
            continue
        for key, comm in status["comms"].items():
            for desc, _age in comm["running"]:
                for member in comm["members"]:
                    if member in exits and exits[member].started.get(key, 0) < desc.seq:
                        stuck.append(Stuck(rank, key, desc, member))
                        break
    return stuck


def _rank_is_stuck(statuses: dict, exits: dict, rank: int) -> bool:
    status = statuses[rank]
    if not status["waits"]:
        return False
    blocking = 0
    for key, comm in status["comms"].items():
        for desc, _age in comm["running"]:
            blocking += 1
            if _collective_completable(statuses, exits, key, desc, comm["members"]):
                return False
        for kind, peer, tag, _age in comm["p2p"]:
            blocking += 1
            if _message_completable(statuses, rank, kind, peer, tag):
                return False
    return blocking > 0


def judge(statuses: dict, exits: dict, busy=frozenset()) -> str:
    """Return "lost", "exited", "deadlock" (if ``stable``) or "slow" for one snapshot.

    Args:
        statuses: every rank that has not exited: its ``rank_status``, or None when it
            did not answer.
        exits: ``Exit`` of every rank that said it was leaving.
        busy: the ranks that did not answer but use the CPU (``liveness``).
    """
    if any(status is None for rank, status in statuses.items() if rank not in exits and rank not in busy):
        return "lost"
    if stuck_operations(statuses, exits):
        return "exited"
    if busy:
        return "slow"  # a busy rank may yet join what the others wait in
    alive = [rank for rank in statuses if rank not in exits]
    if alive and all(_rank_is_stuck(statuses, exits, rank) for rank in alive):
        return "deadlock"
    return "slow"


def longest_wait(statuses: dict) -> float:
    """Return the seconds the oldest running collective has waited (0 if none; patient ones left out)."""
    return max(
        (age for s in statuses.values() if s for c in s["comms"].values() for d, age in c["running"] if not d.patient),
        default=0.0,
    )


#: CPU cores a rank may use between two snapshots and still count as stuck (its waits poll and sleep)
BUSY_CORES = 0.5


def stable(first: dict, second: dict) -> bool:
    """Return True when no rank changed anything between the two snapshots and none computed meanwhile.

    A rank changed when its progress counter moved; it computed when its threads
    outside hpcddp (``oplog.rank_status``'s "cpu") used more than ``BUSY_CORES`` of CPU
    time per second of the interval together.
    """
    if first.keys() != second.keys():
        return False
    for rank, status in first.items():
        other = second[rank]
        if status is None or other is None or status["progress"] != other["progress"]:
            return False
        elapsed = other["clock"] - status["clock"]
        if elapsed <= 0 or other["cpu"] - status["cpu"] > BUSY_CORES * elapsed:
            return False
    return True
