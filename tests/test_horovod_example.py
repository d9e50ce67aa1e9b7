"""examples/train_horovod.py (Horovod's API through hpcddp.horovod) on 2 ranks ends where
examples/train.py ends as one plain process (no reduction at all), in float64 to rounding; and
Horovod's own synthetic benchmark runs on 2 ranks with only its import changed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcddp.testing import run_mpi

from .conftest import ROOT

pytestmark = pytest.mark.ranks

ARGS = ["--epochs", "2", "--dtype", "float64"]


def test_horovod_style_script_on_two_ranks_matches_one_plain_process(tmp_path):
    horovod_final, plain_final = tmp_path / "horovod.pt", tmp_path / "plain.pt"
    script = f"{ROOT}/examples/train_horovod.py"
    result = run_mpi(2, [sys.executable, script, *ARGS, "--save-final", str(horovod_final)], timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "epoch  1" in result.stdout
    # One process: the global batch of 64 is the union of the two ranks' batches of 32.
    plain = [sys.executable, f"{ROOT}/examples/train.py", "--quiet", *ARGS, "--save-final", str(plain_final)]
    subprocess.run(plain, check=True, timeout=300, cwd=ROOT, capture_output=True)
    horovod, reference = torch.load(horovod_final), torch.load(plain_final)
    assert horovod.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(
            horovod[name], reference[name], atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )


# Horovod's own benchmark, copied from HOROVOD_SRC (never kept here) with only its import changed;
# docs/horovod_synthetic.sh times it against real Horovod. Here: does it run at all, cheaply.
HOROVOD_SRC = os.environ.get("HOROVOD_SRC")
SYNTHETIC = "examples/pytorch/pytorch_synthetic_benchmark.py"
HOROVOD_IMPORT = "import horovod.torch as hvd\n"


def _torchvision_problem() -> str | None:
    # A subprocess, so that a torchvision that fails halfway (PyPI's CUDA build beside a +cpu
    # torch: docs/troubleshooting.md) leaves no half-registered ops in this test process.
    check = subprocess.run(
        [sys.executable, "-c", "import torchvision.models"], capture_output=True, text=True, timeout=120
    )
    return None if check.returncode == 0 else (check.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.skipif(
    not HOROVOD_SRC or not (Path(HOROVOD_SRC) / SYNTHETIC).is_file(), reason="HOROVOD_SRC is not a Horovod checkout"
)
def test_horovods_synthetic_benchmark_runs_with_only_its_import_changed(tmp_path):
    if problem := _torchvision_problem():
        pytest.skip(f"the benchmark's models come from torchvision, which does not import here: {problem}")
    lines = (Path(HOROVOD_SRC) / SYNTHETIC).read_text().splitlines(keepends=True)
    assert lines.count(HOROVOD_IMPORT) == 1, f"{SYNTHETIC} no longer has the line {HOROVOD_IMPORT!r}"
    script = tmp_path / "pytorch_synthetic_benchmark.py"
    script.write_text("".join("import hpcddp.horovod as hvd\n" if line == HOROVOD_IMPORT else line for line in lines))
    # The smallest settings that still time two iterations: one image, one step per iteration.
    args = ["--model", "squeezenet1_1", "--batch-size", "1", "--num-warmup-batches", "1"]
    args += ["--num-batches-per-iter", "1", "--num-iters", "2"]
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    result = run_mpi(2, [sys.executable, str(script), *args], timeout=240, env={"PYTHONPATH": path}, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "Number of CPUs: 2" in result.stdout, result.stdout[-5000:]
    assert re.search(r"^Total img/sec on 2 CPU\(s\): \d+\.\d \+-\d+\.\d$", result.stdout, re.M), result.stdout[-5000:]
