"""torch's own distributed test suite (``DistributedTest._DistTestBase``) run on MPI ranks.

``rank_main`` is what each rank runs under mpirun; ``driver`` launches it, watches
every test finish, and starts the job again after a test that hung or crashed, so
that such a test costs only itself.
"""
