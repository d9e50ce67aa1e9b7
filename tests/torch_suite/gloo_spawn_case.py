"""torch's spawn-per-test case for the suite (imported by ``gloo_reference`` after it sets BACKEND).

A module of its own: the spawned processes import the test class by this module's name.
"""

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class GlooWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Each test in ``WORLD_SIZE`` fresh processes, as torch's ``test_distributed_spawn.py``."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()
