"""``init_process_group("mpi")`` in a script that never calls ``hpcddp.init()``.

torch's wheels have no MPI of their own; hpcddp serves the name once ``hpcddp.init()``
ran. Scripts written for a source-built torch call ``init_process_group("mpi")``
straight away. ``enable()`` makes that call run ``hpcddp.init()`` first. It runs
at ``import hpcddp`` and, for scripts that never import hpcddp, from the
``sitecustomize`` that ``hpcddp run`` and ``slurm/train.sh`` put on ``PYTHONPATH``
(``hpcddp/_site``; ``python -m hpcddp._site`` prints its path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch.distributed import distributed_c10d as c10d

__all__ = ["enable"]

_SERVED = ("mpi", "hpcddp")
_busy = False  # hpcddp.init() itself may make a gloo/NCCL group: that call passes straight through


def _names_mpi(backend) -> bool:
    # "cpu:mpi,cuda:nccl" names a backend per device; any "mpi" in it needs hpcddp.
    if backend is None:
        return False
    parts = str(backend).lower().replace(",", " ").split()
    return any(part.rpartition(":")[2] in _SERVED for part in parts)


def enable(init: Callable[[], None]) -> None:
    """Make ``init_process_group`` with ``"mpi"`` or ``"hpcddp"`` call ``init`` first (idempotent).

    Args:
        init: ``hpcddp.init`` (passed in: the backend is one of the features ``init`` starts).
    """
    if getattr(c10d.init_process_group, "__hpcddp_autoinit__", False):
        return
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        global _busy
        from ..runtime import state

        if _busy or state.is_initialized() or not _names_mpi(backend):
            return original(backend, *args, **kwargs)
        _busy = True
        try:
            init()
        finally:
            _busy = False
        # init() installed the backend and may have wrapped this function again: call what is there now.
        return c10d.init_process_group(backend, *args, **kwargs)

    init_process_group.__hpcddp_autoinit__ = True
    import torch.distributed as dist

    c10d.init_process_group = dist.init_process_group = init_process_group
