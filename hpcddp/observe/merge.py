"""Merge the timeline's per-rank event files into one Chrome trace, streaming.

Each rank writes its events to ``<trace>.ranks/rank-<r>.jsonl`` (one JSON event a line,
``hpcddp.observe.timeline``); rank 0 merges them at the end of the run, or
``hpcddp timeline merge <trace>`` does later. The merge reads one line at a time, so
its memory does not grow with ranks x steps.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..env.files import open_no_follow, write_atomically

__all__ = ["MergeResult", "merge_rank_files", "rank_directory", "rank_file", "remove_rank_files"]

_RANK_FILE = re.compile(r"rank-(\d+)\.jsonl")
# PendingFile's private name for a rank file not yet committed (tempfile.mkstemp's)
_UNFINISHED_RANK_FILE = re.compile(r"\.rank-\d+\.jsonl\..+\.tmp")
_READ_CHUNK = 1 << 20


def rank_directory(trace: str | os.PathLike) -> Path:
    """Return the directory beside ``trace`` that holds the per-rank event files."""
    return Path(f"{os.fspath(trace)}.ranks")


def rank_file(trace: str | os.PathLike, rank: int) -> Path:
    """Return the file in which ``rank`` writes its events of ``trace``."""
    return rank_directory(trace) / f"rank-{rank}.jsonl"


@dataclass
class MergeResult:
    """What a merge wrote."""

    path: Path
    """The merged trace."""

    merged: list[int] = field(default_factory=list)
    """The ranks whose events it holds."""

    missing: list[int] = field(default_factory=list)
    """The ranks expected but whose file could not be read (not on this file system, or damaged)."""

    problems: dict[int, str] = field(default_factory=dict)
    """Why each missing rank's file could not be read."""


def merge_rank_files(trace: str | os.PathLike, num_ranks: int | None = None, remove: bool = False) -> MergeResult:
    """Write ``trace`` from the per-rank files beside it, reading what it can.

    Args:
        trace: the Chrome trace to write (``HPCDDP_TIMELINE``'s path).
        num_ranks: the job's number of ranks, to name those whose file is missing; None: the
            ranks up to the highest file found.
        remove: remove the per-rank files (and their directory, when empty) once merged, but
            only when no rank is missing: those files are what a later merge needs.

    Raises:
        FileNotFoundError: no per-rank file of ``trace`` could be read at all.
    """
    trace = Path(trace)
    directory = rank_directory(trace)
    found = _ranks_found(directory)
    expected = range(num_ranks) if num_ranks is not None else range(max(found) + 1 if found else 0)
    result = MergeResult(trace)
    try:
        write_atomically(trace, lambda out: _write_trace(out, trace, expected, result), "timeline")
    except _NothingToMerge:
        raise FileNotFoundError(f"no per-rank timeline file of {trace} in {directory}: nothing to merge") from None
    if remove and not result.missing:
        for rank in result.merged:
            rank_file(trace, rank).unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass  # files of other runs, or of ranks beyond num_ranks: left for their owner
    return result


def remove_rank_files(trace: str | os.PathLike) -> int:
    """Remove the per-rank files of ``trace`` an earlier run left (a merge must not take them for this run's).

    Unfinished files (a rank killed before it committed its events) go too.

    Returns how many were removed.
    """
    directory = rank_directory(trace)
    found = _ranks_found(directory)
    for rank in found:
        rank_file(trace, rank).unlink(missing_ok=True)
    try:
        unfinished = [name for name in os.listdir(directory) if _UNFINISHED_RANK_FILE.fullmatch(name)]
    except OSError:
        unfinished = []
    for name in unfinished:
        (directory / name).unlink(missing_ok=True)
    return len(found) + len(unfinished)


def _ranks_found(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := _RANK_FILE.fullmatch(name)))


class _NothingToMerge(Exception):
    """No rank file could be opened: the trace is not written."""


def _write_trace(out, trace: Path, expected: Sequence[int], result: MergeResult) -> None:
    # Each line of a rank file is one event as JSON: the trace is those lines, comma-separated,
    # inside one array; copied in chunks, never parsed whole. A Chrome trace need not be sorted,
    # so the files are copied one after the other: one open at a time, whatever the ranks
    # (thousands of files held open at once would pass the usual limit of 1,024).
    out.write(b'{"displayTimeUnit": "ms", "traceEvents": [\n')
    first = True
    for rank in expected:
        try:
            fd = open_no_follow(rank_file(trace, rank), os.O_RDONLY)
        except OSError as err:
            result.missing.append(rank)
            result.problems[rank] = "no file" if isinstance(err, FileNotFoundError) else str(err)
            continue
        try:
            pending = b""
            while True:
                chunk = os.read(fd, _READ_CHUNK)
                if not chunk:
                    break
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                lines = [line for line in lines if line.strip()]
                if lines:
                    out.write((b"" if first else b",\n") + b",\n".join(lines))
                    first = False
            # A last line without its newline was cut short (a damaged copy): dropped.
        finally:
            os.close(fd)
        result.merged.append(rank)
    if not result.merged:
        raise _NothingToMerge
    out.write(b"\n]}\n")
