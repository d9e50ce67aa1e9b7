"""The GPU suite's first minute: is there a GPU, which NCCL, and does one allreduce run on each road.

tests/gpu/run_gpu_suite.sh runs this file alone, under a 60-second limit, before the full
suite: a machine that fails here (no GPU, no MPI library, an mpirun that does not start)
would fail every later test too, so the suite stops and the device minutes are kept for a
rerun. With ``HPCDDP_GPU_SUITE_DEVICE=cpu`` (the rehearsal) the same launches run on the
CPU, gloo standing in for nccl.
"""

import os
import sys

import pytest
import torch

from hpcddp.testing import run_script

SUITE_DEVICE = os.environ.get("HPCDDP_GPU_SUITE_DEVICE", "cuda")
#: one launch's limit: two fit in the stage's minute (run_gpu_suite.sh); the rehearsal on a
#: busy CPU machine gives more
LAUNCH_LIMIT_S = float(os.environ.get("HPCDDP_GPU_SMOKE_LAUNCH_S", "25"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        SUITE_DEVICE == "cuda" and not torch.cuda.is_available(),
        reason=f"no CUDA GPU here (torch {torch.__version__}): tests/gpu/run_gpu_suite.sh runs this on a GPU "
        "machine; HPCDDP_GPU_SUITE_DEVICE=cpu rehearses it on the CPU",
    ),
]

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
print(f"[smoke] rank {hpcddp.rank()} of {hpcddp.size()}: {hpcddp.backend()} allreduce on {device} ok", flush=True)
hpcddp.shutdown()
"""


def _job_env(backend: str) -> dict[str, str]:
    env = {"HPCDDP_BACKEND": backend, "HPCDDP_GPU_SUITE_DEVICE": SUITE_DEVICE, "HPCDDP_STALL_ABORT_AFTER": "20"}
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


def test_an_allreduce_of_device_tensors_at_two_ranks_over_mpi(tmp_path):
    result = run_script(2, ALLREDUCE_JOB, tmp_path, timeout=LAUNCH_LIMIT_S, env=_job_env("mpi"))
    print(result.stdout[-4000:])
    assert result.returncode == 0 and result.stdout.count("allreduce on") == 2, result.stdout[-6000:]


def test_an_allreduce_at_world_size_one_over_nccl(tmp_path):
    backend = "nccl" if SUITE_DEVICE == "cuda" else "gloo"
    result = run_script(1, ALLREDUCE_JOB, tmp_path, timeout=LAUNCH_LIMIT_S, env=_job_env(backend))
    print(result.stdout[-4000:])
    assert result.returncode == 0 and f"{backend} allreduce on" in result.stdout, result.stdout[-6000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
