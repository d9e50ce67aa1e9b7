"""A real one-node Slurm cluster: srun bootstrap, sbatch slurm/train.sh with both launchers, preemption and requeue.

The cluster comes from slurm/testing/start_cluster.sh (root, Debian: it installs Slurm and
starts daemons with a slurm.conf and ports of their own, beside any Slurm of the host's own),
so outside CI these tests run only with HPCDDP_SLURM_TESTS=1.
In CI (CI=true) they always run, and a cluster that cannot start fails them.
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from . import framework_jobs
from .cluster_jobs import (
    assert_resumed_to_the_same_parameters,
    one_node_environment,
    outcome,
    preempt_together,
    require_cluster_tests,
    start,
    submit,
)
from .conftest import ROOT

pytestmark = pytest.mark.system

START = os.path.join(ROOT, "slurm", "testing", "start_cluster.sh")
STOP = os.path.join(ROOT, "slurm", "testing", "stop_cluster.sh")
LAUNCHERS = ["srun", "mpirun"]
NUM_STEPS = 12 * 22  # examples/train.py's default 12 epochs of 22 steps


@pytest.fixture(scope="session")
def slurm_cluster():
    require_cluster_tests()
    already_up = _controller_answers()
    start(START)
    yield
    if not already_up:  # leave the host as the session found it
        subprocess.run(["bash", STOP], capture_output=True, timeout=120)


def _controller_answers() -> bool:
    env = one_node_environment()  # the one-node cluster's controller, not a site's on this host
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=10, env=env).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def slurm_env(slurm_cluster):
    return one_node_environment()


def test_a_slurm_on_slurms_default_ports_leaves_the_cluster_its_own(slurm_env):
    """A site's Slurm holds 6817 and 6818 (stand-ins where they are free): start_cluster.sh starts this cluster all the same."""
    held = []
    try:
        for port in (6817, 6818):
            sock = socket.socket()
            try:
                sock.bind(("0.0.0.0", port))
                sock.listen()
                held.append(sock)
            except OSError:  # a Slurm of this host's own holds it already
                sock.close()
        result = subprocess.run(["bash", START], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        shown = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30, env=slurm_env
        )
        config = dict(re.findall(r"^(\w+)\s+= (\S+)", shown.stdout, flags=re.M))
        assert config["ClusterName"] == "hpcddp" and config["SLURM_CONF"] == slurm_env["SLURM_CONF"], config
        assert config["SlurmctldPort"] not in ("6817", "6818") and config["SlurmdPort"] not in ("6817", "6818"), config
        ran = subprocess.run(
            ["srun", "-n", "2", "hostname"], capture_output=True, text=True, timeout=120, env=slurm_env
        )
        assert ran.returncode == 0 and len(ran.stdout.split()) == 2, ran.stdout + ran.stderr
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("mpi, backend", [("pmix", "mpi"), ("pmi2", "gloo"), ("none", "gloo")])
def test_srun_ranks_are_distinct_with_every_mpi_plugin(slurm_env, mpi, backend):
    code = "import hpcddp; hpcddp.init(); print('rank', hpcddp.rank(), hpcddp.size(), hpcddp.backend(), flush=True)"
    result = subprocess.run(
        ["srun", "-n", "2", f"--mpi={mpi}", "--kill-on-bad-exit=1", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env=slurm_env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank 0 2 {backend}", f"rank 1 2 {backend}"], result.stdout + result.stderr


TORCH_DDP_UNDER_SRUN = """
import torch, torch.distributed as dist, hpcddp
hpcddp.init()
dist.init_process_group("mpi")  # the tutorials' line, on hpcddp's backend
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).double())
x = torch.full((3, 4), float(dist.get_rank() + 1), dtype=torch.float64)
model(x).sum().backward()
grad = model.module.weight.grad.clone()
dist.broadcast(grad, src=0)
assert torch.equal(grad, model.module.weight.grad), "ranks hold different averaged gradients"
print("ddp", dist.get_backend(), dist.get_rank(), dist.get_world_size(), grad[0, 0].item(), flush=True)
"""


def test_torch_ddp_on_the_mpi_backend_under_srun_pmix(slurm_env):
    result = subprocess.run(
        ["srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", sys.executable, "-c", TORCH_DDP_UNDER_SRUN],
        capture_output=True,
        text=True,
        timeout=180,
        env=slurm_env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("ddp "))
    # Rows of x are 1 on rank 0 and 2 on rank 1: d(sum)/dW averages to 3 rows x 1.5.
    assert lines == ["ddp mpi 0 2 4.5", "ddp mpi 1 2 4.5"], result.stdout + result.stderr


@pytest.fixture(scope="session")
def uninterrupted():
    """Final parameters of each launcher's uninterrupted run (filled by the sbatch --wait test)."""
    return {}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sbatch_trains_to_95_percent_on_distinct_ranks(slurm_env, tmp_path, launcher, uninterrupted):
    job, rc, output = submit(
        slurm_env, tmp_path, launcher, "--json", str(tmp_path / "m.json"), "--save-final", str(tmp_path / "final.pt")
    )
    log = output.read_text() if output.exists() else "(no output file)"
    assert rc == 0, f"job {job} exited {rc}:\n{log[-5000:]}"
    assert f"launcher {launcher}" in log
    ranks = re.findall(r"^rank (\d+)/(\d+) on \S+, backend (\w+)", log, flags=re.M)
    assert sorted(ranks) == [("0", "2", "mpi"), ("1", "2", "mpi")], log[-5000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["world_size"] == 2 and metrics["completed"] and metrics["step"] == NUM_STEPS, metrics
    assert metrics["test_accuracy"] >= 0.95, metrics
    uninterrupted[launcher] = torch.load(tmp_path / "final.pt")


@pytest.fixture(scope="module")
def usr1_jobs(slurm_cluster, tmp_path_factory):
    """Each launcher's job of the test below, all at once: (its final.pt, preempt_and_wait's result or error).

    A job's checkpoint, USR1, requeue and resumed run take about 55 s, mostly spent waiting for
    Slurm; two 2-task jobs fit the cluster's 8 CPUs together. Each test asserts on its own job only.
    """
    env = one_node_environment()  # as slurm_env
    jobs = {}
    try:
        for launcher in LAUNCHERS:
            tmp_path = tmp_path_factory.mktemp(f"usr1_{launcher}")
            args = ["--slow", "0.05", "--checkpoint-every", "4", "--save-final", str(tmp_path / "final.pt")]
            job, _, output = submit(env, tmp_path, launcher, *args, wait=False, timeout=60)
            jobs[launcher] = (tmp_path, job, output, "checkpoint-000004.pt")
        outcomes = preempt_together(env, jobs)
    finally:
        for _, job, _, _ in jobs.values():
            subprocess.run(["scancel", job], timeout=30, env=env)
    return {launcher: (tmp_path / "final.pt", outcomes[launcher]) for launcher, (tmp_path, *_) in jobs.items()}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_usr1_checkpoints_requeues_and_resumes_to_the_same_parameters(
    slurm_env, tmp_path, launcher, uninterrupted, usr1_jobs
):
    if launcher not in uninterrupted:  # run alone: make the uninterrupted run first
        (tmp_path / "plain").mkdir()
        test_sbatch_trains_to_95_percent_on_distinct_ranks(slurm_env, tmp_path / "plain", launcher, uninterrupted)
    final, result = usr1_jobs[launcher]  # this launcher's job, run beside the other launcher's
    last, states, log = outcome(result)
    assert_resumed_to_the_same_parameters(last, states, log, uninterrupted[launcher], final, NUM_STEPS, 2)


@pytest.fixture(scope="session")
def lightning_on_gloo(tmp_path_factory):
    """The Lightning job's results under torchrun over gloo, the reference of the sbatch runs."""
    framework_jobs.require("lightning")
    return framework_jobs.run_reference("lightning", tmp_path_factory.mktemp("lightning_gloo"))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_lightning_recipe_under_sbatch_trains_on_distinct_ranks(slurm_env, tmp_path, launcher, lightning_on_gloo):
    # Under mpirun in a batch job every rank inherits the batch step's SLURM_PROCID (0), and
    # Lightning's own SLURMEnvironment would give every rank rank 0's shard of the data: the
    # recipe's MPIEnvironment plugin takes the ranks from MPI under either launcher.
    env = {**slurm_env, **framework_jobs.JOB_ENV}
    script = framework_jobs.script("lightning")
    job, rc, output = submit(env, tmp_path, launcher, "mpi", str(tmp_path), script=script)
    log = output.read_text() if output.exists() else "(no output file)"
    assert rc == 0, f"job {job} exited {rc}:\n{log[-5000:]}"
    mpi = framework_jobs.results(tmp_path)
    assert [r["lightning_rank"] for r in mpi] == [0, 1], log[-5000:]
    framework_jobs.assert_same_training(mpi, lightning_on_gloo, 16)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_unchanged_torchrun_script_under_sbatch(slurm_env, tmp_path, launcher):
    """A script written for torchrun (RANK, LOCAL_RANK, MASTER_ADDR read at its top; gloo) through slurm/train.sh."""
    from .test_torchrun import UNCHANGED_EXPECTED, UNCHANGED_SCRIPT, results

    script = tmp_path / "torchrun_style.py"
    script.write_text(UNCHANGED_SCRIPT)
    job, rc, output = submit(slurm_env, tmp_path, launcher, script=str(script), timeout=240)
    log = output.read_text() if output.exists() else "(no output file)"
    assert rc == 0, f"job {job} exited {rc}:\n{log[-5000:]}"
    assert results(log) == UNCHANGED_EXPECTED, log[-5000:]
