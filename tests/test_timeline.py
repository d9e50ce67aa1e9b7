"""HPCDDP_TIMELINE / init(timeline=...): the Chrome trace loads and its spans nest and follow each other."""

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from hpcddp.testing import run_mpi

from .conftest import ROOT

STEPS = 4
EPS_US = 0.01  # timestamps are rounded to nanoseconds

TRAIN = f"""
import sys, time
import torch, torch.nn.functional as F
import hpcddp

hpcddp.init({{timeline_arg}})
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
optimizer = hpcddp.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(), bucket_cap_mb=0.5, first_bucket_mb=0.25
)
for step in range({STEPS}):
    optimizer.zero_grad()
    F.mse_loss(model(torch.randn(32, 256)), torch.zeros(32, 256)).backward()
    optimizer.step()
print("buckets", len(optimizer.buckets))
hpcddp.shutdown()
"""


def load(path):
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    spans = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            spans[(event["pid"], event["tid"])].append(event)
    for track in spans.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"].endswith("_name")
    }
    return spans, names


def end(event):
    return event["ts"] + event["dur"]


def inside(child, parent):
    return parent["ts"] - EPS_US <= child["ts"] and end(child) <= end(parent) + EPS_US


def check_training_track(track, reduces=True):
    """forward, backward, synchronize (the wait for the buckets), step (holding optimizer.step) per iteration."""
    top = [e for e in track if e["name"] in ("forward", "backward", "synchronize", "step")]
    expected = ["forward", "backward", "synchronize", "step"] if reduces else ["forward", "backward", "step"]
    assert [e["name"] for e in top] == expected * STEPS, [e["name"] for e in top]
    for before, after in zip(top, top[1:]):
        assert end(before) <= after["ts"] + EPS_US, (before, after)
    for step in (e for e in top if e["name"] == "step"):
        nested = [e for e in track if e["name"] == "optimizer.step" and inside(e, step)]
        assert len(nested) == 1, nested
    return [e for e in top if e["name"] == "backward"]


@pytest.mark.ranks
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_timeline_of_two_ranks_shows_nested_bucket_phases_and_overlap(tmp_path, backend):
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("{timeline_arg}", f"backend={backend!r}"))
    # gloo runs collectives on threads of its own: there is no queue to see.
    expected_phases = (
        ["copy-in", "queue", "allreduce", "copy-out"] if backend == "mpi" else ["copy-in", "allreduce", "copy-out"]
    )
    trace_path = tmp_path / "trace.json"
    result = run_mpi(2, [sys.executable, str(script)], timeout=300, env={"HPCDDP_TIMELINE": str(trace_path)}, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:]
    num_buckets = int(result.stdout.split("buckets ")[1].split()[0])
    assert num_buckets >= 3
    spans, names = load(trace_path)
    assert not (tmp_path / "trace.json.ranks").exists()  # the per-rank files, merged, are gone
    for rank in range(2):
        assert names[(rank, None)] == f"rank {rank}"
        assert names[(rank, 0)] == "training"
        backwards = check_training_track(spans[(rank, 0)])
        launches = []
        for bucket in range(num_buckets):
            assert names[(rank, bucket + 1)].startswith(f"bucket {bucket} (")
            track = spans[(rank, bucket + 1)]
            parents = [e for e in track if e["name"] == f"bucket {bucket}"]
            assert len(parents) == STEPS
            for parent in parents:
                phases = [e for e in track if e is not parent and inside(e, parent)]
                assert [e["name"] for e in phases] == expected_phases, phases
                for before, after in zip(phases, phases[1:]):
                    assert end(before) <= after["ts"] + EPS_US
            launches.append([p["ts"] for p in parents])
        for step in range(STEPS):
            # Buckets start in index order, and the first one while backward still runs
            # (after the first pass, which learns how often each parameter accumulates).
            assert [launch[step] for launch in launches] == sorted(launch[step] for launch in launches)
            if step > 0:
                assert backwards[step]["ts"] <= launches[0][step] < end(backwards[step])


@pytest.mark.ranks
def test_single_process_timeline_from_init_argument(tmp_path):
    trace_path = tmp_path / "one.json"
    (tmp_path / "one.json.ranks").mkdir()
    (tmp_path / "one.json.ranks" / "rank-1.jsonl").write_text('{"name":"stale","ph":"X","pid":1,"tid":0}\n')
    script = tmp_path / "one.py"
    script.write_text(TRAIN.replace("{timeline_arg}", f"timeline={str(trace_path)!r}"))
    subprocess.run([sys.executable, str(script)], check=True, timeout=120, cwd=ROOT, capture_output=True)
    spans, names = load(trace_path)
    assert names[(0, None)] == "rank 0"
    check_training_track(spans[(0, 0)], reduces=False)
    assert set(spans) == {(0, 0)}  # a world of one reduces nothing, and an earlier run's rank 1 is gone
    assert not (tmp_path / "one.json.ranks").exists()


@pytest.mark.ranks
def test_a_link_planted_at_the_old_temporary_name_is_never_followed(tmp_path):
    trace_path = tmp_path / "one.json"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".one.json.tmp").symlink_to(victim)  # the name earlier versions wrote through
    script = tmp_path / "one.py"
    script.write_text(TRAIN.replace("{timeline_arg}", f"timeline={str(trace_path)!r}"))
    subprocess.run([sys.executable, str(script)], check=True, timeout=120, cwd=ROOT, capture_output=True)
    assert victim.read_text() == "keep me"
    assert load(trace_path)[1][(0, None)] == "rank 0"


@pytest.mark.unit
def test_timeline_must_be_a_path():
    from hpcddp.runtime.config import InitConfig

    with pytest.raises(ValueError, match="timeline must be a file path, got ''"):
        InitConfig(timeline="")


@pytest.mark.ranks
def test_unwritable_timeline_path_fails_at_init_in_one_line_per_rank(tmp_path):
    (tmp_path / "file").write_text("")
    trace_path = tmp_path / "file" / "trace.json"  # below a regular file: unwritable even for root
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("{timeline_arg}", ""))
    result = run_mpi(2, [sys.executable, str(script)], timeout=120, env={"HPCDDP_TIMELINE": str(trace_path)}, cwd=ROOT)
    assert result.returncode != 0
    assert "buckets" not in result.stdout  # it failed before training, not at shutdown
    for rank in range(2):
        line = next(x for x in result.stdout.splitlines() if x.startswith(f"[hpcddp rank {rank}] error:"))
        assert f"timeline= (HPCDDP_TIMELINE) {str(trace_path)!r} cannot be written on rank 0" in line
    assert "Traceback" not in result.stdout


@pytest.mark.unit
def test_events_go_to_the_ranks_file_in_chunks_while_recording(tmp_path):
    from hpcddp.observe import timeline

    recorder = timeline.Timeline(tmp_path / "trace.json", rank=3)
    for i in range(3 * timeline.CHUNK_EVENTS + 5):
        recorder.span("step", i * 1e-3, i * 1e-3 + 5e-4)
    assert len(recorder.events) < timeline.CHUNK_EVENTS  # memory holds one chunk at most
    (pending,) = (tmp_path / "trace.json.ranks").iterdir()  # under a temporary name until the end
    assert pending.name.startswith(".rank-3.jsonl.") and pending.name.endswith(".tmp")
    assert len(pending.read_bytes().splitlines()) == 3 * timeline.CHUNK_EVENTS
    assert recorder.close() is None
    lines = (tmp_path / "trace.json.ranks" / "rank-3.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 3 * timeline.CHUNK_EVENTS + 5
    assert all(e["dur"] == pytest.approx(500.0) for e in spans)
    assert {"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "rank 3"}} in events


@pytest.mark.unit
def test_merge_reads_the_files_it_can_names_missing_ranks_and_the_command_completes_it(tmp_path):
    from click.testing import CliRunner

    from hpcddp.cli import main
    from hpcddp.observe import timeline
    from hpcddp.observe.merge import merge_rank_files

    trace = tmp_path / "trace.json"
    elsewhere = tmp_path / "node2" / "trace.json"  # rank 1's node: its own file system
    for rank, path in ((0, trace), (1, elsewhere), (2, trace)):
        recorder = timeline.Timeline(path, rank)
        recorder.span("forward", 0.0, 0.001 * (rank + 1))
        assert recorder.close() is None
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / ".trace.json.tmp").symlink_to(victim)

    result = merge_rank_files(trace, num_ranks=3, remove=True)
    assert (result.merged, result.missing) == ([0, 2], [1])
    spans, names = load(trace)
    assert {pid for pid, _ in spans} == {0, 2} and names[(2, None)] == "rank 2"
    assert (tmp_path / "trace.json.ranks" / "rank-0.jsonl").exists()  # kept for the merge that completes it

    runner = CliRunner()
    incomplete = runner.invoke(main, ["timeline", "merge", str(trace), "--ranks", "3"])
    assert incomplete.exit_code == 1 and "missing rank(s) 1:" in incomplete.output
    (tmp_path / "trace.json.ranks" / "rank-1.jsonl").write_bytes(
        (elsewhere.parent / "trace.json.ranks" / "rank-1.jsonl").read_bytes()
    )
    done = runner.invoke(main, ["timeline", "merge", str(trace), "--ranks", "3"])
    assert done.exit_code == 0, done.output
    spans, _ = load(trace)
    assert {pid: track[0]["dur"] for (pid, _), track in spans.items()} == {0: 1000.0, 1: 2000.0, 2: 3000.0}
    assert not (tmp_path / "trace.json.ranks").exists()
    assert victim.read_text() == "keep me"


@pytest.mark.unit
def test_a_link_planted_at_the_ranks_event_directory_is_refused(tmp_path):
    from hpcddp.observe import timeline

    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "trace.json.ranks").symlink_to(target)
    with pytest.raises(OSError, match="trace.json.ranks is a symbolic link, which hpcddp will not follow"):
        timeline.Timeline(tmp_path / "trace.json", 0)
    assert list(target.iterdir()) == []


MERGE_UNDER_FD_LIMIT = """
import resource, sys
from hpcddp.observe.merge import merge_rank_files

resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
result = merge_rank_files(sys.argv[1], num_ranks=int(sys.argv[2]), remove=True)
print("merged", len(result.merged), "missing", result.missing)
"""


@pytest.mark.unit
def test_merge_of_more_rank_files_than_open_files_allowed_holds_every_event(tmp_path):
    # 100 ranks under a limit of 40 open files: the merge must not hold every rank file open at once.
    trace = tmp_path / "trace.json"
    directory = tmp_path / "trace.json.ranks"
    directory.mkdir()
    num_ranks, per_rank = 100, 3
    for rank in range(num_ranks):
        lines = [
            json.dumps({"name": "step", "ph": "X", "pid": rank, "tid": 0, "ts": i, "dur": 1}) for i in range(per_rank)
        ]
        (directory / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [sys.executable, "-c", MERGE_UNDER_FD_LIMIT, str(trace), str(num_ranks)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "merged 100 missing []" in result.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert sorted((e["pid"], e["ts"]) for e in events) == [(r, i) for r in range(num_ranks) for i in range(per_rank)]
    assert not directory.exists()


FAILING_RANK = """
import sys
import torch
import hpcddp

hpcddp.init(timeline=sys.argv[1])
model = torch.nn.Linear(4, 4)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
if hpcddp.rank() == 1:
    raise RuntimeError("boom on rank 1")
hpcddp.shutdown()
"""


@pytest.mark.ranks
def test_a_rank_that_fails_with_an_exception_commits_its_events_as_the_job_aborts(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    trace = tmp_path / "trace.json"
    result = run_mpi(2, [sys.executable, str(script), str(trace)], timeout=180, cwd=ROOT)
    assert result.returncode != 0 and "boom on rank 1" in result.stdout, result.stdout[-3000:]
    # Rank 0 may be ended by the launcher before it commits its own file; rank 1's is there, whole.
    lines = (tmp_path / "trace.json.ranks" / "rank-1.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["name"] for e in events if e["ph"] == "X"].count("forward") == 3
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "rank 1"}} in events
    assert "hpcddp timeline merge" in result.stdout


@pytest.mark.unit
def test_a_new_run_removes_the_unfinished_files_of_a_killed_run(tmp_path):
    from hpcddp.observe import timeline

    trace = tmp_path / "trace.json"
    killed = timeline.Timeline(trace, 1)  # a rank killed before it committed: its file stays unfinished
    killed.span("forward", 0.0, 0.001)
    killed._flush()
    (unfinished,) = (tmp_path / "trace.json.ranks").iterdir()
    assert unfinished.name.startswith(".rank-1.jsonl.")
    (tmp_path / "trace.json.ranks" / "notes.txt").write_text("not hpcddp's")

    result = subprocess.run(
        [sys.executable, "-c", f"import hpcddp; hpcddp.init(timeline={str(trace)!r}); hpcddp.shutdown()"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "trace.json.ranks").iterdir()) == ["notes.txt"]
    assert {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]} == {0}


class _PeerDied:
    """A communicator of rank 0 whose gather fails as a backend's does when a peer died."""

    rank, size = 0, 3

    def gather_object(self, obj, root):
        raise RuntimeError("connection closed by peer")


@pytest.mark.unit
def test_rank_0_merges_the_files_that_exist_when_another_rank_died(tmp_path, caplog):
    from hpcddp.observe import timeline

    trace = tmp_path / "trace.json"
    survivor = timeline.Timeline(trace, 2)
    survivor.span("forward", 0.0, 0.002)
    assert survivor.close() is None
    recorder = timeline.Timeline(trace, 0)
    recorder.span("forward", 0.0, 0.001)
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        recorder.write(_PeerDied())
    spans, _ = load(trace)
    assert {pid: track[0]["dur"] for (pid, _), track in spans.items()} == {0: 1000.0, 2: 2000.0}
    assert "lacks the events of rank(s) 1:" in caplog.text
