"""The stall report: which operation waits, which ranks are missing or different, and the likely cause.

Pure functions over the inspector's snapshot (see ``hpcddp.fault.stall.verdict``); every rank
is named by its rank in the whole job, also inside a sub-communicator.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...comm.base import ranks_text
from .verdict import Exit, stuck_operations

__all__ = ["explain_stall", "ranks_text"]

_BUSY = "it is busy outside hpcddp (evaluation, checkpointing, a slow data loader) or took another code path"
_SKIPPED = (
    "it skipped a backward or called step() early, ran out of data (wrap the loop in "
    "hpcddp.join(optimizer)), or is busy outside hpcddp (evaluation, checkpointing, a slow data loader)"
)


def _where(members: Sequence[int], size: int) -> str:
    if list(members) == list(range(size)):
        return ""
    return f" on the group of {ranks_text(members)}"


def _oldest(statuses: dict) -> tuple[str, object, float, tuple] | None:
    """The running operation that has waited longest: (communicator key, descriptor, seconds, members)."""
    best = None
    for status in statuses.values():
        if status is None:
            continue
        for key, comm in status["comms"].items():
            for desc, age in comm["running"]:
                if desc.patient:
                    continue
                if best is None or age > best[2]:
                    best = (key, desc, age, comm["members"])
    return best


def _doing(status: dict, size: int) -> str:
    """What a rank waits in, in words."""
    for comm in status["comms"].values():
        if comm["running"]:
            desc, _ = comm["running"][0]
            return f"it waits in {desc}{_where(comm['members'], size)}"
    for comm in status["comms"].values():
        for kind, peer, tag, age in comm["p2p"]:
            source = "any rank" if peer is None else f"rank {peer}"
            return f"it waits in {kind} {'from' if kind == 'recv' else 'to'} {source} (tag {tag}, {age:.0f} s)"
    if status["waits"]:
        return f"it waits in {status['waits'][0][1]}"
    return "it waits in no collective"


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
            f"{ranks_text(behind)} reduced gradients for fewer steps (last step {min(ref_step, other_step)} "
            f"vs {max(ref_step, other_step)}): skipped a backward or called step() early, or ran out of data "
            "(wrap the loop in hpcddp.join(optimizer))"
        )
    return "the ranks call collectives in different orders (a rank-dependent branch around a collective)"


def _exited_text(rank: int, exit: Exit) -> str:
    code = "" if exit.code is None else f" with exit code {exit.code}"
    return f"rank {rank} {exit.how}{code}"


def _silent_lines(silent: list[int], size: int, hosts: Sequence[str] | None) -> list[str]:
    if not hosts:
        return [
            f"  {ranks_text(silent)} did not answer the inspector: dead, cut off, or hung outside Python (holding the GIL)"
        ]
    lines = []
    by_host: dict[str, list[int]] = {}
    for r in silent:
        by_host.setdefault(hosts[r], []).append(r)
    for host, ranks in by_host.items():
        if ranks == [r for r in range(size) if hosts[r] == host]:
            lines.append(
                f"  node {host} is lost: {ranks_text(ranks)} on it did not answer the inspector "
                "(node down or cut off from the others, or its processes died)"
            )
        else:
            lines.append(
                f"  {ranks_text(ranks)} on node {host} did not answer the inspector: dead, stopped, or hung "
                "without using the CPU"
            )
    return lines


def _busy_lines(busy: Sequence[int], hosts: Sequence[str] | None) -> list[str]:
    by_host: dict[str, list[int]] = {}
    for r in busy:
        by_host.setdefault(f" on node {hosts[r]}" if hosts else "", []).append(r)
    return [
        f"  {ranks_text(ranks)}{where} {'is' if len(ranks) == 1 else 'are'} busy in a long call outside Python "
        "(CPU time advancing): holding the GIL (a long sort, regex or pickle), it cannot answer the inspector"
        for where, ranks in by_host.items()
    ]


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
    key, reference, longest, members = oldest
    seq = reference.seq
    lines = [
        f"[hpcddp stall inspector] collective #{seq}{_where(members, size)} has waited {longest:.0f} s "
        f"(stall_timeout={timeout:g} s):"
    ]
    comms = {r: s["comms"].get(key) for r, s in statuses.items() if s is not None and r in members}
    at_seq = {r: _at(c, seq) for r, c in comms.items() if c is not None}
    at_seq = {r: d for r, d in at_seq.items() if d is not None}
    steps = {r: c["last_step"] for r, c in comms.items() if c is not None and c["last_step"] is not None}
    reference_rank = min(r for r, d in at_seq.items() if d.match_key() == reference.match_key())
    groups: dict[tuple, list[int]] = {}
    for r, d in sorted(at_seq.items()):
        groups.setdefault(d.match_key(), []).append(r)
    lines.append(f"  {ranks_text(groups[reference.match_key()])} submitted {reference}")
    for match, ranks in groups.items():
        if match == reference.match_key():
            continue
        lines.append(f"  {ranks_text(ranks)} submitted {at_seq[ranks[0]]} instead")
        lines.append("    likely cause: " + _mismatch_cause(reference, at_seq[ranks[0]], steps, reference_rank, ranks))
    missing = [r for r in members if r not in at_seq and r not in exits and statuses.get(r) is not None]
    for r in missing:
        comm = comms.get(r)
        if comm is not None and comm["started"] > seq:
            lines.append(f"  rank {r} is past #{seq} (its history no longer holds it); {_doing(statuses[r], size)}")
            continue
        recent = comm["recent"] if comm is not None else []
        last = recent[-1] if recent else None
        idle = f", {comm['idle']:.0f} s ago" if comm is not None and last is not None else ""
        lines.append(
            f"  rank {r} did not submit {reference.op} #{seq}"
            + (f" ({reference.tag})" if reference.tag else "")
            + f": its last collective was {last or 'none'}{idle}, and {_doing(statuses[r], size)}"
        )
        lines.append("    likely cause: " + _missing_cause(statuses[r], reference))
    for r in sorted(set(members) & set(exits)):
        started = exits[r].started.get(key, 0)
        if started < seq:
            lines.append(f"  {_exited_text(r, exits[r])} after #{started}: it will never submit #{seq}")
    lines.extend(unanswered)
    waiting = sorted(r for r, d in at_seq.items() if _running(statuses[r], key, seq))
    different = {r for match, rs in groups.items() if match != reference.match_key() for r in rs}
    late = sorted(set(missing) | set(silent) | set(busy) | different | {r for r in members if r in exits})
    lines.append(
        f"  waiting: {ranks_text(waiting) if waiting else 'none'}; missing or different: "
        f"{ranks_text(late) if late else 'none'}"
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
        f"{_exited_text(first.exited, exit)} while {ranks_text(waiters)} "
        f"{'waits' if len(waiters) == 1 else 'wait'} in {first.desc}, which needs it",
        code,
    )
