"""What the launcher says about this process's GPUs (Slurm's per-task binding)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["gpus_bound_per_task"]


def gpus_bound_per_task(environ: Mapping[str, str]) -> bool:
    """Return True when srun bound this task to GPUs of its own (``--gpus-per-task`` without ``--gpu-bind=none``).

    Each task then sees its own GPUs from cuda:0 on, and the other tasks of its node
    see others. Only needed where MPI cannot ask the node's ranks what they see (srun
    without MPI); torchrun's workers inherit their agent's CUDA_VISIBLE_DEVICES, all alike.

    Args:
        environ: the environment to read.
    """
    if "TORCHELASTIC_RUN_ID" in environ or "SLURM_PROCID" not in environ:
        return False
    if not environ.get("CUDA_VISIBLE_DEVICES", "").strip() or not environ.get("SLURM_GPUS_PER_TASK", "").strip():
        return False
    return "none" not in environ.get("SLURM_GPU_BIND", "").lower()
