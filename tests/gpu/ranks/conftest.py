"""Run on every rank of an mpirun job started by tests/gpu/test_gpu_suite.py; plumbing in hpcddp.testing.ranks.

The ranks share one GPU (or, with HPCDDP_GPU_SUITE_DEVICE=cpu, run the suite's CPU-runnable
tests on the CPU as a rehearsal).
"""

import os

import pytest
import torch

import hpcddp

#: "cuda" on the GPU machine; "cpu" runs what needs no GPU, as a rehearsal
SUITE_DEVICE = os.environ.get("HPCDDP_GPU_SUITE_DEVICE", "cuda")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Before hpcddp.testing.ranks' own init() (then a no-op): two ranks share the one GPU.
    if SUITE_DEVICE == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU suite's ranks found no CUDA GPU: set HPCDDP_GPU_SUITE_DEVICE=cpu for a rehearsal")
    hpcddp.init(allow_gpu_sharing=True)
    # The tests compare with references at atol 1e-4..1e-5: TF32 matmuls and convolutions
    # (on by default for cuDNN) round to 10 mantissa bits, and cuDNN's autotuner may pick
    # another algorithm per call; both would make the comparisons depend on the GPU.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


@pytest.fixture(autouse=True)
def _same_seed_on_every_rank():
    """Every test starts from the same random state on every rank (PowerSGD's start, dropout)."""
    torch.manual_seed(0)


def pytest_collection_finish(session):
    # tests/gpu/test_gpu_suite.py reads this line: a test no launch reached is "not run" in
    # the summary, not absent from it. One rank says it; they all collect the same tests.
    if hpcddp.rank() == 0:
        nodeids = " ".join(item.nodeid for item in session.items)
        # Through the terminal reporter: pytest captures a hook's print during collection.
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(f"[gpu-suite] collected: {nodeids}")
