"""examples/train_horovod.py (Horovod's API through hpcddp.horovod) ends where examples/train.py ends."""

import sys

import torch

from hpcddp.testing import run_mpi

from .conftest import ROOT


def train(tmp_path, script, *args):
    final = tmp_path / f"{script}.pt"
    result = run_mpi(
        2,
        [
            sys.executable,
            f"{ROOT}/examples/{script}",
            "--epochs",
            "3",
            "--dtype",
            "float64",
            "--save-final",
            str(final),
            *args,
        ],
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout, torch.load(final)


def test_horovod_style_script_matches_plain_hpcddp(tmp_path):
    out, horovod = train(tmp_path, "train_horovod.py")
    assert "epoch  2" in out
    _, plain = train(tmp_path, "train.py", "--quiet")
    assert horovod.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(horovod[name], plain[name], atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
