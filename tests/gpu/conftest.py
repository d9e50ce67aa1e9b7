"""The GPU suite (marker ``gpu``); tests/gpu/run_gpu_suite.sh runs it on a machine with a GPU.

tests/gpu/ranks holds what runs on every rank of its mpirun jobs: collected only there.
"""

import os
import signal

collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["ranks"]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the GPU suite's time limit")


def pytest_configure(config):
    # Under run_gpu_suite.sh a stage's `timeout` ends pytest with SIGTERM. Python's default
    # would end it at once and orphan the mpirun job it waits for (hpcddp.testing starts it
    # in a session of its own); as KeyboardInterrupt, run_mpi ends the job first.
    if os.environ.get("HPCDDP_GPU_SUITE_RUN"):
        signal.signal(signal.SIGTERM, _interrupt)
