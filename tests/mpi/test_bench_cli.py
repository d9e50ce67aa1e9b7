"""`hpcddp bench` through the CLI on every rank: a tiny allreduce sweep and two training steps."""

import json

import torch
from click.testing import CliRunner

import hpcddp
from hpcddp.cli import main


def _invoke(args):
    result = CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_allreduce_sweep_prints_and_writes_every_path(tmp_path):
    # Every rank writes its own path; only rank 0 should produce a file.
    out = tmp_path / f"allreduce-{hpcddp.rank()}.json"
    output = _invoke(["allreduce", "--min", "8", "--max", "4K", "--iters", "3", "--warmup", "1", "--json", str(out)])
    if hpcddp.rank() != 0:
        assert output == "" and not out.exists()
        return
    payload = json.loads(out.read_text())
    assert payload["world_size"] == hpcddp.size()
    rows = payload["results"]
    paths = {r["path"] for r in rows}
    assert {"hpcddp", "torch (gloo)"} <= paths
    if hpcddp.backend() == "mpi":
        assert "mpi4py" in paths
    sizes = sorted({r["size"] for r in rows})
    assert sizes == [8 << i for i in range(10)]
    # The bandwidth arithmetic is pinned to known numbers in tests/test_bench.py.
    for row in rows:
        assert row["count"] == row["size"] // 4  # float32
        assert row["time_us"] > 0 and row["algbw"] > 0
    assert "busbw ratio hpcddp/mpi4py" in output or hpcddp.backend() != "mpi"
    assert "4096" in output


def test_out_of_place_average_sweep_compares_like_work(tmp_path):
    # hpcddp.allreduce's default op is average: the raw path divides its sum too, each
    # path's result is checked (ones average to one) before it is timed.
    out = tmp_path / f"oop-{hpcddp.rank()}.json"
    args = ["allreduce", "--min", "64K", "--max", "128K", "--iters", "2", "--warmup", "0", "--out-of-place"]
    output = _invoke([*args, "--op", "average", "--paths", "hpcddp,mpi4py", "--json", str(out)])
    if hpcddp.rank() != 0:
        return
    payload = json.loads(out.read_text())
    assert payload["op"] == "average" and payload["out_of_place"] is True
    assert "allreduce float32 average out of place" in output
    assert {r["path"] for r in payload["results"]} == {"hpcddp", "mpi4py"} or hpcddp.backend() != "mpi"


def test_latency_reports_every_path_against_mpi4py(tmp_path):
    out = tmp_path / f"latency-{hpcddp.rank()}.json"
    output = _invoke(["latency", "--iters", "20", "--rounds", "2", "--json", str(out)])
    if hpcddp.rank() != 0:
        assert output == ""
        return
    rows = {r["path"]: r for r in json.loads(out.read_text())["results"]}
    assert {"hpcddp", "torch-mpi", "gloo"} <= set(rows)
    assert all(r["count"] == 8 and r["time_us"] > 0 for r in rows.values())
    if hpcddp.backend() == "mpi":
        assert rows["mpi4py"]["vs_mpi4py"] == 1.0
        assert rows["hpcddp"]["vs_mpi4py"] == rows["hpcddp"]["time_us"] / rows["mpi4py"]["time_us"]
        assert rows["mpi-floor"]["time_us"] > 0


def test_train_two_steps_reports_every_variant(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / f"train-{hpcddp.rank()}.json"
    output = _invoke(
        [
            "train",
            "--model",
            "mlp",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--bucket-cap-mb",
            "8",
            "--json",
            str(out),
        ]
    )
    torch.set_num_threads(threads)
    if hpcddp.rank() != 0:
        return
    payload = json.loads(out.read_text())
    assert payload["num_parameters"] == 8_396_800
    results = {r["variant"]: r for r in payload["results"]}
    assert {"local", "ddp", "ddp-hpcddp", "hpcddp"} <= set(results)  # horovod only where it imports
    for r in results.values():
        assert r["step_ms"] > 0 and len(r["runs_ms"]) == 1
        assert r["samples_per_s"] > 0
    timeline = results["hpcddp"]["timeline"]
    assert len(timeline["bucket_launch_ms"]) == len(timeline["bucket_done_ms"]) >= 2
    # Every bucket finishes after it started, and the first starts inside backward.
    assert all(a <= b for a, b in zip(timeline["bucket_launch_ms"], timeline["bucket_done_ms"]))
    assert timeline["bucket_launch_ms"][0] < timeline["backward_end_ms"]
    assert "samples/s" in output and "hpcddp last step" in output


def test_straggler_runs_every_variant_and_writes_curves(tmp_path):
    out = tmp_path / f"straggler-{hpcddp.rank()}.json"
    output = _invoke(
        ["straggler", "--seconds", "0.4", "--repeats", "1", "--pause-ms", "2", "--target", "0.3", "--json", str(out)]
    )
    if hpcddp.rank() != 0:
        assert output == "" and not out.exists()
        return
    payload = json.loads(out.read_text())
    assert [row["variant"] for row in payload["summary"]] == ["sync", "local-sgd", "async"]
    for run in payload["runs"]:
        assert len(run["steps"]) == hpcddp.size() and run["curve"] and run["fast_steps_per_s"] > 0
        assert 0 <= run["final_accuracy"] <= 1
    sync = next(r for r in payload["runs"] if r["variant"] == "sync")
    assert len(set(sync["steps"])) == 1  # synchronous ranks step together
    assert "time to 30%" in output and "fast steps/s" in output
