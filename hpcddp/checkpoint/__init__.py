"""Checkpoints that survive preemption and exact resume.

- ``store``: ``save_checkpoint`` (atomic, on rank 0), ``load_checkpoint`` (collective:
  the newest intact step, read on rank 0), ``check_checkpoint_dir``;
- ``reading``: a checkpoint read once per job, checked once, its bytes shared with
  every rank (once per node on MPI);
- ``resume``: what an exact resume needs (``training_state``), and restoring it;
- ``identity``: which run a checkpoint belongs to, and whether this job may resume it
  (HPCDDP_RUN_ID, HPCDDP_RESUME);
- ``checksum``, ``owner``: the integrity check and the claim of a directory by one job
  (the atomic write itself, and reading without following a link, is ``hpcddp.env.files``);
- ``loadable``: what ``load_checkpoint``'s default (``weights_only=True``) reads back,
  checked before a save.
"""

from .resume import TrainingProgress, restore_training_state, training_state
from .store import check_checkpoint_dir, find_checkpoints, load_checkpoint, save_checkpoint

__all__ = [
    "TrainingProgress",
    "check_checkpoint_dir",
    "find_checkpoints",
    "load_checkpoint",
    "restore_training_state",
    "save_checkpoint",
    "training_state",
]
