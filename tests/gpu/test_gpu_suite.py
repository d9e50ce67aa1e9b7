"""The GPU suite on one GPU: 2 ranks sharing it over mpi, then nccl at world size 1 (each one mpirun job).

Skipped without CUDA. ``HPCDDP_GPU_SUITE_DEVICE=cpu`` runs the 2-rank job on the CPU instead,
where the tests that need CUDA skip: a dry run of the suite's plumbing and CPU-runnable tests.
"""

import os

import pytest
import torch

from hpcddp.testing import assert_pytest_passed, run_pytest_on_ranks

from ..conftest import ROOT

SUITE_DEVICE = os.environ.get("HPCDDP_GPU_SUITE_DEVICE", "cuda")
# Each job's limit; together well inside run_gpu_suite.sh's 8 minutes on a GPU machine.
MPI_JOB_LIMIT_S = 300
NCCL_JOB_LIMIT_S = 150

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        SUITE_DEVICE == "cuda" and not torch.cuda.is_available(),
        reason=f"no CUDA GPU here (torch {torch.__version__}): tests/gpu/run_gpu_suite.sh runs this suite on a GPU "
        "machine; HPCDDP_GPU_SUITE_DEVICE=cpu dry-runs its CPU-runnable part",
    ),
]


def test_two_ranks_sharing_the_gpu_over_mpi():
    env = {"HPCDDP_BACKEND": "mpi", "HPCDDP_GPU_SUITE_DEVICE": SUITE_DEVICE}
    if SUITE_DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = run_pytest_on_ranks(2, ["tests/gpu/ranks/test_mpi_ranks.py"], timeout=MPI_JOB_LIMIT_S, cwd=ROOT, env=env)
    print(result.stdout[-6000:])
    assert_pytest_passed(result)


def test_nccl_at_world_size_one():
    if SUITE_DEVICE != "cuda":
        pytest.skip("nccl needs CUDA")
    env = {"HPCDDP_BACKEND": "nccl", "HPCDDP_GPU_SUITE_DEVICE": "cuda"}
    result = run_pytest_on_ranks(1, ["tests/gpu/ranks/test_nccl_rank.py"], timeout=NCCL_JOB_LIMIT_S, cwd=ROOT, env=env)
    print(result.stdout[-6000:])
    assert_pytest_passed(result)
