"""examples/train.py: accuracy on 2 ranks (plain and compressed), the same loss on 1 and 4 ranks, plain and 8 ranks.

examples/post_local_sgd.py's accuracy is checked where the docs show its commands (tests/test_commands.py).
"""

import json
import subprocess
import sys

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

pytestmark = pytest.mark.ranks

SCRIPT = f"{ROOT}/examples/train.py"


def run_example(num_ranks, tmp_path, *extra):
    out = tmp_path / f"metrics{num_ranks}.json"
    result = run_mpi(num_ranks, [sys.executable, SCRIPT, "--quiet", "--json", str(out), *extra], timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    return json.loads(out.read_text())


def test_one_and_four_ranks_end_with_the_same_loss(tmp_path):
    # float64: in float32 the rounding differences of a 64-sample mean vs four 16-sample
    # means grow through SGD's chaotic early phase to ~1e-2 in the loss after 4 epochs
    # (measured), hiding whether the reduction itself is right.
    one = run_example(1, tmp_path, "--epochs", "4", "--dtype", "float64")
    four = run_example(4, tmp_path, "--epochs", "4", "--dtype", "float64")
    assert four["world_size"] == 4
    assert abs(one["test_loss"] - four["test_loss"]) < 1e-4, (one, four)


def test_runs_unchanged_as_plain_python(tmp_path):
    out = tmp_path / "plain.json"
    subprocess.run(
        [sys.executable, SCRIPT, "--quiet", "--epochs", "1", "--json", str(out)], check=True, timeout=300, cwd=ROOT
    )
    assert json.loads(out.read_text())["world_size"] == 1


def test_runs_on_eight_oversubscribed_ranks(tmp_path):
    metrics = run_example(8, tmp_path, "--epochs", "1")
    assert metrics["world_size"] == 8


def test_bad_batch_size_is_one_clear_line(tmp_path):
    result = run_mpi(2, [sys.executable, SCRIPT, "--batch-size", "63"], timeout=120, cwd=ROOT)
    assert result.returncode != 0
    assert "--batch-size must be divisible by the number of ranks (2), got 63" in result.stdout


@pytest.mark.parametrize("bad", [["--epochs", "0"]])
def test_bad_arguments_are_rejected(bad):
    result = subprocess.run([sys.executable, SCRIPT, *bad], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--epochs must be >= 1" in result.stderr


SEEDS = (0, 1)


@pytest.fixture(scope="module")
def uncompressed_runs(tmp_path_factory):
    """The metrics of plain fp32 gradients at 2 ranks, one run per seed of SEEDS, on this machine."""
    tmp_path = tmp_path_factory.mktemp("fp32")
    return [run_example(2, tmp_path, "--seed", str(seed)) for seed in SEEDS]


def test_two_ranks_reach_95_percent(uncompressed_runs):
    # How long it takes is a benchmark's business (docs/BENCHMARKS.md), not a test's: a loaded machine is slower.
    for metrics in uncompressed_runs:
        assert metrics["world_size"] == 2
        assert metrics["test_accuracy"] >= 0.95, metrics


@pytest.mark.parametrize("compression", ["powersgd", "int8"])
def test_compressed_gradients_cost_under_one_and_a_half_points_on_two_ranks(tmp_path, compression, uncompressed_runs):
    # Compared with fp32 on the same machine, averaged over two seeds: a lossy compressor
    # amplifies the processor's rounding (BLAS kernels differ), so one seed's accuracy on
    # one machine is no threshold (PowerSGD seed 0: 98.9 % on one Xeon, 97.2 % on an EPYC).
    # Measured on a 2-core Xeon, 4 ranks, seeds 0 and 1: fp32 98.0 %, PowerSGD 98.3 %,
    # int8 98.6 %; single runs spread 97.2-99.2 %. At 2 ranks (half the launch time of 4 on
    # 2 cores, the same global batch and compressed buckets): fp32 98.2 %, PowerSGD 98.3 %,
    # int8 97.9 %. PowerSGD without error feedback reaches
    # 62-64 %; int8 without it ~98 %, so error feedback itself is checked in
    # tests/mpi/test_compression.py (the cumulative gradient it applies stays bounded).
    accuracies = []
    for seed in SEEDS:
        metrics = run_example(2, tmp_path, "--compression", compression, "--seed", str(seed))
        assert metrics["world_size"] == 2
        assert metrics["test_accuracy"] >= 0.95, metrics  # the example's promise, as for fp32
        accuracies.append(metrics["test_accuracy"])
    mean = sum(accuracies) / len(accuracies)
    uncompressed = sum(metrics["test_accuracy"] for metrics in uncompressed_runs) / len(uncompressed_runs)
    assert mean >= uncompressed - 0.015, (accuracies, uncompressed)
