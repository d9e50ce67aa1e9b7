"""examples/train_horovod.py (Horovod's API through hpcddp.horovod) on 2 ranks ends where
examples/train.py ends as one plain process (no reduction at all), in float64 to rounding."""

import subprocess
import sys

import torch

from hpcddp.testing import run_mpi

from .conftest import ROOT

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
