"""Start-up on GPU nodes, on CPU: which GPU each rank takes and which backend the job agrees on (issue 34).

The inventory is faked where torch reports it (``torch.cuda.get_device_properties``: UUID and
PCI address per visible device), so ``hpcddp.init()`` runs its real start-up path. The
expected answers are CUDA's and NCCL's rules, written out by hand: each process sees its
devices from cuda:0 on; two MIG slices of one GPU have two UUIDs and one PCI address; NCCL
refuses two ranks at one PCI address ("Duplicate GPU detected"), and with one GPU per task
``torch.cuda.set_device(LOCAL_RANK)`` fails on every local rank >= 1.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

import hpcddp
from hpcddp.env.settings import read_settings
from hpcddp.runtime import state as runtime_state
from hpcddp.runtime.device import (
    GPU,
    JobDevices,
    NodePeer,
    check_gpu_sharing,
    choose_backend,
    place_rank,
)
from hpcddp.testing import run_script

from .conftest import ROOT

LAUNCHER_PREFIXES = ("OMPI_", "PMI", "PMIX_", "SLURM_", "MV2_", "MPI_LOCALNRANKS", "HPCDDP_", "TORCHELASTIC_")
LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_NAMES += ("GROUP_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES")


def fake_gpus(monkeypatch, devices):
    """Make torch report ``devices`` ((uuid, pci bus number) pairs) as this process's cuda:0, cuda:1, ..."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(uuid=devices[i][0], pci_domain_id=0, pci_bus_id=devices[i][1], pci_device_id=0),
    )
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


@pytest.fixture
def fresh(monkeypatch):
    """A process that hpcddp has not initialised, with no launcher variables."""
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(runtime_state, "_runtime", None)
    yield monkeypatch
    hpcddp.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def gpu(uuid, bus):
    return GPU(uuid, f"0000:{bus:02x}:00.0")


def agree(peers_per_node, allow_gpu_sharing=(False,)):
    """Every rank's placement and the job's agreement, as the MIN-allreduce in bootstrap computes it.

    ``allow_gpu_sharing``: each rank's setting, the last one repeated for the rest.
    """
    placed = []
    for peers in peers_per_node:
        for me in range(len(peers)):
            placed.append(place_rank(len(placed), me, peers))
    size = len(placed)
    allowed = [allow_gpu_sharing[min(r, len(allow_gpu_sharing) - 1)] for r in range(size)]
    numbers = [min(c) for c in zip(*(JobDevices.as_numbers(p, size, a) for p, a in zip(placed, allowed)))]
    return placed, JobDevices.from_numbers(numbers, size)


# -- which GPU a rank takes -----------------------------------------------------------


@pytest.mark.unit
def test_every_gpu_visible_gives_local_rank_i_cuda_i():
    node = [NodePeer((gpu("GPU-a", 1), gpu("GPU-b", 2)), frozenset({0}))] * 2
    placed, job = agree([node])
    assert [p.device for p in placed] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert choose_backend("auto", job, mpi_launched=True) == ("nccl", None)


@pytest.mark.unit
def test_one_gpu_per_task_gives_every_rank_cuda_0():
    # srun --gpus-per-task=1: rank i sees only its own GPU, as cuda:0.
    node = [NodePeer((gpu("GPU-a", 1),), frozenset()), NodePeer((gpu("GPU-b", 2),), frozenset())]
    placed, job = agree([node])
    assert [p.device for p in placed] == [torch.device("cuda", 0)] * 2
    assert not any(p.shares_gpu for p in placed)
    assert choose_backend("auto", job, mpi_launched=True) == ("nccl", None)


@pytest.mark.unit
def test_more_ranks_than_gpus_needs_sharing_and_auto_then_picks_mpi():
    node = [NodePeer((gpu("GPU-a", 1),), frozenset())] * 2
    placed, job = agree([node, [NodePeer((gpu("GPU-c", 1),), frozenset())]])
    assert [p.device for p in placed] == [torch.device("cuda", 0)] * 3
    with pytest.raises(RuntimeError) as error:
        check_gpu_sharing(job, placed[1])
    assert str(error.value) == (
        "rank 0 would share a GPU with another rank of its node (2 ranks, 1 GPU on this node): start at most one "
        "rank per GPU, or set HPCDDP_GPU_SHARING=1 (init(allow_gpu_sharing=True)) on every rank to share GPUs "
        "(backend 'auto' then picks mpi)"
    )
    # The rank on the other node has no share, but raises the same error (no rank goes on alone).
    with pytest.raises(RuntimeError, match="rank 0 would share a GPU"):
        check_gpu_sharing(job, placed[2])
    _, allowed = agree([node, [NodePeer((gpu("GPU-c", 1),), frozenset())]], allow_gpu_sharing=(True,))
    check_gpu_sharing(allowed, placed[0])
    backend, reason = choose_backend("auto", job, mpi_launched=True)
    assert backend == "mpi"
    assert reason == (
        "hpcddp: backend 'auto' chose mpi, not nccl: rank 0 shares its GPU (or MIG slices of one GPU) with another "
        "rank of its node, and NCCL takes one rank per GPU"
    )
    with pytest.raises(RuntimeError, match=r"backend='nccl' needs one GPU per rank, but rank 0 shares its GPU"):
        choose_backend("nccl", job, mpi_launched=True)


@pytest.mark.unit
def test_mig_slices_of_one_gpu_are_distinct_devices_but_not_for_nccl():
    # Each rank sees one MIG slice (CUDA enumerates one per process); both slices sit at one PCI address.
    node = [NodePeer((gpu("MIG-1", 0x3B),), frozenset()), NodePeer((gpu("MIG-2", 0x3B),), frozenset())]
    placed, job = agree([node])
    check_gpu_sharing(job, placed[0])  # not one device shared


@pytest.mark.unit
def test_sharing_allowed_on_some_ranks_only_raises_on_every_rank():
    # HPCDDP_GPU_SHARING=1 on rank 0 only: one decision for all, naming the rank that forbids it.
    node = [NodePeer((gpu("GPU-a", 1),), frozenset())] * 2
    placed, job = agree([node], allow_gpu_sharing=(True, False))
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match=r"^rank 0 would share a GPU .* on every rank \(rank 1 has it off\)"):
            check_gpu_sharing(job, placed[rank])
    assert [p.shares_pci_address for p in placed] == [True, True]
    assert choose_backend("auto", job, mpi_launched=True)[0] == "mpi"
    with pytest.raises(RuntimeError, match="NCCL takes one rank per GPU"):
        choose_backend("nccl", job, mpi_launched=True)


@pytest.mark.unit
def test_a_rank_without_cuda_makes_every_rank_agree_on_mpi():
    with_gpu = [NodePeer((gpu("GPU-a", 1),), frozenset())]
    without = [NodePeer((), frozenset())]
    placed, job = agree([with_gpu, without, with_gpu])
    assert [p.device.type for p in placed] == ["cuda", "cpu", "cuda"]
    assert choose_backend("auto", job, mpi_launched=True) == (
        "mpi",
        "hpcddp: backend 'auto' chose mpi, not nccl: rank 1 sees no GPU while rank 0 does",
    )
    with pytest.raises(RuntimeError, match="backend='nccl' needs one GPU per rank, but rank 1 sees no GPU"):
        choose_backend("nccl", job, mpi_launched=True)


@pytest.mark.unit
def test_gpu_sharing_knob():
    assert read_settings({"HPCDDP_GPU_SHARING": "1"}) == {"allow_gpu_sharing": True}
    assert read_settings({"HPCDDP_GPU_SHARING": "0"}) == {"allow_gpu_sharing": False}
    with pytest.raises(ValueError, match="environment variable HPCDDP_GPU_SHARING must be 0 or 1, got 'some'"):
        read_settings({"HPCDDP_GPU_SHARING": "some"})


# -- hpcddp.init() on a faked inventory -------------------------------------------------


def torchrun_rank(monkeypatch, rank, size):
    for name, value in {
        "RANK": rank,
        "WORLD_SIZE": size,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": size,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        "TORCHELASTIC_RUN_ID": "test",
    }.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.unit
def test_torchrun_ranks_that_all_see_cuda_visible_devices_0_share_it(fresh):
    # Every worker inherits torchrun's CUDA_VISIBLE_DEVICES=0: both would take that GPU.
    torchrun_rank(fresh, 1, 2)
    fresh.setenv("CUDA_VISIBLE_DEVICES", "0")
    fake_gpus(fresh, [("GPU-a", 1)])
    # Without MPI the ranks cannot be asked: each names itself.
    with pytest.raises(RuntimeError, match=r"^rank 1 would share a GPU .* set HPCDDP_GPU_SHARING=1"):
        hpcddp.init()


@pytest.mark.unit
def test_torchrun_ranks_sharing_a_gpu_on_request_run_gloo_and_say_so(fresh, caplog):
    torchrun_rank(fresh, 0, 2)
    fresh.setenv("CUDA_VISIBLE_DEVICES", "0")
    fresh.setenv("HPCDDP_GPU_SHARING", "1")
    chosen = fake_gpus(fresh, [("GPU-a", 1)])
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        hpcddp.init()  # under torchrun the group is made later, by the script or the first collective
    assert hpcddp.backend() == "gloo"
    assert chosen == [torch.device("cuda", 0)]
    said = [r.getMessage() for r in caplog.records if "backend 'auto' chose" in r.getMessage()]
    assert said == [
        "hpcddp: backend 'auto' chose gloo, not nccl: rank 0 shares its GPU (or MIG slices of one GPU) with another "
        "rank of its node, and NCCL takes one rank per GPU"
    ]


@pytest.mark.unit
def test_srun_one_gpu_per_task_takes_cuda_0_and_keeps_local_rank(fresh):
    # srun --mpi=none --gpus-per-task=1, task 1 of 2 on one node: it sees its GPU (global 1) as cuda:0.
    for name, value in {
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_GPUS_PER_TASK": "1",
        "CUDA_VISIBLE_DEVICES": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29998",
    }.items():
        fresh.setenv(name, value)
    fresh.setenv("HPCDDP_DIST_TIMEOUT", "5")
    chosen = fake_gpus(fresh, [("GPU-b", 2)])
    hpcddp.init()
    assert chosen == [torch.device("cuda", 0)]
    assert hpcddp.device() == torch.device("cuda", 0)
    assert os.environ["LOCAL_RANK"] == "1"  # torchrun's meaning: the rank on the node
    assert hpcddp.backend() == "nccl"


@pytest.mark.unit
def test_init_process_group_mpi_after_init_on_a_gpu_node_makes_an_mpi_group(fresh):
    fake_gpus(fresh, [("GPU-a", 1)])
    hpcddp.init()  # "auto" on a GPU: nccl for hpcddp's own collectives, made when first needed
    dist.init_process_group("mpi")
    assert dist.get_backend() == "mpi"
    t = torch.arange(4.0)
    dist.all_reduce(t)
    torch.testing.assert_close(t, torch.arange(4.0))


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["hpcddp", "mpi"])
def test_init_process_group_with_a_cuda_device_id(fresh, backend):
    hpcddp.init(backend="mpi")
    # torch checks device_id against the accelerator it was built for: pretend it was built with CUDA.
    fresh.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    fresh.setattr(torch.accelerator, "device_count", lambda: 2)
    dist.init_process_group(backend, device_id=torch.device("cuda", 1))
    t = torch.ones(3)
    dist.all_reduce(t)
    torch.testing.assert_close(t, torch.ones(3))
    subgroup = dist.new_group([0])
    dist.all_reduce(t, group=subgroup)
    dist.barrier()


# -- several ranks under mpirun ---------------------------------------------------------

FAKE_INVENTORY = """
import types, torch
import hpcddp
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
devices = DEVICES[rank]
torch.cuda.is_available = lambda: bool(devices)
torch.cuda.device_count = lambda: len(devices)
torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(
    uuid=devices[i][0], pci_domain_id=0, pci_bus_id=devices[i][1], pci_device_id=0)
torch.cuda.set_device = lambda device: None
hpcddp.init()
chosen = hpcddp.backend()
# The tutorials' line after hpcddp.init(): torch's default group must be the MPI one asked for.
import torch.distributed as dist
dist.init_process_group("mpi")
t = torch.ones(1)
dist.all_reduce(t)
# hpcddp's own collectives then run on the script's group (a fake GPU holds no tensor: use the CPU).
hpcddp.runtime.state.communicator().device = torch.device("cpu")
t += hpcddp.allreduce(torch.ones(1), op="sum")
print(f"rank {rank}: backend {chosen} device {hpcddp.device()} torch {dist.get_backend()} sum {t.item()} "
      f"then {hpcddp.backend()}", flush=True)
hpcddp.shutdown()
"""


@pytest.mark.ranks
@pytest.mark.parametrize(
    "devices, expected",
    [
        ([[("GPU-a", 1)], []], ["rank 0: backend mpi device cuda:0", "rank 1: backend mpi device cpu"]),
        (
            [[("MIG-1", 0x3B)], [("MIG-2", 0x3B)]],
            ["rank 0: backend mpi device cuda:0", "rank 1: backend mpi device cuda:0"],
        ),
        # One GPU each: hpcddp picks nccl, yet the script's init_process_group("mpi") gets an MPI group.
        (
            [[("GPU-a", 1)], [("GPU-b", 2)]],
            ["rank 0: backend nccl device cuda:0", "rank 1: backend nccl device cuda:0"],
        ),
    ],
    ids=["rank-without-cuda", "mig-slices-of-one-gpu", "gpu-each-then-mpi-group"],
)
def test_ranks_agree_on_one_backend_under_mpirun(tmp_path, devices, expected):
    script = f"DEVICES = {devices!r}\n" + FAKE_INVENTORY
    result = run_script(2, script, tmp_path, timeout=240, env={"HPCDDP_DIST_TIMEOUT": "20"}, cwd=ROOT)
    assert not result.timed_out and result.returncode == 0, result.stdout
    found = sorted(line for line in result.stdout.splitlines() if re.match(r"rank \d: backend", line))
    assert found == [f"{line} torch mpi sum 4.0 then mpi" for line in expected], result.stdout


SHARING_ON_RANK_0_ONLY = """
import os, types, torch
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if rank == 0:
    os.environ["HPCDDP_GPU_SHARING"] = "1"
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda i: types.SimpleNamespace(
    uuid="GPU-a", pci_domain_id=0, pci_bus_id=1, pci_device_id=0)
torch.cuda.set_device = lambda device: None
import hpcddp
try:
    hpcddp.init()
except RuntimeError as err:
    print(f"rank {rank}: raised {err}", flush=True)
else:
    # Only a rank that went on alone gets here: its next collective would wait for rank 1 forever.
    print(f"rank {rank}: started {hpcddp.backend()}", flush=True)
    hpcddp.shutdown()
"""


@pytest.mark.ranks
def test_ranks_that_disagree_on_gpu_sharing_all_raise_under_mpirun(tmp_path):
    result = run_script(2, SHARING_ON_RANK_0_ONLY, tmp_path, timeout=120, env={"HPCDDP_DIST_TIMEOUT": "20"}, cwd=ROOT)
    found = sorted(line.split(" with ")[0] for line in result.stdout.splitlines() if re.match(r"rank \d: ", line))
    assert found == ["rank 0: raised rank 0 would share a GPU", "rank 1: raised rank 0 would share a GPU"], (
        result.stdout
    )
    assert not result.timed_out, result.stdout


# -- slurm/train.sh's GPU binding -------------------------------------------------------

FAKE_SRUN = """#!/bin/sh
echo "srun $*"
"""


@pytest.mark.unit
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    "env, srun_flags, said",
    [
        ({"SLURM_GPUS_PER_TASK": "1"}, "--gpus-per-task=1 --gpu-bind=none", "GPU binding node"),
        ({"GPUS_PER_TASK": "1", "GPU_BIND": "task"}, "--gpus-per-task=1 --gpu-bind=per_task:1", "GPU binding task"),
        ({}, "", "GPU binding none"),
    ],
    ids=["per-node-default", "per-task-on-request", "no-gpus"],
)
def test_train_sh_binds_a_nodes_gpus_to_every_rank(tmp_path, env, srun_flags, said):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPU"))}
    clean.update(env, PATH=f"{bin_dir}:{clean['PATH']}", PYTHON=sys.executable, SLURM_NTASKS="2", HPCDDP_RUN_ID="t1")
    clean["HPCDDP_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "slurm", "train.sh"), "job.py"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    srun = [line for line in out.stdout.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1, out.stdout
    flags = " ".join(word for word in srun[0].split() if word.startswith(("--gpus", "--gpu-bind")))
    assert flags == srun_flags
    assert f"hpcddp: {said}" in out.stdout
