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

import bisect
from typing import NamedTuple

__all__ = ["Exit", "Stuck", "communicators", "judge", "longest_wait", "stable", "stuck_operations"]


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


class _Index:
    """What the verdict compares, gathered in one pass over every rank's status and exit.

    Replies carry no member lists (only a communicator's first member sends its members,
    see ``inspector.reply_status``), so an operation is completable when as many ranks reached it
    as the communicator has members: each member is visited once, whatever the number
    of waiting ranks.
    """

    def __init__(self, statuses: dict, exits: dict) -> None:
        #: communicator key -> its number of members
        self.size: dict[str, int] = {}
        #: communicator key -> its members, where a status carried them
        self.members: dict[str, tuple] = {}
        #: communicator key -> the operations started by each rank that has it, sorted
        self.started: dict[str, list[int]] = {}
        #: (communicator key, seq) -> {(match key, op): a descriptor} running there on some rank
        self.running: dict[tuple[str, int], dict] = {}
        #: (rank, kind, tag) -> peers of that rank's pending messages; (kind, tag, peer) -> their ranks
        self.by_rank: dict[tuple, set] = {}
        self.by_peer: dict[tuple, set] = {}
        for rank, status in statuses.items():
            if status is None:
                continue
            for key, comm in status["comms"].items():
                members = comm.get("members")
                if members is not None:
                    self.members.setdefault(key, members)
                self.size.setdefault(key, comm["size"] if "size" in comm else len(members))
                if rank not in exits:
                    self.started.setdefault(key, []).append(comm["started"])
                for desc, _age in comm["running"]:
                    self.running.setdefault((key, desc.seq), {}).setdefault((desc.match_key(), desc.op), desc)
                for kind, peer, tag, _age in comm["p2p"]:
                    self.by_rank.setdefault((rank, kind, tag), set()).add(peer)
                    self.by_peer.setdefault((kind, tag, peer), set()).add(rank)
        for exit in exits.values():
            for key, started in exit.started.items():
                self.started.setdefault(key, []).append(started)
        for counts in self.started.values():
            counts.sort()
        self._exited_members: dict[str, list[tuple[int, int]]] = {}
        self._stuck: dict[tuple[str, int], int | None] = {}

    def reached(self, key: str, seq: int) -> int:
        """How many ranks started operation ``seq`` of communicator ``key`` (exited ones by what they said)."""
        counts = self.started.get(key, [])
        return len(counts) - bisect.bisect_left(counts, seq)

    def collective_completable(self, key: str, desc) -> bool:
        if self.reached(key, desc.seq) < self.size[key]:
            return False
        there = self.running.get((key, desc.seq), {})
        return all(d.match_key() == desc.match_key() or _joins(d, desc) for d in there.values())

    def message_completable(self, rank: int, kind: str, peer: int | None, tag: int) -> bool:
        wanted = "send" if kind == "recv" else "recv"
        if peer is not None:
            return bool(self.by_rank.get((peer, wanted, tag), set()) & {rank, None})
        # From any source: another rank's matching message, aimed at this rank or at any.
        return any(
            len(ranks) > (rank in ranks) for ranks in (self.by_peer.get((wanted, tag, p), ()) for p in (rank, None))
        )

    def first_exited_before(self, key: str, seq: int, exits: dict) -> int | None:
        """The first member of ``key`` (in its order) that exited before starting ``seq``, or None."""
        if (key, seq) not in self._stuck:
            if key not in self._exited_members:
                members = self.members.get(key)
                if members is None:  # its first member did not answer: the exits that had it
                    members = sorted(r for r, exit in exits.items() if key in exit.started)
                self._exited_members[key] = [(m, exits[m].started.get(key, 0)) for m in members if m in exits]
            self._stuck[key, seq] = next((m for m, started in self._exited_members[key] if started < seq), None)
        return self._stuck[key, seq]


def communicators(statuses: dict, exits: dict) -> dict[str, tuple]:
    """Return each communicator's members: as its first member sent them, else the ranks that told of it.

    Args:
        statuses: as for ``judge``.
        exits: as for ``judge``.
    """
    index = _Index(statuses, exits)
    reported: dict[str, set[int]] = {}
    for rank, status in statuses.items():
        for key in status["comms"] if status is not None else ():
            if key not in index.members:
                reported.setdefault(key, set()).add(rank)
    for rank, exit in exits.items():
        for key in exit.started:
            if key not in index.members:
                reported.setdefault(key, set()).add(rank)
    return {**{key: tuple(sorted(ranks)) for key, ranks in reported.items()}, **index.members}


def _joins(a, b) -> bool:
    # A joined rank shadows the others' allreduces (hpcddp.comm.agreement.continues_while_joined):
    # "join" beside "allreduce" is a pair that completes, however long the allreduce takes.
    return {a.op, b.op} == {"join", "allreduce"}


def _stuck_operations(statuses: dict, exits: dict, index: _Index) -> list[Stuck]:
    stuck = []
    if not exits:
        return stuck
    for rank, status in statuses.items():
        if status is None or rank in exits:
            continue
        for key, comm in status["comms"].items():
            for desc, _age in comm["running"]:
                member = index.first_exited_before(key, desc.seq, exits)
                if member is not None:
                    stuck.append(Stuck(rank, key, desc, member))
    return stuck


def stuck_operations(statuses: dict, exits: dict) -> list[Stuck]:
    """Return the running operations that a rank which exited will never join."""
    return _stuck_operations(statuses, exits, _Index(statuses, exits))


def _rank_is_stuck(status: dict, rank: int, index: _Index) -> bool:
    if not status["waits"]:
        return False
    blocking = 0
    for key, comm in status["comms"].items():
        for desc, _age in comm["running"]:
            blocking += 1
            if index.collective_completable(key, desc):
                return False
        for kind, peer, tag, _age in comm["p2p"]:
            blocking += 1
            if index.message_completable(rank, kind, peer, tag):
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
    index = _Index(statuses, exits)
    if _stuck_operations(statuses, exits, index):
        return "exited"
    if busy:
        return "slow"  # a busy rank may yet join what the others wait in
    alive = [rank for rank in statuses if rank not in exits]
    if alive and all(_rank_is_stuck(statuses[rank], rank, index) for rank in alive):
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
