"""Gradient compression in DistributedOptimizer: PowerSGD and int8, each with error feedback.

(``compression="fp16"``/``"bf16"`` only change the dtype buckets travel in: see buckets.py.)
"""

from .int8 import Int8
from .powersgd import PowerSGD
from .staged import BucketCodec, Compressor, StagedReduction

__all__ = ["BucketCodec", "Compressor", "Int8", "PowerSGD", "StagedReduction"]
