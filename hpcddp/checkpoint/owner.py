"""One job per checkpoint directory: an owner file that names the job writing there.

Two jobs that share a checkpoint directory delete each other's checkpoints
(``keep_last``) and resume from each other's steps. Rank 0 of the job that saves into
a directory therefore claims it with ``.hpcddp-owner`` (its job id, host, pid and the
pid's start time), created exclusively. Another job finds the claim and stops with
one line naming the owner, unless the owner is gone: the same job (a Slurm requeue
keeps its job id), a process that no longer runs on this host, or a Slurm job that
``squeue`` no longer lists. An owner on another node outside Slurm cannot be
checked: a warning names it and the job goes on (a job that died with a lost node
must not lock its successor out). The claim is removed when the owner exits, and so are
the directories that were made for it if nothing else was put in them: a job that saved
no checkpoint leaves no empty ``checkpoints/<run>/`` behind.

The owner file is written whole or not at all (``hpcddp.env.files.create_exclusively``:
a full disk leaves none behind) and never read through a symbolic link planted there.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..env.files import create_exclusively, read_text_no_follow, write_atomically

__all__ = ["OWNER_FILE", "check_not_owned_by_another_job", "claim"]

OWNER_FILE = ".hpcddp-owner"

log = logging.getLogger("hpcddp")

_claimed: set[Path] = set()
# Directories made for a claim (deepest first), removed at exit when still empty.
_created: list[Path] = []


def _start_time(pid: int) -> str | None:
    """The start time of a running process ``pid`` (to tell it from a later one with its pid), else None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):  # a killed process nobody has reaped yet is gone too
        return None
    return fields[19]  # field 22 of /proc/PID/stat: start time in clock ticks


def _job_id() -> str:
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID"):
        if os.environ.get(name):
            return f"mpi:{os.environ[name]}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


def _me() -> dict:
    pid = os.getpid()
    return {"job": _job_id(), "host": socket.gethostname(), "pid": pid, "started": _start_time(pid)}


def _read(path: Path) -> dict | None:
    """The owner recorded in ``path``, or None when there is none (or only a torn or foreign file).

    Raises:
        OSError: ``path`` is a symbolic link or not a regular file (``read_text_no_follow``).
    """
    try:
        owner = json.loads(read_text_no_follow(path))
    except (FileNotFoundError, ValueError):
        return None
    fields = (("job", str), ("host", str), ("pid", int))
    if not isinstance(owner, dict) or not all(isinstance(owner.get(key), kind) for key, kind in fields):
        return None
    return owner


#: seconds an owner on this host that is still alive gets to finish exiting before it counts as live
_EXIT_GRACE_S = 2.0


def _owner_is_gone(owner: dict) -> bool:
    if owner.get("host") == socket.gethostname():
        # A job killed a moment ago may still be exiting: give it a moment.
        deadline = time.monotonic() + _EXIT_GRACE_S
        while _start_time(int(owner.get("pid", -1))) == owner.get("started"):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True
    job = str(owner.get("job", ""))
    if job.startswith("slurm:"):
        try:
            listed = subprocess.run(
                ["squeue", "-h", "-j", job.removeprefix("slurm:"), "-o", "%T"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None:
            return listed.returncode != 0 or not listed.stdout.strip()
    # Another node, and no scheduler to ask: a job that died there (a lost node) must not
    # lock its successor out, so only warn.
    log.warning(
        "hpcddp: a checkpoint directory's owner file names job %s (rank 0 on %s, pid %s), which cannot be "
        "checked from this node: this job goes on; two jobs sharing one checkpoint directory delete and resume "
        "each other's checkpoints",
        owner.get("job"),
        owner.get("host"),
        owner.get("pid"),
    )
    return True


def _problem(directory: Path, owner: dict) -> str:
    path = directory / OWNER_FILE
    return (
        f"checkpoint directory {str(directory)!r} belongs to another job ({owner.get('job')}, rank 0 on "
        f"{owner.get('host')}, pid {owner.get('pid')}): two jobs sharing one checkpoint directory delete and "
        f"resume each other's checkpoints; give this job its own directory, or delete {path} if that job has ended"
    )


def check_not_owned_by_another_job(directory: Path) -> str | None:
    """Return why this job must not use ``directory`` (another live job owns it), or None.

    Raises:
        OSError: its owner file is a symbolic link or not a regular file.
    """
    owner = _read(directory / OWNER_FILE)
    if owner is None or owner.get("job") == _job_id() or _owner_is_gone(owner):
        return None
    return _problem(directory, owner)


def claim(directory: Path, created: Sequence[Path] = ()) -> None:
    """Make this job the owner of ``directory`` (rank 0, before writing there).

    Args:
        directory: the checkpoint directory.
        created: the directories this job made for it, ``directory`` and then the parents
            made with it; each is removed when the job exits if it is empty by then.

    Raises:
        RuntimeError: another job that still runs owns it.
        OSError: a full disk (no partial owner file is left), or a symbolic link at its name.
    """
    directory = Path(directory)
    if directory in _claimed:
        return
    path = directory / OWNER_FILE
    record = json.dumps(_me()).encode()
    try:
        if not create_exclusively(path, record, "owner file"):
            problem = check_not_owned_by_another_job(directory)
            if problem is not None:
                raise RuntimeError(problem)
            # The owner is gone, or it was this job: take it over (a link planted meanwhile is replaced).
            write_atomically(path, lambda fh: fh.write(record), "owner file")
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                err.errno,
                f"{os.strerror(err.errno)} while claiming checkpoint directory {str(directory)!r} (writing its "
                f"{OWNER_FILE}; no partial one is left): free space or raise the quota there, or choose another "
                "checkpoint directory",
            ) from None
        raise
    _claimed.add(directory)
    _created.extend(Path(path).absolute() for path in created)
    if len(_claimed) == 1:
        atexit.register(_release_all)


def _release_all() -> None:
    me = _me()
    for directory in _claimed:
        path = directory / OWNER_FILE
        try:
            owner = _read(path)
        except OSError:  # a link or a directory planted there since: not this job's claim
            continue
        if owner is not None and owner.get("pid") == me["pid"] and owner.get("host") == me["host"]:
            path.unlink(missing_ok=True)
    _claimed.clear()
    for directory in _created:
        try:
            directory.rmdir()  # only an empty one: whatever was saved there stays
        except OSError:
            pass
    _created.clear()
