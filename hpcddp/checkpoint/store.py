"""Checkpoints that survive preemption: atomic save on rank 0, load on every rank.

    state = hpcddp.training_state(model, optimizer, epoch=epoch, batch_in_epoch=i, step=step)
    hpcddp.save_checkpoint("ckpt/", state, keep_last=3)       # ckpt/checkpoint-000123.pt
    ...
    state = hpcddp.load_checkpoint("ckpt/")                   # newest complete one, or None
    if state is not None:
        progress = hpcddp.restore_training_state(state, model, optimizer)

A checkpoint is complete the moment its final name exists: rank 0 writes a hidden
temporary file in the same directory, fsyncs it and renames it into place, so a job
killed mid-write leaves at most a temporary file that ``load_checkpoint`` ignores.
Every file ends with a SHA-256 checksum of its contents: ``load_checkpoint`` skips a
file whose bytes changed since (or that lost its end), with a warning naming it, and
loads the newest intact one instead. It reads the file once per job, on rank 0, and
shares the bytes with the other ranks (``hpcddp.checkpoint.reading``).
"""

from __future__ import annotations

import builtins
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..env.files import probe_writable, write_atomically
from .checksum import save_with_checksum
from .identity import check_directory_run
from .loadable import check_loadable
from .owner import check_not_owned_by_another_job, claim
from .reading import load_newest
from .resume import rank_and_size

__all__ = [
    "check_checkpoint_dir",
    "find_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger("hpcddp")

_NAME = re.compile(r"checkpoint-(\d+)\.pt")


def _checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:06d}.pt"


def find_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Return the complete checkpoints in ``directory``, oldest step first.

    Only files named ``checkpoint-<step>.pt`` count; temporary files of an
    interrupted save do not.

    Args:
        directory: the checkpoint directory (missing is fine: no checkpoints).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def _write_atomically(path: Path, state: Any) -> None:
    write_atomically(path, lambda fh: save_with_checksum(state, fh), "checkpoint")


def save_checkpoint(
    path_or_dir: str | os.PathLike,
    state: dict[str, Any],
    *,
    step: int | None = None,
    keep_last: int | None = None,
    weights_only: bool = True,
) -> Path:
    """Write ``state`` atomically from rank 0 while the other ranks wait; return its path.

    Call it on every rank (it is a collective once ``hpcddp.init()`` ran). An error
    on rank 0 is raised on every rank.

    Args:
        path_or_dir: a directory (created if missing; the file is named
            ``checkpoint-<step>.pt``) or a file path ending in ``.pt``.
        state: what to save, e.g. from ``training_state``; only rank 0's is written.
        step: the step in the file name; ``state["step"]`` when None.
        keep_last: in a directory, delete all but the newest ``keep_last``
            checkpoints after writing; None keeps them all.
        weights_only: refuse, before anything is written, a ``state`` holding a value
            that ``load_checkpoint``'s default (``torch.load(weights_only=True)``)
            cannot read back, such as a numpy scalar (a TypeError naming where it
            sits); False saves any object, for ``load_checkpoint(weights_only=False)``.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    target = Path(path_or_dir)
    directory_mode = target.suffix != ".pt"
    if directory_mode:
        if step is None:
            step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 to name a checkpoint in {target}/, got {step!r}: pass step=")
        target = target / _checkpoint_name(step)
    rank, size = rank_and_size()
    error = None
    if rank == 0:
        try:
            if weights_only:
                check_loadable(state)
            target.parent.mkdir(parents=True, exist_ok=True)
            if directory_mode:  # a named file leaves its directory to others
                claim(target.parent)
                check_directory_run(target.parent, bool(find_checkpoints(target.parent)))
            _write_atomically(target, state)
            if keep_last is not None:
                for old in find_checkpoints(target.parent)[:-keep_last]:
                    if old != target:
                        old.unlink(missing_ok=True)
                # Temporary files of saves that were killed: only rank 0 of one job writes here.
                for torn in target.parent.glob(".checkpoint-*.pt.*.tmp"):
                    torn.unlink(missing_ok=True)
        except Exception as err:  # re-raised below, after the other ranks have heard of it
            error = f"{type(err).__name__}: {err}"
            if size == 1:
                raise
    if size > 1:
        from ..collectives.tensors import broadcast_object
        from ..comm.oplog import patient_collectives

        # The other ranks wait here for as long as the write takes: not a stall.
        with patient_collectives():
            error = broadcast_object(error, root_rank=0)
        if error is not None:
            raise RuntimeError(f"rank 0 could not save checkpoint {target}: {error}")
    return target


def check_checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Make sure rank 0 can write checkpoints into ``directory`` (creating it); collective.

    A directory made here (and parents made with it) is removed again when the job
    exits if it is still empty then: a job that saved nothing leaves nothing behind.

    Call it when the job starts, so that a read-only or missing mount fails at once
    instead of at the first save, which may come hours later (``PreemptionHandler``
    does this for its ``checkpoint_dir``).

    Args:
        directory: the checkpoint directory.

    Raises:
        ValueError: on every rank, naming the directory and the reason (unwritable, a
            full disk, a symbolic link at its owner file, or owned by another job that
            still runs: ``hpcddp.checkpoint.owner``).
    """
    directory = Path(directory)
    rank, size = rank_and_size()
    problem = None
    if rank == 0:
        created = _missing_directories(directory)
        unwritable = probe_writable(directory)
        if unwritable is not None:
            problem = (
                f"checkpoint directory {str(directory)!r} is not writable on rank 0 ({unwritable}): "
                "choose a writable directory (e.g. on a shared filesystem)"
            )
        else:
            try:
                claim(directory, created)
            except (RuntimeError, OSError) as err:  # another job's, a full disk, a planted link
                problem = str(err)
    if size > 1:
        from ..collectives.tensors import broadcast_object

        problem = broadcast_object(problem, root_rank=0)
    if problem is not None:
        raise ValueError(problem)
    return directory


def _missing_directories(directory: Path) -> list[Path]:
    """``directory`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def load_checkpoint(
    dir_or_path: str | os.PathLike,
    *,
    map_location: Any = None,
    weights_only: bool = True,
) -> dict[str, Any] | None:
    """Load the newest intact checkpoint; return None when there is none.

    Given a directory after ``hpcddp.init()``, it is a collective (call it on every
    rank): rank 0 lists the directory and reads the newest checkpoint once, checks it,
    and shares its bytes with every rank (``hpcddp.checkpoint.reading``: held once per
    node on MPI), so every rank resumes from the same step, and ranks on nodes that do
    not see the directory resume too. A file whose checksum does not match (flipped
    bytes, a torn write) or that does not load is skipped on every rank with a warning
    naming it, and the next older one is tried.

    Args:
        dir_or_path: a checkpoint directory (newest ``checkpoint-<step>.pt`` wins)
            or one checkpoint file (read by each rank alone).
        map_location: where tensors go; ``hpcddp.device()`` by default (CPU before init).
        weights_only: torch.load's safe unpickler; ``training_state`` only stores
            types it accepts. Pass False for checkpoints holding arbitrary objects.

    Raises:
        ValueError: when the given file, or every checkpoint in the directory, is
            damaged (on every rank).
    """
    path = Path(dir_or_path)
    if map_location is None:
        from ..runtime.state import device, is_initialized

        map_location = device() if is_initialized() else "cpu"
    rank, size = rank_and_size()
    comm = None
    if size > 1:
        from ..runtime.state import communicator

        comm = communicator()
    # Rank 0 decides for every rank whether ``path`` is one file or a directory, and what
    # it holds: a rank that does not see it (another node's filesystem) still takes part.
    is_file, found, error = False, None, None
    if rank == 0:
        try:
            is_file, found = _list_on_rank_0(path)
        except Exception as err:  # raised below, on every rank alike
            error = (type(err).__name__, str(err))
    if comm is not None:
        is_file, error = comm.broadcast_object((is_file, error), 0)
    if error is not None:
        raise _rebuilt(*error)
    from ..comm.oplog import patient_collectives

    with patient_collectives():  # reading and hashing large files takes as long as it takes
        chosen, state, skipped = load_newest(comm, found, map_location, weights_only, follow_links=is_file)
    if is_file:
        if chosen is None:
            raise ValueError(f"checkpoint {path} is damaged: {skipped[0][1]}")
        return state
    if chosen is None:
        if skipped:
            described = "; ".join(f"{p.name} ({problem})" for p, problem in skipped)
            raise ValueError(
                f"every checkpoint in {path} is damaged: {described}: "
                "restore one from a backup, or move them away to start afresh"
            )
        _check_rank_0_sees_the_directory(comm, path)
        return None
    if skipped:
        log.warning("hpcddp rank %d: loading the older checkpoint %s", rank, chosen)
    return state


def _list_on_rank_0(path: Path) -> tuple[bool, list[Path]]:
    """(whether ``path`` names one file, the checkpoints to try oldest first), as rank 0 sees them."""
    if not path.is_dir() and (path.exists() or path.is_symlink() or path.suffix == ".pt"):
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist: pass a checkpoint file or directory")
        return True, [path]
    try:
        found = find_checkpoints(path)
    except OSError as err:
        raise type(err)(
            f"rank 0 cannot list checkpoint directory {path} ({err}): make it readable on rank 0's node"
        ) from err
    if path.is_dir():
        _warn_if_another_job_writes(path)
    return False, found


def _rebuilt(type_name: str, message: str) -> Exception:
    """Rank 0's exception, rebuilt on every rank: the same built-in type where it is one, else RuntimeError."""
    kind = getattr(builtins, type_name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except TypeError:  # one whose constructor wants more (UnicodeDecodeError)
            pass
    return RuntimeError(f"rank 0 could not list the checkpoints: {type_name}: {message}")


def _check_rank_0_sees_the_directory(comm, path: Path) -> None:
    """Fail on every rank when rank 0 lacks the directory that another rank sees: a start from scratch in error.

    One stat per rank and one allreduce, and only when rank 0 found no checkpoint (a
    job's first start): a listing per rank would tell more, but is the metadata load
    (4,096 listings of one directory) that reading on rank 0 alone removed.
    """
    if comm is None:
        return
    from ..comm.base import ReduceOp

    try:
        sees = path.is_dir()
    except OSError:
        sees = False
    first_other, rank_0_sees = (
        int(v)
        for v in comm.allreduce_(
            torch.tensor(
                [comm.rank if sees and comm.rank != 0 else comm.size, 0 if comm.rank == 0 and not sees else 1]
            ),
            ReduceOp.MIN,
        )
    )
    if not rank_0_sees and first_other < comm.size:
        raise ValueError(
            f"checkpoint directory {path} does not exist on rank 0 but does on rank {first_other}: rank 0 reads the "
            "checkpoints for the job, so it must be one directory shared by every node (or absent on every one)"
        )


def _warn_if_another_job_writes(path: Path) -> None:
    try:
        owned = check_not_owned_by_another_job(path)
    except OSError as err:  # a link planted at the owner file: saving here would be refused
        log.warning("hpcddp: loading from %s without checking its owner: %s", path, err)
        return
    if owned is not None:
        # Reading disturbs nobody (an evaluation beside training); saving here would be refused.
        log.warning("hpcddp: loading from %s, which another job still writes: %s", path, owned)
