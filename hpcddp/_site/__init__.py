"""The folder ``hpcddp run`` puts first on ``PYTHONPATH``: its ``sitecustomize`` routes
``init_process_group("mpi")`` to hpcddp in scripts that never call ``hpcddp.init()``."""

import os

#: this folder
SITE_DIR = os.path.dirname(os.path.abspath(__file__))


def with_site_dir(pythonpath: str | None) -> str:
    """Return ``pythonpath`` with ``SITE_DIR`` first (once)."""
    rest = [entry for entry in (pythonpath or "").split(os.pathsep) if entry and entry != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *rest])
