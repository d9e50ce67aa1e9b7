"""The variables ``hpcddp run --min-np`` gives its ranks: how they reach the elastic driver.

Read here only (hpcddp reads its environment in ``hpcddp.env``); ``hpcddp.elastic.worker``
uses the result. A rank started by any other launcher has no session: commits then live
in memory, as in Horovod without its elastic launcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["DRIVER_VARIABLE", "ElasticSession", "read_elastic_session"]

#: ``addr1,addr2,...:port`` of the driver's socket (every address of the launching host)
DRIVER_VARIABLE = "HPCDDP_ELASTIC_DRIVER"
#: a secret that the driver checks on every connection (no stray process joins the job)
TOKEN_VARIABLE = "HPCDDP_ELASTIC_TOKEN"
#: the elastic run: names the node-local directory that keeps its commits
RUN_VARIABLE = "HPCDDP_ELASTIC_RUN"
#: which start of the job this is (0, 1, ...): ranks of a later start look for commits
LAUNCH_VARIABLE = "HPCDDP_ELASTIC_LAUNCH"
#: where commits are kept on each node (default /dev/shm: node-local memory)
COMMIT_DIR_VARIABLE = "HPCDDP_ELASTIC_COMMIT_DIR"


@dataclass(frozen=True)
class ElasticSession:
    """What a rank of an elastic job needs to know about its driver."""

    addresses: tuple[str, ...]
    """The driver's addresses, tried in order."""
    port: int
    """The driver's port."""
    token: str = field(repr=False)
    """The secret the driver checks (kept out of the repr: a logged session must not show it)."""
    run: str
    """The elastic run's name."""
    launch: int
    """Which start of the job this is."""
    commit_dir: str | None
    """Where commits are kept on each node; None: ``default_commit_root()``."""


def read_elastic_session(environ: Mapping[str, str]) -> ElasticSession | None:
    """Return this rank's elastic session, or None when no elastic driver started it.

    Args:
        environ: the environment to read.
    """
    raw = environ.get(DRIVER_VARIABLE, "").strip()
    if not raw:
        return None
    hosts, _, port = raw.rpartition(":")
    if not hosts or not port.isdigit():
        raise ValueError(f"environment variable {DRIVER_VARIABLE} must look like 10.0.0.1,127.0.0.1:45000, got {raw!r}")
    launch = environ.get(LAUNCH_VARIABLE, "0").strip() or "0"
    if not launch.isdigit():
        raise ValueError(f"environment variable {LAUNCH_VARIABLE} must be a count >= 0, got {launch!r}")
    return ElasticSession(
        addresses=tuple(a for a in hosts.split(",") if a),
        port=int(port),
        token=environ.get(TOKEN_VARIABLE, ""),
        run=environ.get(RUN_VARIABLE, "").strip() or "default",
        launch=int(launch),
        commit_dir=environ.get(COMMIT_DIR_VARIABLE, "").strip() or None,
    )
