"""The GPU suite (marker ``gpu``); tests/gpu/run_gpu_suite.sh runs it on a machine with a GPU.

tests/gpu/ranks holds what runs on every rank of its mpirun jobs: collected only there.
"""

import os
import signal

import pytest

collect_ignore = [] if os.environ.get("HPCDDP_MPI_TESTS") else ["ranks"]

#: HPCDDP_GPU_SUITE_BIND=0 (run_gpu_suite.sh's default): mpirun starts the suite's ranks unbound.
#: Binding (hpcddp.cli.launch: ``--map-by slot:PE=N:HWTCPUS --bind-to hwthread``) was never
#: tried under the GPU machine's sandbox, and the ranks share its one GPU anyway.
BIND = os.environ.get("HPCDDP_GPU_SUITE_BIND", "1") != "0"
#: without hpcddp's binding flags Open MPI 5 still binds up to 2 ranks to a core each: its
#: launcher (PRRTE) reads this instead of ``--bind-to none``
UNBOUND_ENV = {} if BIND else {"PRTE_MCA_hwloc_default_binding_policy": "none"}


#: where run_gpu_suite.sh runs the suite: "cuda" (a GPU; the default) or "cpu" (the rehearsal)
SUITE_DEVICE = os.environ.get("HPCDDP_GPU_SUITE_DEVICE", "cuda")


@pytest.fixture
def cuda_where_the_suite_asks_for_it():
    """No CUDA: a failure where run_gpu_suite.sh asked for it (a device that lost its GPU must not pass), else a skip."""
    import torch

    if SUITE_DEVICE != "cuda" or torch.cuda.is_available():
        return
    reason = f"no CUDA GPU here (torch {torch.__version__}, CUDA {torch.version.cuda})"
    if os.environ.get("HPCDDP_GPU_SUITE_DEVICE") == "cuda":
        pytest.fail(f"{reason}, and HPCDDP_GPU_SUITE_DEVICE=cuda asks for one (cpu rehearses the CPU part)")
    pytest.skip(f"{reason}: tests/gpu/run_gpu_suite.sh runs this on a GPU machine")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}: the GPU suite's time limit")


def pytest_configure(config):
    # Under run_gpu_suite.sh a stage's `timeout` ends pytest with SIGTERM. Python's default
    # would end it at once and orphan the mpirun job it waits for (hpcddp.testing starts it
    # in a session of its own); as KeyboardInterrupt, run_mpi ends the job first.
    if os.environ.get("HPCDDP_GPU_SUITE_RUN"):
        signal.signal(signal.SIGTERM, _interrupt)
