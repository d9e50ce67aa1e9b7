"""A gloo job's end and a new start: leaving torch.distributed itself, and init() again after shutdown()."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hpcddp.testing import run_script

from .conftest import LAUNCHER_VARIABLES, ROOT

pytestmark = pytest.mark.ranks

SCRIPT = """
    import torch, torch.nn.functional as F, torch.distributed as dist
    import hpcddp

    hpcddp.init(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), bucket_cap_mb=0.05, first_bucket_mb=0.02
    )
    for _ in range(50):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(8, 128)), torch.zeros(8, 128)).backward()
        optimizer.step()
        hpcddp.allreduce(torch.ones(1))
    dist.destroy_process_group()  # the script's own cleanup; hpcddp's exit hook must cope
    print("finished", hpcddp.rank(), len(optimizer.buckets), flush=True)
"""


def test_script_destroying_the_process_group_itself_exits_with_0(tmp_path):
    result = run_script(2, SCRIPT, tmp_path, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "finished 0" in result.stdout and "finished 1" in result.stdout


REINIT = """
    import os, socket
    import torch
    import hpcddp.horovod as hvd

    rank_0_port = os.environ.get("TEST_RANK_0_PORT") and os.environ["OMPI_COMM_WORLD_RANK"] == "0"
    if rank_0_port:  # the user's MASTER_PORT, on rank 0 only
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    kept = []
    for _ in range(3):
        hvd.init()
        if not os.environ.get("TEST_RANK_0_PORT"):  # (a user's port held by an old group is the user's to free)
            kept.append(hvd.allreduce_async(torch.ones(2), name="never synchronized"))  # keeps the old group alive
        print("summed", hvd.rank(), hvd.allreduce(torch.full((2,), 1.0 + hvd.rank()), op=hvd.Sum).tolist(), flush=True)
        hvd.shutdown()
"""


def assert_summed_three_times(outputs: str) -> None:
    for rank in range(2):
        assert outputs.count(f"summed {rank} [3.0, 3.0]") == 3, outputs[-5000:]


@pytest.mark.parametrize(
    "case",
    [
        # The second init() served the port the first had chosen, still held by the old group's
        # store: "cannot serve the rendezvous on port ... Address already in use".
        {},
        # Rank 0 chooses the port for every rank. Rank 1, which had exported rank 0's port as
        # its own choice, moved off it alone at the second init() and could not reach rank 0.
        {"TEST_RANK_0_PORT": "1"},
    ],
    ids=["old-group-alive", "master-port-on-rank-0-only"],
)
def test_init_after_shutdown_under_mpirun_meets_on_one_new_port(tmp_path, case):
    result = run_script(2, REINIT, tmp_path, timeout=180, cwd=ROOT, env={"HPCDDP_BACKEND": "gloo", **case})
    assert result.returncode == 0, result.stdout[-5000:]
    assert_summed_three_times(result.stdout)


def test_init_after_shutdown_under_srun_moves_off_the_port_it_derived_from_the_job_id(tmp_path):
    # Under srun every task derives the port from the job id, the same at every init(): the second
    # init() failed as above. Two tasks with srun's variables, no MPI launcher (a one-node srun).
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(REINIT))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PRTE_", "MASTER_"))}
    clean = {k: v for k, v in clean.items() if k not in LAUNCHER_VARIABLES}
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
    slurm |= {"SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}
    logs = [tmp_path / f"task{r}.log" for r in range(2)]
    tasks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**clean, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "HPCDDP_BACKEND": "gloo"},
            stdout=logs[r].open("w"),
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 120
    try:  # until both end, one fails (its peer would wait out the rendezvous), or the time is up
        while time.monotonic() < deadline and not all(t.poll() == 0 for t in tasks):
            if any(t.poll() not in (None, 0) for t in tasks):
                break
            time.sleep(0.2)
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    outputs = "\n".join(log.read_text() for log in logs)
    assert [task.returncode for task in tasks] == [0, 0], outputs[-5000:]
    assert_summed_three_times(outputs)
