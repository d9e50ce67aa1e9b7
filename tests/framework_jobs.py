"""Launching the framework jobs of tests/frameworks: on hpcddp's "mpi" backend, and the gloo reference.

The reference runs the same script under ``torchrun`` with gloo, as the frameworks'
own documentation launches it; it never imports hpcddp.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from hpcddp.testing import run_mpi

from .cluster_jobs import CI
from .conftest import LAUNCHER_VARIABLES, ROOT

JOBS = os.path.join(ROOT, "tests", "frameworks")
NUM_RANKS = 2
# Seconds for one launch: a job took 8-19 s on a 2-core machine that other test runs shared
# (the frameworks' imports are most of it), and up to 55 s under a load of 7.
TIME_LIMIT_S = 180
# One thread per rank in both runs: the same kernels, so the parameters can match bit for bit.
JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def require(module: str) -> None:
    """Skip without ``module`` (pip install -e '.[frameworks]'); in CI, fail."""
    if importlib.util.find_spec(module) is None:
        reason = f"{module} is not installed: pip install -e '.[frameworks]'"
        if CI:
            pytest.fail(f"CI installs the frameworks extra (README's test command), but {reason}")
        pytest.skip(reason)


def script(name: str) -> str:
    """The path of tests/frameworks/<name>_job.py."""
    return os.path.join(JOBS, f"{name}_job.py")


def run_on_mpi(name: str, outdir) -> list[dict]:
    """Run job ``name`` on hpcddp's "mpi" backend under mpirun; return each rank's result."""
    os.makedirs(outdir, exist_ok=True)
    command = [sys.executable, script(name), "mpi", str(outdir)]
    result = run_mpi(NUM_RANKS, command, timeout=TIME_LIMIT_S, env=JOB_ENV, cwd=ROOT)
    assert result.returncode == 0, f"{name} on the mpi backend failed:\n{result.stdout[-8000:]}"
    return results(outdir)


def run_reference(name: str, outdir) -> list[dict]:
    """Run job ``name`` over gloo under ``torchrun --standalone``; return each rank's result."""
    os.makedirs(outdir, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NUM_RANKS}"]
    command += [script(name), "gloo", str(outdir)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("OMPI_")}
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, **JOB_ENV},
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        out = _stop_torchrun(proc)
        pytest.fail(f"{name} under torchrun did not finish in {TIME_LIMIT_S} s:\n{out[-8000:]}")
    assert proc.returncode == 0, f"{name} under torchrun with gloo failed:\n{out[-8000:]}"
    return results(outdir)


def _stop_torchrun(proc: subprocess.Popen) -> str:
    """End torchrun and its workers; return what they printed.

    torchrun starts each worker in a session of its own: SIGTERM lets torchrun end them
    (it waits 30 s for them, then kills them); whatever is left is killed by its pid.
    """
    workers = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return out


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as file:
            found += [int(child) for child in file.read().split()]
    return found


def results(outdir) -> list[dict]:
    """Each rank's rank<R>.json, with its final parameters under "state"."""
    found = []
    for rank in range(NUM_RANKS):
        with open(os.path.join(outdir, f"rank{rank}.json")) as file:
            info = json.load(file)
        info["state"] = torch.load(os.path.join(outdir, f"rank{rank}.pt"))
        found.append(info)
    return found


def assert_same_training(mpi: list[dict], gloo: list[dict], num_steps: int) -> None:
    """Both runs took ``num_steps`` steps on 2 ranks and every rank of both ends with the same parameters, bitwise."""
    for run, backend in ((mpi, "mpi"), (gloo, "gloo")):
        assert [(r["rank"], r["world_size"], r["backend"], r["steps"]) for r in run] == [
            (rank, NUM_RANKS, backend, num_steps) for rank in range(NUM_RANKS)
        ], [{k: v for k, v in r.items() if k != "state"} for r in run]
    # The "mpi" run went through hpcddp's group, and its collectives through hpcddp's communicator.
    assert all(r["group"] == "ProcessGroupHPCDDP" and r["hpcddp_operations"] >= num_steps for r in mpi), mpi
    expected = gloo[0]["state"]
    for run, backend in ((mpi, "mpi"), (gloo, "gloo")):
        for info in run:
            assert info["state"].keys() == expected.keys()
            for name, value in info["state"].items():
                torch.testing.assert_close(
                    value, expected[name], rtol=0, atol=0, msg=f"{name} on rank {info['rank']} of the {backend} run"
                )
