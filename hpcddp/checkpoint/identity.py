"""Which run a checkpoint belongs to, and whether this job may resume it.

A checkpoint belongs to a *run*, not to a job number: Slurm gives a new job the number
of an old one once its controller's state is rebuilt, and a directory named by the
number (or one directory handed to several jobs) then holds another run's checkpoints,
which the new job would resume instead of training. ``training_state`` records the run
(HPCDDP_RUN_ID: slurm/train.sh names one at a job's first start and finds it again when
Slurm requeues the job) and the number of ranks; ``restore_training_state`` refuses, in
one line naming the knob, to resume

- another run's checkpoint, when both it and this job name a run. A job without
  HPCDDP_RUN_ID (plain mpirun with a directory of the user's choosing) resumes what is
  there, and a checkpoint saved without one (by such a job, or before hpcddp recorded
  runs) is resumed by any job;
- a checkpoint saved by another number of ranks. The model and optimizer states are
  replicated and load at any size, but the RNG streams are per rank, and the position
  ("``batch_in_epoch`` batches of this epoch done") counts batches of each rank's shard:
  only a loop that keeps the global batch fixed over an interleaving sampler
  (``DistributedSampler``, as examples/train.py does) sees the same samples next at
  another size. hpcddp cannot tell which loop it serves, so this takes an opt-in.

``resume=`` (or HPCDDP_RESUME) allows what differs: ``"strict"`` (the default) nothing,
``"any-run"`` another run, ``"any-size"`` another number of ranks, ``"any"`` both.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..env.files import read_text_no_follow, write_atomically
from ..env.settings import RESUME_POLICIES, read_resume_policy, read_run_id

__all__ = ["RUN_FILE", "check_directory_run", "check_resumable", "resume_policy", "this_run"]

#: names the run whose checkpoints a directory holds (written at a named run's first save)
RUN_FILE = ".hpcddp-run"

log = logging.getLogger("hpcddp")
_resumed_runs: set[str] = set()  # other runs whose checkpoints this job resumed on purpose (resume="any-run")


def this_run() -> str | None:
    """Return the run this job belongs to (HPCDDP_RUN_ID), or None when it names none."""
    return read_run_id(os.environ)


def resume_policy(resume: str | None = None) -> str:
    """Return the policy in force: ``resume`` if given, else HPCDDP_RESUME, else ``"strict"``.

    Args:
        resume: one of ``RESUME_POLICIES``, or None to read HPCDDP_RESUME.
    """
    if resume is None:
        return read_resume_policy(os.environ) or "strict"
    if isinstance(resume, str) and resume.strip().lower() in RESUME_POLICIES:
        return resume.strip().lower()  # as HPCDDP_RESUME is read
    if resume not in RESUME_POLICIES:
        raise ValueError(f"resume must be one of {', '.join(map(repr, RESUME_POLICIES))}, got {resume!r}")
    return resume


def check_resumable(state: dict[str, Any], rank: int, size: int, resume: str | None = None) -> None:
    """Raise ValueError unless a job of ``size`` ranks in this run may resume ``state``.

    Every rank gets the same answer (the ranks load one checkpoint); rank 0 logs what an
    opt-in let through.

    Args:
        state: a dict from ``training_state``.
        rank: this rank.
        size: the number of ranks of this job.
        resume: what may differ (``resume_policy``); None reads HPCDDP_RESUME.
    """
    policy = resume_policy(resume)
    step, saved_run, mine = state.get("step"), state.get("run_id"), this_run()
    if saved_run is not None and mine is not None and saved_run != mine:
        if policy not in ("any-run", "any"):
            raise ValueError(
                f"the checkpoint of step {step} belongs to run {saved_run!r}, this job is run {mine!r}: a run resumes "
                "only its own checkpoints (a directory shared by several jobs, or a job number used again); give this "
                "run its own checkpoint directory, or set HPCDDP_RESUME=any-run (resume='any-run') to continue run "
                f"{saved_run!r} on purpose"
            )
        _resumed_runs.add(saved_run)
        if rank == 0:
            log.info("hpcddp: run %r resumes run %r's checkpoint of step %s (resume=%r)", mine, saved_run, step, policy)
    saved_size = state.get("world_size", len(state.get("rng", ())))
    if saved_size != size:
        if policy not in ("any-size", "any"):
            raise ValueError(
                f"the checkpoint of step {step} was saved by {saved_size} rank(s), this job has {size}: its RNG "
                "streams and its position in the data are per rank; resume on "
                f"{saved_size} rank(s), or set HPCDDP_RESUME=any-size (resume='any-size') if the position does not "
                "depend on the number of ranks (a fixed global batch over DistributedSampler, as examples/train.py)"
            )
        if rank == 0:
            log.info(
                "hpcddp: resuming the checkpoint of step %s, saved by %d rank(s), on %d (resume=%r): ranks below %d "
                "continue their own RNG streams, the others keep the streams they seeded",
                step,
                saved_size,
                size,
                policy,
                saved_size,
            )


def check_directory_run(directory: Path, holds_checkpoints: bool) -> None:
    """Make ``directory`` this run's (rank 0, before a save); raise RuntimeError if it holds another run's checkpoints.

    A save there would overwrite the other run's checkpoint of the same step, and
    ``keep_last`` would delete its older ones. A job that names no run, and a
    directory that names none, are not checked; a run that resumed the other run on
    purpose (``resume="any-run"``, HPCDDP_RESUME) takes the directory over.

    Args:
        directory: the checkpoint directory.
        holds_checkpoints: whether it holds any checkpoint now.

    Raises:
        OSError: ``RUN_FILE`` there is a symbolic link or not a regular file (never followed).
    """
    mine = this_run()
    if mine is None:
        return
    marker = directory / RUN_FILE
    try:
        recorded = read_text_no_follow(marker).strip() or None
    except FileNotFoundError:
        recorded = None
    if recorded == mine:
        return
    taken_over = recorded in _resumed_runs or resume_policy() in ("any-run", "any")
    if recorded is not None and holds_checkpoints and not taken_over:
        # Quoted only when it looks like a run's name: whatever else the file holds stays out of the error.
        named = len(recorded) <= 200 and recorded.isprintable()
        other = f"run {recorded!r}" if named else f"another run (its {RUN_FILE} holds no run name)"
        that = f"run {recorded!r}" if named else "that run"
        raise RuntimeError(
            f"checkpoint directory {str(directory)!r} holds the checkpoints of {other}, this job is run {mine!r}: "
            f"saving there would overwrite and delete them (keep_last); give this run its own directory, or resume "
            f"{that} on purpose (HPCDDP_RESUME=any-run) to continue it there"
        )
    write_atomically(marker, lambda fh: fh.write((mine + "\n").encode()), "run marker")
