"""The stall report: which operation waits, which ranks are missing or different, and the likely cause.

Pure functions over the inspector's snapshot (see ``hpcddp.fault.stall.verdict``); every rank
is named by its rank in the whole job, also inside a sub-communicator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ...comm.base import ranks_text
from .verdict import Exit, communicators, stuck_operations

__all__ = ["explain_stall", "ranks_text", "what_it_waits_in"]

_BUSY = "it is busy outside hpcddp (evaluation, checkpointing, a slow data loader) or took another code path"
#: ranks named one by one in a list, and lines of one kind, before a report cuts the rest short
_LIST_AT_MOST = 16
_SKIPPED = (
    "it skipped a backward or called step() early, ran out of data (wrap the loop in "
    "hpcddp.join(optimizer)), or is busy outside hpcddp (evaluation, checkpointing, a slow data loader)"
)


def _ranks(ranks) -> str:
    """``ranks_text``, with runs of consecutive ranks as ranges and the middle of a long list cut out."""
    ranks = sorted(ranks)
    if len(ranks) <= _LIST_AT_MOST:
        return ranks_text(ranks)
    runs, first = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            runs.append(str(ranks[first]) if i - first == 1 else f"{ranks[first]}-{ranks[i - 1]}")
            first = i
    if len(runs) > _LIST_AT_MOST:
        runs = [*runs[: _LIST_AT_MOST - 2], "...", runs[-1]]
    return f"{len(ranks)} ranks ({', '.join(runs)})"


def _where(members: Sequence[int] | None, num_members: int, size: int) -> str:
    if num_members == size:
        return ""
    if members is None or len(members) < num_members:  # its first member did not answer: only its size is known
        return f" on a group of {num_members} ranks"
    return f" on the group of {_ranks(members)}"


def _oldest(statuses: dict) -> tuple[str, object, float, dict] | None:
    """The running operation that has waited longest: (communicator key, descriptor, seconds, its rank's log)."""
    best = None
    for status in statuses.values():
        if status is None:
            continue
        for key, comm in status["comms"].items():
            for desc, age in comm["running"]:
                if desc.patient:
                    continue
                if best is None or age > best[2]:
                    best = (key, desc, age, comm)
    return best


def what_it_waits_in(status: dict, size: int, members: dict) -> str:
    """Return what a rank waits in, in words ("allreduce #12 ...", "no collective").

    Args:
        status: the rank's ``oplog.rank_status``.
        size: ranks in the job.
        members: communicator key -> its members, where known.
    """
    for key, comm in status["comms"].items():
        if comm["running"]:
            desc, _ = comm["running"][0]
            return f"{desc}{_where(members.get(key), _num_members(comm), size)}"
    for comm in status["comms"].values():
        for kind, peer, tag, age in comm["p2p"]:
            source = "any rank" if peer is None else f"rank {peer}"
            return f"{kind} {'from' if kind == 'recv' else 'to'} {source} (tag {tag}, {age:.0f} s)"
    if status["waits"]:
        return str(status["waits"][0][1])
    return "no collective"


def _missing_cause(status: dict, reference) -> str:
    waits_elsewhere = any(comm["running"] or comm["p2p"] for comm in status["comms"].values())
    if waits_elsewhere:
        return "the ranks took different code paths: each waits in an operation the other never calls"
    return _SKIPPED if reference.step is not None else _BUSY


def _at(comm: dict, seq: int):
    for desc, _ in comm["running"]:
        if desc.seq == seq:
            return desc
    return next((d for d in comm["recent"] if d.seq == seq), None)


def _mismatch_cause(reference, other, steps, reference_rank, ranks) -> str:
    if reference.op == other.op and reference.step is not None and reference.step == other.step:
        return "different models on different ranks (check the parameter lists), or data-dependent shapes"
    if reference.op == other.op and reference.shape != other.shape and reference.step is None:
        return "data-dependent shapes: every rank must pass a tensor of the same shape and dtype"
    ref_step, other_step = steps.get(reference_rank), steps.get(ranks[0])
    if ref_step is not None and other_step is not None and ref_step != other_step:
        behind = ranks if other_step < ref_step else [reference_rank]
        return (
            f"{_ranks(behind)} reduced gradients for fewer steps (last step {min(ref_step, other_step)} "
            f"vs {max(ref_step, other_step)}): skipped a backward or called step() early, or ran out of data "
            "(wrap the loop in hpcddp.join(optimizer))"
        )
    return "the ranks call collectives in different orders (a rank-dependent branch around a collective)"


def _exited_text(rank: int, exit: Exit) -> str:
    code = "" if exit.code is None else f" with exit code {exit.code}"
    return f"rank {rank} {exit.how}{code}"


def _num_members(comm: dict) -> int:
    return comm["size"] if "size" in comm else len(comm["members"])


def _cut_short(lines: list[str], what: str) -> list[str]:
    """The first of ``lines``, and one line counting the rest (``what``: what each line is about)."""
    if len(lines) <= _LIST_AT_MOST:
        return lines
    return [*lines[:_LIST_AT_MOST], f"  ... and {len(lines) - _LIST_AT_MOST} more {what}"]


def _silent_lines(silent: list[int], size: int, hosts: Sequence[str] | None) -> list[str]:
    if not hosts:
        return [
            f"  {_ranks(silent)} did not answer the inspector: dead, cut off, or hung outside Python (holding the GIL)"
        ]
    lines = []
    by_host: dict[str, list[int]] = {}
    for r in silent:
        by_host.setdefault(hosts[r], []).append(r)
    on_host = Counter(hosts[:size])
    for host, ranks in by_host.items():
        if len(ranks) == on_host[host]:
            lines.append(
                f"  node {host} is lost: {_ranks(ranks)} on it did not answer the inspector "
                "(node down or cut off from the others, or its processes died)"
            )
        else:
            lines.append(
                f"  {_ranks(ranks)} on node {host} did not answer the inspector: dead, stopped, or hung "
                "without using the CPU"
            )
    return _cut_short(lines, f"nodes with ranks that did not answer ({_ranks(silent)} in all)")


def _busy_lines(busy: Sequence[int], hosts: Sequence[str] | None) -> list[str]:
    by_host: dict[str, list[int]] = {}
    for r in busy:
        by_host.setdefault(f" on node {hosts[r]}" if hosts else "", []).append(r)
    lines = [
        f"  {_ranks(ranks)}{where} {'is' if len(ranks) == 1 else 'are'} busy in a long call outside Python "
        "(CPU time advancing): holding the GIL (a long sort, regex or pickle), it cannot answer the inspector"
        for where, ranks in by_host.items()
    ]
    return _cut_short(lines, f"nodes with busy ranks ({_ranks(busy)} in all)")


def explain_stall(
    statuses: dict,
    exits: dict,
    size: int,
    timeout: float,
    hosts: Sequence[str] | None = None,
    busy=frozenset(),
) -> str:
    """Return the stall report for one snapshot.

    Args:
        statuses: ``rank_status`` of every rank that has not exited; None for a rank that did not answer.
        exits: ``Exit`` of every rank that said it was leaving.
        size: the number of ranks in the job.
        timeout: the stall timeout, quoted in the report.
        hosts: every rank's host name, to name the node of ranks that did not answer.
        busy: the ranks that did not answer but use the CPU (see ``hpcddp.fault.stall.liveness``).
    """
    oldest = _oldest(statuses)
    busy = sorted(busy)
    silent = sorted(r for r, s in statuses.items() if s is None and r not in exits and r not in busy)
    unanswered = _busy_lines(busy, hosts) + (_silent_lines(silent, size, hosts) if silent else [])
    if oldest is None:
        return "\n".join(["[hpcddp stall inspector] no rank is waiting in a collective any more", *unanswered])
    key, reference, longest, reference_comm = oldest
    seq = reference.seq
    known = communicators(statuses, exits)
    members = known[key]
    member_set = set(members)
    lines = [
        f"[hpcddp stall inspector] collective #{seq}{_where(members, _num_members(reference_comm), size)} has waited {longest:.0f} s "
        f"(stall_timeout={timeout:g} s):"
    ]
    comms = {r: s["comms"].get(key) for r, s in statuses.items() if s is not None and r in member_set}
    at_seq = {r: _at(c, seq) for r, c in comms.items() if c is not None}
    at_seq = {r: d for r, d in at_seq.items() if d is not None}
    steps = {r: c["last_step"] for r, c in comms.items() if c is not None and c["last_step"] is not None}
    reference_rank = min(r for r, d in at_seq.items() if d.match_key() == reference.match_key())
    groups: dict[tuple, list[int]] = {}
    for r, d in sorted(at_seq.items()):
        groups.setdefault(d.match_key(), []).append(r)
    lines.append(f"  {_ranks(groups[reference.match_key()])} submitted {reference}")
    for match, ranks in groups.items():
        if match == reference.match_key():
            continue
        lines.append(f"  {_ranks(ranks)} submitted {at_seq[ranks[0]]} instead")
        lines.append("    likely cause: " + _mismatch_cause(reference, at_seq[ranks[0]], steps, reference_rank, ranks))
    missing = [r for r in members if r not in at_seq and r not in exits and statuses.get(r) is not None]
    missing_lines = []
    for r in missing[: _LIST_AT_MOST + 1]:
        comm = comms.get(r)
        if comm is not None and comm["started"] > seq:
            missing_lines.append(
                [
                    f"  rank {r} is past #{seq} (its history no longer holds it); it waits in {what_it_waits_in(statuses[r], size, known)}"
                ]
            )
            continue
        recent = comm["recent"] if comm is not None else []
        last = recent[-1] if recent else None
        idle = f", {comm['idle']:.0f} s ago" if comm is not None and last is not None else ""
        missing_lines.append(
            [
                f"  rank {r} did not submit {reference.op} #{seq}"
                + (f" ({reference.label})" if reference.label else "")
                + f": its last collective was {last or 'none'}{idle}, and it waits in {what_it_waits_in(statuses[r], size, known)}",
                "    likely cause: " + _missing_cause(statuses[r], reference),
            ]
        )
    if len(missing) > _LIST_AT_MOST:
        cut = missing_lines[: _LIST_AT_MOST // 2]
        missing_lines = [*cut, [f"  ... and {_ranks(missing[len(cut) :])} did not submit #{seq} either"]]
    lines.extend(line for pair in missing_lines for line in pair)
    exited = [r for r in sorted(member_set & exits.keys()) if exits[r].started.get(key, 0) < seq]
    lines.extend(
        _cut_short(
            [
                f"  {_exited_text(r, exits[r])} after #{exits[r].started.get(key, 0)}: it will never submit #{seq}"
                for r in exited
            ],
            f"ranks that left before #{seq} ({_ranks(exited)} in all)",
        )
    )
    lines.extend(unanswered)
    waiting = sorted(r for r, d in at_seq.items() if _running(statuses[r], key, seq))
    different = {r for match, rs in groups.items() if match != reference.match_key() for r in rs}
    late = sorted(set(missing) | set(silent) | set(busy) | different | (member_set & exits.keys()))
    lines.append(
        f"  waiting: {_ranks(waiting) if waiting else 'none'}; missing or different: {_ranks(late) if late else 'none'}"
    )
    return "\n".join(lines)


def _running(status: dict, key: str, seq: int) -> bool:
    comm = status["comms"].get(key)
    return comm is not None and any(desc.seq == seq for desc, _ in comm["running"])


def exit_reason(statuses: dict, exits: dict) -> tuple[str, int]:
    """For an "exited" verdict: the sentence for the abort, and the exit code to end the job with."""
    stuck = stuck_operations(statuses, exits)
    first = stuck[0]
    exit = exits[first.exited]
    waiters = sorted({s.rank for s in stuck if s.exited == first.exited})
    code = exit.code if exit.code else 1
    return (
        f"{_exited_text(first.exited, exit)} while {_ranks(waiters)} "
        f"{'waits' if len(waiters) == 1 else 'wait'} in {first.desc}, which needs it",
        code,
    )
