"""The GPU suite's first stage: is there a GPU, which NCCL, and does one allreduce run on each road.

tests/gpu/run_gpu_suite.sh runs this file alone, under a 120-second limit, before the full
suite: no GPU stops the run there (every later test would fail too, and the device minutes
are kept for a rerun); a failed mpi or nccl launch skips the suite's job of that road. With
``HPCDDP_GPU_SUITE_DEVICE=cpu`` (the rehearsal) the same launches run on the CPU, gloo
standing in for nccl. Set to ``cuda`` (run_gpu_suite.sh's default) on a machine without
CUDA, every test fails; unset (a plain ``pytest`` on CI), they skip.
"""

import os
import sys

import pytest
import torch

from hpcddp.testing import run_script

from .conftest import BIND, SUITE_DEVICE, UNBOUND_ENV

#: one launch's limit: two fit in the stage's 120 s (run_gpu_suite.sh); 17-57 s measured on
#: 2 busy CPU cores in the rehearsal
LAUNCH_LIMIT_S = float(os.environ.get("HPCDDP_GPU_SMOKE_LAUNCH_S", "50"))

pytestmark = [pytest.mark.system, pytest.mark.gpu, pytest.mark.usefixtures("cuda_where_the_suite_asks_for_it")]


# Every rank checks its own result and exits 1 on a wrong one; mpirun then fails the launch.
ALLREDUCE_JOB = """
import os, sys
import torch
import hpcddp

hpcddp.init(allow_gpu_sharing=True)
device = hpcddp.device()
wanted = os.environ["HPCDDP_GPU_SUITE_DEVICE"]
if device.type != wanted:
    sys.exit(f"rank {hpcddp.rank()}: hpcddp chose {device}, the suite runs on {wanted}")
tensor = torch.full((1 << 16,), float(hpcddp.rank() + 1), device=device)
hpcddp.allreduce_(tensor, op="average")
expected = (hpcddp.size() + 1) / 2
if tensor.device != device or not torch.all(tensor == expected):
    sys.exit(f"rank {hpcddp.rank()}: allreduce gave {tensor[:3].tolist()} on {tensor.device}, wanted {expected}")
if hpcddp.backend() in ("nccl", "gloo"):
    # hpcddp's allreduce at world size 1 returns at once: torch.distributed's own collectives
    # make NCCL (gloo in the rehearsal) really run, an allreduce and a gather into another buffer
    # (a copy that even one rank must make).
    import torch.distributed as dist

    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group(hpcddp.backend(), store=dist.HashStore(), rank=0, world_size=1)
    raw = torch.full((1 << 16,), 2.5, device=device)
    dist.all_reduce(raw)
    gathered = torch.zeros(dist.get_world_size() * raw.numel(), device=device)
    dist.all_gather_into_tensor(gathered, raw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wanted = 2.5 * dist.get_world_size()
    if not (torch.all(raw == wanted) and torch.all(gathered == wanted)):
        sys.exit(f"torch.distributed on {hpcddp.backend()}: all_reduce gave {raw[:3].tolist()}, "
                 f"all_gather_into_tensor {gathered[:3].tolist()}, wanted {wanted}")
    print(f"[smoke] torch.distributed {hpcddp.backend()} all_reduce and all_gather_into_tensor on {device} ok")
    if made_group:
        dist.destroy_process_group()
print(f"[smoke] rank {hpcddp.rank()} of {hpcddp.size()}: {hpcddp.backend()} allreduce on {device} ok", flush=True)
hpcddp.shutdown()
"""


def _job_env(backend: str) -> dict[str, str]:
    env = {"HPCDDP_BACKEND": backend, "HPCDDP_GPU_SUITE_DEVICE": SUITE_DEVICE, "HPCDDP_STALL_ABORT_AFTER": "20"}
    env.update(UNBOUND_ENV)
    if SUITE_DEVICE == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def test_the_gpu_and_nccl_are_seen(capsys):
    with capsys.disabled():
        if SUITE_DEVICE == "cpu":
            print(f"\n[smoke] device: cpu (HPCDDP_GPU_SUITE_DEVICE=cpu), torch {torch.__version__}")
            return
        properties = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        print(
            f"\n[smoke] device: {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
            f"{torch.cuda.device_count()} visible; torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {nccl}"
        )
    assert torch.zeros(1, device="cuda").add_(1).item() == 1.0


def _launch(num_ranks: int, tmp_path, backend: str):
    result = run_script(num_ranks, ALLREDUCE_JOB, tmp_path, timeout=LAUNCH_LIMIT_S, env=_job_env(backend), bind=BIND)
    print(f"[smoke] {' '.join(result.args)}")  # the binding the device's mpirun got, for a failed start
    print(result.stdout[-4000:])
    return result


def test_an_allreduce_of_device_tensors_at_two_ranks_over_mpi(tmp_path):
    result = _launch(2, tmp_path, "mpi")
    assert result.returncode == 0 and result.stdout.count("allreduce on") == 2, result.stdout[-6000:]


def test_an_allreduce_at_world_size_one_over_nccl(tmp_path):
    backend = "nccl" if SUITE_DEVICE == "cuda" else "gloo"
    result = _launch(1, tmp_path, backend)
    ran = f"torch.distributed {backend} all_reduce and all_gather_into_tensor on"
    assert result.returncode == 0 and f"{backend} allreduce on" in result.stdout, result.stdout[-6000:]
    assert ran in result.stdout, f"no collective of torch.distributed's own ran:\n{result.stdout[-6000:]}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
