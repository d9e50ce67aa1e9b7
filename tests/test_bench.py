"""`hpcddp bench` without MPI: bandwidth arithmetic, size parsing, reference models, argument checks."""

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

from hpcddp.bench import algbw, build_workload, busbw, format_size, parse_size, size_sweep
from hpcddp.bench.train import bench_train
from hpcddp.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8", 8), (8, 8), ("64K", 65536), ("64KiB", 65536), ("256M", 256 << 20), ("1g", 1 << 30), (" 4 MB ", 4 << 20)],
)
def test_parse_size_takes_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "0", "-8", "1.5M", "5X", "0K"])
def test_parse_size_rejects_nonsense_naming_the_option(text):
    with pytest.raises(ValueError, match=r"--max must be"):
        parse_size(text, "--max")


def test_default_sweep_is_8_bytes_to_256_mib_in_powers_of_two():
    sizes = size_sweep(parse_size("8"), parse_size("256M"))
    assert sizes[0] == 8 and sizes[-1] == 256 << 20
    assert len(sizes) == 26
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


def test_sweep_stops_at_the_largest_power_not_above_max():
    assert size_sweep(8, 100) == [8, 16, 32, 64]
    assert size_sweep(1024, 1024) == [1024]


def test_sweep_rejects_bad_bounds():
    with pytest.raises(ValueError, match="--min must be a multiple of 4"):
        size_sweep(6, 64)
    with pytest.raises(ValueError, match=r"--max must be >= --min \(1MiB\), got 1KiB"):
        size_sweep(1 << 20, 1 << 10)


def test_algbw_is_bytes_over_seconds_in_gb_per_s():
    assert algbw(10**9, 1.0) == pytest.approx(1.0)
    assert algbw(1 << 20, 100e-6) == pytest.approx(10.48576)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        algbw(8, 0.0)


@pytest.mark.parametrize(("num_ranks", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_follows_nccl_tests(num_ranks, factor):
    # nccl-tests PERFORMANCE.md: allreduce busbw = algbw * 2(n-1)/n
    assert busbw(3.0, num_ranks) == pytest.approx(3.0 * factor)


def test_busbw_needs_a_rank():
    with pytest.raises(ValueError, match="num_ranks must be >= 1, got 0"):
        busbw(1.0, 0)


def test_format_size_uses_the_largest_exact_unit():
    assert [format_size(n) for n in (8, 1536, 4096, 1 << 20, 256 << 20, 1 << 30)] == [
        "8B",
        "1536B",
        "4KiB",
        "1MiB",
        "256MiB",
        "1GiB",
    ]


def test_reference_models_have_the_documented_sizes():
    mlp = build_workload("mlp", batch_size=4)
    conv = build_workload("conv", batch_size=4)
    assert mlp.num_parameters == 8 * (1024 * 1024 + 1024) == 8_396_800
    assert 0.5e6 < conv.num_parameters < 0.6e6
    assert mlp.inputs.shape == (4, 1024) and conv.inputs.shape == (4, 3, 32, 32)
    assert len([m for m in conv.model if isinstance(m, torch.nn.Conv2d)]) == 5
    assert len([m for m in conv.model if isinstance(m, torch.nn.MaxPool2d)]) == 2
    assert torch.isfinite(conv.loss(conv.model))


def test_workload_rejects_unknown_models():
    with pytest.raises(ValueError, match="model must be one of mlp, conv, got 'resnet'"):
        build_workload("resnet")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["allreduce", "--min", "3"], "--min must be a multiple of 4"),
        (["allreduce", "--min", "1M", "--max", "1K"], "--max must be >= --min"),
        (["allreduce", "--max", "lots"], "--max must be a byte count"),
        (["allreduce", "--iters", "0"], "--iters"),
        (["allreduce", "--paths", "hpcddp,nccl2"], "--paths must list names among hpcddp, mpi4py, torch"),
        (
            ["train", "--variants", "local,fsdp"],
            "--variants must list names among local, ddp, ddp-hpcddp, ddp-powersgd, horovod, hpcddp",
        ),
        (["train", "--model", "resnet"], "'resnet' is not one of"),
        (["train", "--bucket-cap-mb", "0"], "--bucket-cap-mb"),
        (["straggler", "--variants", "sync,hogwild"], "--variants must list names among sync, local-sgd, async"),
        (["straggler", "--factor", "0.5"], "--factor"),
        (["straggler", "--target", "1.5"], "--target"),
        (["inspector", "--ranks", "1"], "must be comma-separated rank counts >= 2"),
    ],
)
def test_cli_rejects_bad_arguments_without_a_traceback(args, message):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(main, ["bench", "allreduce", "--plot", "out.png"])
    assert result.exit_code == 2
    assert "pip install 'hpcddp[plot]'" in result.output
    # Under mpirun only rank 0 says it: the other ranks exit with the same status, silently.
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    result = CliRunner().invoke(main, ["bench", "allreduce", "--plot", "out.png"])
    assert result.exit_code == 2 and result.output == ""


def test_allreduce_sweep_in_a_world_of_one_writes_json(world_of_one, tmp_path):
    out = tmp_path / "ar.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "allreduce",
            "--min",
            "8",
            "--max",
            "64",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--paths",
            "hpcddp",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [r["size"] for r in rows] == [8, 16, 32, 64]
    assert [r["count"] for r in rows] == [2, 4, 8, 16]
    assert all(r["time_us"] > 0 and r["busbw"] == 0.0 for r in rows)  # one rank moves nothing


def test_train_reports_overhead_against_local(world_of_one):
    workload = build_workload("mlp", batch_size=2)
    results = bench_train(workload, ["local", "hpcddp"], steps=2, warmup=1, repeats=2)
    by_name = {r.variant: r for r in results}
    assert set(by_name) == {"local", "hpcddp"}
    assert by_name["local"].overhead == 0.0
    hp = by_name["hpcddp"]
    assert len(hp.runs_ms) == 2 and hp.step_ms > 0
    assert hp.overhead == pytest.approx((hp.step_ms - by_name["local"].step_ms) / by_name["local"].step_ms)
    assert hp.samples_per_s == pytest.approx(2 / (hp.step_ms / 1e3))


def test_train_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        bench_train(build_workload("mlp", batch_size=1), ["local"], repeats=0)


@pytest.mark.parametrize("busbw_scale", [1.0, 0.0])  # two ranks, and a world of one
def test_plot_writes_a_png(tmp_path, busbw_scale):
    pytest.importorskip("matplotlib")
    from hpcddp.bench.allreduce import AllreduceResult
    from hpcddp.bench.plot import plot_busbw

    rows = [
        AllreduceResult(path, size, size // 4, 10.0, size / 1e4, busbw_scale * size / 1e4)
        for path in ("hpcddp", "mpi4py")
        for size in (8, 16, 32)
    ]
    out = tmp_path / "busbw.png"
    plot_busbw(rows, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_straggler_summary_takes_medians_and_counts_a_missed_target_as_slowest():
    from hpcddp.bench.straggler import StragglerRun, summarize

    def run(variant, seconds, accuracy, rate):
        return StragglerRun(variant, 0, seconds, accuracy, [10, 10], rate)

    runs = [run("sync", 4.0, 0.96, 10.0), run("sync", 2.0, 0.97, 12.0), run("sync", 3.0, 0.98, 11.0)]
    runs += [run("async", 1.0, 0.97, 30.0), run("async", None, 0.95, 28.0), run("async", 1.5, 0.99, 29.0)]
    rows = {row["variant"]: row for row in summarize(runs)}
    assert rows["sync"]["seconds_to_target"] == 3.0 and rows["sync"]["vs_sync"] == 1.0
    assert rows["async"]["seconds_to_target"] == 1.5 and rows["async"]["vs_sync"] == 0.5
    assert rows["async"]["final_accuracy"] == 0.97 and rows["async"]["fast_steps_per_s"] == 29.0
    assert rows["async"]["runs_seconds_to_target"] == [1.0, None, 1.5]
    missed = summarize([run("sync", 2.0, 0.9, 1.0), run("async", None, 0.9, 1.0)])
    assert missed[1]["seconds_to_target"] is None and missed[1]["vs_sync"] is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("variants", ("sync", "x"), "variants must be among"), ("seconds", 0, "seconds must be > 0"),
     ("target", 0, "target must be an accuracy"), ("repeats", 0, "repeats must be >= 1")],
)  # fmt: skip
def test_straggler_config_names_the_bad_field(field, value, message):
    from hpcddp.bench.straggler import StragglerConfig

    with pytest.raises(ValueError, match=message):
        StragglerConfig(**{field: value})


def test_inspector_simulation_names_the_late_rank_with_replies_that_do_not_grow_with_ranks():
    result = CliRunner().invoke(main, ["bench", "inspector", "--ranks", "8,64"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()[1:]]
    assert [int(row[0]) for row in rows] == [8, 64]
    assert all(row[-2] == "slow," for row in rows)
    # A reply is one rank's status: its size must not depend on how many ranks the job has.
    assert int(rows[0][2]) == int(rows[1][2])
