"""What happens when something goes wrong: a job ends promptly, on every rank, with a reason.

- ``abort``: an uncaught exception or exit on one rank ends the whole job, traceback once;
- ``stall``: the inspector that names the ranks others wait for, and ends a deadlocked job;
- ``preemption``: SIGTERM/SIGUSR1 -> checkpoint at the next step -> requeue;
- ``supervise`` and ``run_status``: ``hpcddp run`` watching its ranks and reporting how they ended;
- ``launcher_process``: ending a launcher with all it started, and removing what a killed mpirun leaves.
"""
