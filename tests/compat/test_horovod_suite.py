"""Horovod's own torch tests against hpcddp.horovod; skipped unless HOROVOD_SRC names a Horovod checkout."""

import os
from pathlib import Path

import pytest

from .run_horovod_suite import SUITE, run_suite

SOURCE = os.environ.get("HOROVOD_SRC")

# Horovod 0.28.1 built on this machine passes 100 of its torch tests at 2 ranks; the 3 it
# fails construct torch 2.13's new Muon optimizer, which refuses 1-D parameters.
MINIMUM_PASSED = 100


@pytest.mark.skipif(not SOURCE or not (Path(SOURCE) / SUITE).is_file(), reason="HOROVOD_SRC is not a Horovod checkout")
def test_horovod_torch_suite_passes_as_often_as_horovod():
    outcome = run_suite(Path(SOURCE), num_ranks=2)
    counts = outcome["counts"]
    assert counts["passed"] >= MINIMUM_PASSED, f"{counts}; failed: {outcome['failed']}"
