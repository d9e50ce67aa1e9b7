"""The runtime: how a process becomes a rank of the job, and what it then knows.

- ``lifecycle``: ``hpcddp.init()`` / ``hpcddp.shutdown()``, which start the rank and
  then the features that hang off a started job;
- ``bootstrap``: environment -> ranks -> device -> backend -> communicator -> threads;
- ``state``: the running job (rank, size, device, communicator) and ``at_shutdown``;
- ``config``: ``InitConfig``, the validated settings; ``device``: GPU mapping and CPU
  threads per rank.

Nothing here imports the features (stall inspector, torch backend, timeline) except
``lifecycle``, which composes them.
"""
