"""The GPU suite (marker ``gpu``); tests/gpu/run_gpu_suite.sh runs it on a machine with a GPU.

tests/gpu/ranks holds what runs on every rank of its mpirun jobs: collected only there.
"""

import os

collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["ranks"]
