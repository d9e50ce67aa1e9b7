"""Run on every rank of an mpirun job started by tests/gpu/test_gpu_suite.py; plumbing in hpcddp.testing.ranks.

The ranks share one GPU (or, with HPCDDP_GPU_SUITE_DEVICE=cpu, run the suite's CPU-runnable
tests on the CPU as a dry run).
"""

import os

import pytest
import torch

import hpcddp

#: "cuda" on the GPU machine; "cpu" runs what needs no GPU, as a dry run
SUITE_DEVICE = os.environ.get("HPCDDP_GPU_SUITE_DEVICE", "cuda")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Before hpcddp.testing.ranks' own init() (then a no-op): two ranks share the one GPU.
    if SUITE_DEVICE == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU suite's ranks found no CUDA GPU: set HPCDDP_GPU_SUITE_DEVICE=cpu for a dry run")
    hpcddp.init(allow_gpu_sharing=True)
