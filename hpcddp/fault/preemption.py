"""Stop every rank at the same step when Slurm (or anyone) asks the job to end.

    with hpcddp.PreemptionHandler() as preemption:
        for step in ...:
            train_one_step()
            if preemption.should_stop():          # every rank gets the same answer
                hpcddp.save_checkpoint(...)
                preemption.requeue()              # scontrol requeue under Slurm
                break

Slurm's ``--signal=USR1@90`` (or ``B:USR1@90`` with a launcher that forwards it; srun
and Open MPI's mpirun both do) warns the job before its time limit; preemption and
``scancel`` send SIGTERM. Either reaches some ranks, maybe not all, at any moment, so
the signal handler only sets a flag and ``should_stop`` lets the ranks agree. A stop
signal that came after ``hpcddp.init()`` and before the handler was entered was held for
it (``stop_signals``): entering takes it, and the first ``should_stop`` is True.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable

import torch

from .stop_signals import take_held_signal

__all__ = ["PreemptionHandler"]

log = logging.getLogger("hpcddp")

_DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionHandler:
    """Catch stop signals and make all ranks agree, at a step boundary, to stop.

    A context manager: entering installs the signal handlers (main thread only),
    leaving restores the previous ones. A stop signal that arrived since
    ``hpcddp.init()`` while no handler was entered counts as received here.
    ``should_stop`` is a collective: every rank must call it equally often, at the
    same points of the training loop.

    Args:
        signals: the signals that request a stop; SIGUSR1 and SIGTERM by default.
        check_every: agree every this many ``should_stop`` calls (one 1-element
            MAX allreduce each); the calls in between return False, so a stop
            waits at most ``check_every - 1`` extra steps.
        checkpoint_dir: where the checkpoint will be saved when a stop comes;
            entering checks that rank 0 can write there (collective), so a
            read-only directory fails now rather than when the job is ending.
    """

    def __init__(
        self,
        signals: Iterable[int] = _DEFAULT_SIGNALS,
        *,
        check_every: int = 1,
        checkpoint_dir: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.signals = tuple(signals)
        self.check_every = check_every
        self.checkpoint_dir = checkpoint_dir
        #: the signal number that arrived on this rank (0: none yet)
        self.received = 0
        self._stop = False
        self._calls = 0
        self._requeued = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHandler must be entered on the main thread (Python runs signal handlers there)"
            )
        if self.checkpoint_dir is not None:
            from ..checkpoint.store import check_checkpoint_dir

            check_checkpoint_dir(self.checkpoint_dir)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        held = take_held_signal(self._previous)
        if held:
            self._on_signal(held, None)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            # After a requeue Slurm ends this run with SIGTERM: ignored, the rank still
            # exits on its own instead of being killed mid-shutdown.
            signal.signal(signum, signal.SIG_IGN if self._requeued else previous)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Nothing else here: the handler can interrupt any bytecode, including code
        # that holds the logging or communication locks.
        if not self.received:
            self.received = signum

    @property
    def requested(self) -> bool:
        """True once a stop signal reached this rank (no communication)."""
        return bool(self.received)

    def request(self, signum: int = signal.SIGUSR1) -> None:
        """Ask to stop as if ``signum`` had arrived (for tests and custom triggers).

        Args:
            signum: the signal number to record.
        """
        self._on_signal(signum, None)

    def should_stop(self) -> bool:
        """Return True on every rank once any rank has received a stop signal.

        Collective: call it on every rank at the same step boundary.
        """
        if self._stop:
            return True
        self._calls += 1
        if self._calls % self.check_every:
            return False
        from ..runtime.state import is_initialized, size

        flag = torch.tensor([1.0 if self.received else 0.0])
        if is_initialized() and size() > 1:
            from ..collectives.tensors import allreduce

            flag = allreduce(flag, op="max")
        self._stop = bool(flag.item())
        if self._stop:
            name = signal.Signals(self.received).name if self.received else "another rank's signal"
            log.warning("hpcddp: stopping at a step boundary after %s", name)
        return self._stop

    def requeue(self) -> bool:
        """Requeue this Slurm job from rank 0; return True (on every rank) if it was requeued.

        Needs SLURM_JOB_ID, ``scontrol`` on PATH and a requeueable job (``sbatch
        --requeue``). Slurm then ends this run, which should exit soon after (the
        handled signals stay ignored once the handler exits), and starts the job
        again with the same id. Collective: call it on every rank,
        after the checkpoint is saved, so that no rank exits before the request.
        """
        from ..runtime.state import is_initialized, rank, size

        requeued = False
        if not is_initialized() or rank() == 0:
            requeued = _scontrol_requeue(os.environ.get("SLURM_JOB_ID", ""))
        if is_initialized() and size() > 1:
            from ..collectives.tensors import broadcast_object

            requeued = broadcast_object(requeued, root_rank=0)
        self._requeued = requeued
        return requeued


def _requeue_disabled(scontrol: str, job_id: str) -> bool:
    """Return True only when Slurm says the job may not be requeued; unknown counts as allowed."""
    try:
        shown = subprocess.run([scontrol, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return " Requeue=0 " in f" {shown.stdout} "


def _scontrol_requeue(job_id: str) -> bool:
    if not job_id:
        log.info("hpcddp: not under Slurm (no SLURM_JOB_ID), not requeueing")
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("hpcddp: scontrol is not on PATH, cannot requeue Slurm job %s", job_id)
        return False
    if _requeue_disabled(scontrol, job_id):
        log.warning("hpcddp: Slurm job %s was submitted without --requeue (Requeue=0): not requeueing", job_id)
        return False
    try:
        result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("hpcddp: scontrol requeue %s failed: %s", job_id, err)
        return False
    if result.returncode != 0:
        log.warning(
            "hpcddp: scontrol requeue %s failed (exit %d): %s; submit with sbatch --requeue",
            job_id,
            result.returncode,
            (result.stderr or result.stdout).strip(),
        )
        return False
    log.warning("hpcddp: requeued Slurm job %s", job_id)
    return True
