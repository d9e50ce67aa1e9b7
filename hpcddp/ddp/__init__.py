"""The DDP-compatible optimizer: a gradient's road from autograd hook to optimizer step.

- ``optimizer``: ``DistributedOptimizer``, the facade a training loop sees;
- ``reducer``: the reduction state machine (hooks, bucket launch order, waiting, join state);
- ``buckets`` and ``slots``: bucket assignment, flat buffers, each gradient's view;
- ``control``: the numbers that ride with the last bucket (join, unfrozen parameters,
  non-finite gradients); ``timing``: when each bucket went and came back;
- ``join``: ``hpcddp.join`` for ranks with uneven data; ``trainable``, ``consistency``,
  ``optimizer_args``, ``autograd_hooks``: the checks and autograd plumbing around them.
"""
