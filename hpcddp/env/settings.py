"""hpcddp's own environment variables (HPCDDP_*): the one place they are read."""

from __future__ import annotations

import math

from .launcher import read_value

TYPE_CHECKING = False
if TYPE_CHECKING:  # nothing more at run time: read at every rank's interpreter start (env/launcher.py)
    from collections.abc import Mapping
    from typing import Any

__all__ = [
    "BACKENDS",
    "RESUME_POLICIES",
    "RUN_STATUS_VARIABLE",
    "STALL_ACTIONS",
    "read_float",
    "read_resume_policy",
    "read_run_id",
    "read_settings",
    "read_stop_wait",
    "read_straggler_every",
    "read_torchrun_env_switch",
    "run_status_dir",
]

#: what ``backend=`` / HPCDDP_BACKEND accept
BACKENDS = ("auto", "mpi", "nccl", "gloo")
#: what ``stall_action=`` / HPCDDP_STALL_ACTION accept
STALL_ACTIONS = ("abort", "warn")
#: what ``restore_training_state(resume=)`` / HPCDDP_RESUME accept: which differences between the
#: job that saved a checkpoint and the one resuming it are allowed (``hpcddp.checkpoint.identity``)
RESUME_POLICIES = ("strict", "any-run", "any-size", "any")

#: set by ``hpcddp run`` for its ranks: where they record that they started and finished
RUN_STATUS_VARIABLE = "HPCDDP_RUN_STATUS"


def _seconds(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError(raw)
    return value


def read_float(environ: Mapping[str, str], name: str, default: float | None = None, meaning: str = "") -> float | None:
    """Read a number of seconds >= 0 from the environment; ``default`` when unset (see ``read_value``).

    Args:
        environ: the environment to read.
        name: the variable.
        default: returned when unset.
        meaning: what 0 means, added to the error message (e.g. "0 turns the stall inspector off").
    """
    expected = "a number of seconds >= 0" + (f" ({meaning})" if meaning else "")
    return read_value(environ, name, _seconds, expected, default)


_SWITCH_VALUES = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _switch(name: str, raw: str) -> bool:
    """Read an on/off variable (1/0, true/false, yes/no, on/off)."""
    if raw not in _SWITCH_VALUES:
        raise ValueError(f"environment variable {name} must be 0 or 1, got {raw!r}")
    return _SWITCH_VALUES[raw]


def read_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Return the InitConfig fields set through HPCDDP_* variables (only those that are set).

    HPCDDP_BACKEND sets ``backend``, HPCDDP_IFACE ``interface``, HPCDDP_STALL_TIMEOUT
    ``stall_timeout`` (seconds), HPCDDP_STALL_ABORT_AFTER ``stall_abort_after``
    (seconds), HPCDDP_STALL_ACTION ``stall_action``, HPCDDP_DIST_TIMEOUT
    ``dist_timeout`` (seconds), HPCDDP_HIERARCHICAL_ALLREDUCE ``hierarchical_allreduce``
    (0, 1 or auto), HPCDDP_TIMELINE ``timeline`` (a path), HPCDDP_CHECK_COLLECTIVES
    ``check_collectives`` (0 or 1), HPCDDP_GPU_SHARING ``allow_gpu_sharing`` (0 or 1); an explicit
    ``init()`` argument wins over any of them. HPCDDP_RESUME is only checked here.

    Args:
        environ: the environment to read (``os.environ`` or a test's dict).
    """
    settings: dict[str, Any] = {}
    for name, field, meaning in (
        ("HPCDDP_STALL_TIMEOUT", "stall_timeout", "0 turns the stall inspector off"),
        ("HPCDDP_STALL_ABORT_AFTER", "stall_abort_after", "0 never aborts a slow rank"),
        ("HPCDDP_DIST_TIMEOUT", "dist_timeout", ""),
    ):
        seconds = read_float(environ, name, meaning=meaning)
        if seconds is not None:
            settings[field] = seconds
    backend = environ.get("HPCDDP_BACKEND", "").strip().lower()
    if backend:
        if backend not in BACKENDS:
            choices = ", ".join(BACKENDS)
            raise ValueError(f"environment variable HPCDDP_BACKEND must be one of {choices}, got {backend!r}")
        settings["backend"] = backend
    interface = environ.get("HPCDDP_IFACE", "").strip()
    if interface:
        settings["interface"] = interface
    action = environ.get("HPCDDP_STALL_ACTION", "").strip().lower()
    if action:
        if action not in ("abort", "warn"):
            raise ValueError(f"environment variable HPCDDP_STALL_ACTION must be 'abort' or 'warn', got {action!r}")
        settings["stall_action"] = action
    hierarchical = environ.get("HPCDDP_HIERARCHICAL_ALLREDUCE", "").strip().lower()
    if hierarchical == "auto":
        settings["hierarchical_allreduce"] = "auto"
    elif hierarchical:
        if hierarchical not in _SWITCH_VALUES:
            raise ValueError(
                f"environment variable HPCDDP_HIERARCHICAL_ALLREDUCE must be 0, 1 or auto, got {hierarchical!r}"
            )
        settings["hierarchical_allreduce"] = _SWITCH_VALUES[hierarchical]
    checks = environ.get("HPCDDP_CHECK_COLLECTIVES", "").strip().lower()
    if checks:
        settings["check_collectives"] = _switch("HPCDDP_CHECK_COLLECTIVES", checks)
    sharing = environ.get("HPCDDP_GPU_SHARING", "").strip().lower()
    if sharing:
        settings["allow_gpu_sharing"] = _switch("HPCDDP_GPU_SHARING", sharing)
    timeline = environ.get("HPCDDP_TIMELINE", "").strip()
    if timeline:
        settings["timeline"] = timeline
    # No InitConfig field: checkpoints read it when they save or resume. Read here so that a
    # typo stops the job at init() instead of at its first checkpoint, maybe hours in.
    read_resume_policy(environ)
    read_straggler_every(environ)  # the same: optimizers read it, a typo stops init()
    return settings


#: seconds a stop signal that arrives before any PreemptionHandler waits for one (HPCDDP_STOP_WAIT)
DEFAULT_STOP_WAIT = 25.0


def read_stop_wait(environ: Mapping[str, str]) -> float:
    """Return HPCDDP_STOP_WAIT: seconds a stop signal waits for a PreemptionHandler (``hpcddp.fault.stop_signals``).

    No InitConfig field: under ``hpcddp run`` the signals are held from interpreter start,
    before any ``init()``.

    Args:
        environ: the environment to read.
    """
    return read_float(environ, "HPCDDP_STOP_WAIT", DEFAULT_STOP_WAIT, "0 holds no signal")


#: gradient reductions between straggler reports (HPCDDP_STRAGGLER_EVERY); the gather rides on
#: the reductions every rank completes alike, so uneven step() calls cannot split it
DEFAULT_STRAGGLER_EVERY = 200


#: the fewest steps in a straggler report's window: a median of fewer is noise (``stragglers.MIN_ROWS``)
MIN_STRAGGLER_STEPS = 5


def _report_steps(raw: str) -> int:
    # ASCII digits only: int() also takes "1_000", "+5" and other scripts' digits
    if not (raw.isascii() and raw.isdigit()) or 0 < int(raw) < MIN_STRAGGLER_STEPS:
        raise ValueError(raw)
    return int(raw)


def read_straggler_every(environ: Mapping[str, str]) -> int:
    """Return HPCDDP_STRAGGLER_EVERY: steps between straggler reports (``hpcddp.observe.stragglers``); 0 is off.

    Args:
        environ: the environment to read.
    """
    expected = (
        f"0 (straggler reports off) or a whole number of steps >= {MIN_STRAGGLER_STEPS} "
        "(a report needs the medians of that many)"
    )
    return read_value(environ, "HPCDDP_STRAGGLER_EVERY", _report_steps, expected, DEFAULT_STRAGGLER_EVERY)


def read_torchrun_env_switch(environ: Mapping[str, str]) -> bool:
    """Return HPCDDP_TORCHRUN_ENV: whether a rank that mpirun or srun started gets torchrun's variables at start.

    On (1) by default; 0 turns off what the installed ``hpcddp-torchrun-env.pth`` does
    (``hpcddp run`` and ``slurm/train.sh`` export them anyway).

    Args:
        environ: the environment to read.
    """
    raw = environ.get("HPCDDP_TORCHRUN_ENV", "").strip().lower()
    return _switch("HPCDDP_TORCHRUN_ENV", raw) if raw else True


def run_status_dir(environ: Mapping[str, str]) -> str | None:
    """Return the status directory ``hpcddp run`` gave this rank, or None (see ``hpcddp.fault.run_status``)."""
    return environ.get(RUN_STATUS_VARIABLE) or None


def read_run_id(environ: Mapping[str, str]) -> str | None:
    """Return the run this job belongs to (HPCDDP_RUN_ID, which slurm/train.sh sets), or None.

    Args:
        environ: the environment to read.
    """
    return environ.get("HPCDDP_RUN_ID", "").strip() or None


def read_slurm_node_address(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """Return (node, address) from HPCDDP_SLURM_NODE_ADDR ("node=address"), or None when unset or malformed.

    slurm/train.sh looks up the job's first node's NodeAddr once (``scontrol show node``)
    and hands it to every task this way, so that srun's tasks do not each ask slurmctld.

    Args:
        environ: the environment to read.
    """
    node, _, address = environ.get("HPCDDP_SLURM_NODE_ADDR", "").strip().partition("=")
    return (node, address) if node and address else None


def read_resume_policy(environ: Mapping[str, str]) -> str | None:
    """Return HPCDDP_RESUME (one of ``RESUME_POLICIES``), or None when unset.

    Args:
        environ: the environment to read.
    """
    policy = environ.get("HPCDDP_RESUME", "").strip().lower()
    if policy and policy not in RESUME_POLICIES:
        choices = ", ".join(RESUME_POLICIES)
        raise ValueError(f"environment variable HPCDDP_RESUME must be one of {choices}, got {policy!r}")
    return policy or None
