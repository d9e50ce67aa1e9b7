"""Horovod's elastic API on hpcddp: ``hvd.elastic.run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``.

A Horovod elastic script runs with only its import changed, under
``hpcddp run -np 4 --min-np 2 --host-discovery-script ./hosts.sh train.py`` (or a
fixed ``--hostfile``/``-H``). See docs/guide/elastic.md for how a job shrinks and grows.
"""

from ..basics import HostsUpdatedInterrupt
from .run import run
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]
