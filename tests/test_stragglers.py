"""Straggler reports without MPI: the verdict on hand-made tables, the line, the per-step recorder on a fake communicator."""

import logging
import math
import re
import socket
import time
from array import array

import pytest
import torch

from hpcddp.ddp.timing import ReductionTimes
from hpcddp.env.settings import read_settings, read_straggler_every
from hpcddp.observe import step_times, stragglers, timeline
from hpcddp.observe.step_times import StepTimeRecorder
from hpcddp.observe.stragglers import FIELDS, MAX_NAMED, describe, judge

pytestmark = pytest.mark.unit

COLUMN = {name: i for i, name in enumerate(FIELDS)}


def table(computes_ms, step_ms=None, data_ms=None):
    """One row per rank: compute as given, the step as long as the slowest rank's compute plus 1 ms."""
    step = (max(computes_ms) + 1.0) if step_ms is None else step_ms
    rows = []
    for rank, compute in enumerate(computes_ms):
        row = [0.0] * len(FIELDS)
        data = compute - 3.0 if data_ms is None else data_ms[rank]
        values = {
            "step": step,
            "wait": step - compute,
            "compute": compute,
            "data": data,
            "forward": 1.0,
            "data_forward": data + 1.0,
            "backward": 1.5,
            "optimizer": 0.5,
            "other": 0.0,
        }
        for name, value in values.items():
            row[COLUMN[name]] = value / 1000.0
        row[COLUMN["rank"]] = rank
        row[COLUMN["steps"]] = 20
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def hosts(n):
    return [f"n{rank // 4}" for rank in range(n)]


def test_a_balanced_job_names_nobody():
    report = judge(table([10.2, 9.8, 11.5, 10.0]), hosts(4), 61, 80)
    assert report.stragglers == ()
    assert (report.first_step, report.last_step) == (61, 80)
    assert len(report.ranks) == 4 and report.ranks[2].compute_ms == pytest.approx(11.5)


def test_one_slow_rank_is_named_with_what_it_made_the_others_wait():
    report = judge(table([5.0, 5.2, 46.0, 5.1]), hosts(4), 61, 80)
    (slow,) = report.stragglers
    assert (slow.rank, slow.host) == (2, "n0")
    assert slow.waited_ms == pytest.approx(46.0 - 5.0, abs=0.01)  # over the 25th percentile of the ranks
    assert slow.share == pytest.approx(slow.waited_ms / 47.0)
    assert report.typical.compute_ms == pytest.approx(5.1)
    line = describe(slow, report)
    assert line.startswith("straggler: rank 2 (host n0) made the others wait 41 ms per step")
    assert "(median of steps 61-80, 87 % of the step)" in line
    assert "data 43/2.1 ms, forward 1.0/1.0 ms" in line


def test_several_slow_ranks_do_not_raise_the_baseline():
    computes = [5.0] * 64
    for rank in range(0, 64, 4):  # 16 of 64 ranks, one per node, 30 ms slower
        computes[rank] = 35.0
    report = judge(table(computes), hosts(64), 1, 20)
    assert sorted(s.rank for s in report.stragglers) == list(range(0, 64, 4))
    assert all(s.waited_ms == pytest.approx(30.0) for s in report.stragglers)


def test_two_slow_ranks_of_four_are_both_named():
    report = judge(table([5.0, 45.0, 5.0, 44.0]), hosts(4), 1, 20)
    assert [s.rank for s in report.stragglers] == [1, 3]  # slowest first


@pytest.mark.parametrize(
    "computes, step_ms",
    [
        ([5.0, 5.0, 5.0, 19.0], 20.0),  # 14 ms: under the 20 ms floor, though 70 % of the step
        ([200.0, 200.0, 200.0, 290.0], 400.0),  # 90 ms: under a quarter of the step
    ],
)
def test_waits_under_the_thresholds_name_nobody(computes, step_ms):
    assert judge(table(computes, step_ms=step_ms), hosts(4), 1, 20).stragglers == ()


def test_without_module_calls_data_and_forward_are_one_figure():
    rows = table([5.0, 5.0, 45.0, 5.0])
    rows[:, COLUMN["data"]] = math.nan
    rows[:, COLUMN["forward"]] = math.nan
    report = judge(rows, hosts(4), 1, 20)
    line = describe(report.stragglers[0], report)
    assert "data+forward 43/3.0 ms, backward 1.5/1.5 ms" in line and "data " not in line


def test_many_stragglers_are_named_up_to_a_limit_then_counted(caplog):
    computes = [5.0] * 32
    for rank in range(20, 32):
        computes[rank] = 40.0 + rank
    report = judge(table(computes), hosts(32), 1, 20)
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        stragglers.publish(report)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == MAX_NAMED + 1
    assert lines[0].startswith("hpcddp: straggler: rank 31 (host n7)")
    assert lines[-1].startswith("hpcddp: straggler: 4 more ranks made the others wait")
    assert stragglers.straggler_report() is report


# -- the recorder ----------------------------------------------------------------------------
class FakeComm:
    """Rank 0 of four; the other ranks send this rank's medians with their compute raised by ``extra_ms``."""

    def __init__(self, size=4, extra_ms=(0.0, 0.0, 0.0)):
        self.rank, self.size = 0, size
        self.extra_ms = extra_ms
        self.gathers = []

    def allgather_object(self, obj):
        return [obj] * self.size

    def gather_object(self, payload, root):
        self.gathers.append(payload)
        width = 8 * len(FIELDS)
        mine = array("d")
        mine.frombytes(payload[:width])
        others = []
        for index, extra in enumerate(self.extra_ms, start=1):
            row = array("d", mine)
            row[COLUMN["compute"]] += extra / 1000.0
            row[COLUMN["data"]] += extra / 1000.0
            row[COLUMN["rank"]] = index
            others.append(row.tobytes() + payload[width:])
        return [payload, *others]


def run_steps(recorder, comm, num_steps, *, module=None, active=None, step_s=0.001, slow_steps=(), named=None):
    """Steps as the optimizer runs them: backward, its reduction completing (``reduction_done``), then step().

    ``named``: the optimizer's parameters (``module``'s by default); ``slow_steps`` sleep 30 ms before their forward.
    """
    times = ReductionTimes()
    if named is None:
        named = [] if module is None else list(module.named_parameters())
    for step in range(1, num_steps + 1):
        if step in slow_steps:
            time.sleep(0.030)
        if module is not None:
            module(torch.zeros(1, 2))
        times.backward_start = time.perf_counter()
        time.sleep(step_s)
        times.backward_end = time.perf_counter()
        times.waited(times.backward_end)
        recorder.reduction_done(step, comm.size if active is None else active(step), comm)
        started = time.perf_counter()
        recorder.step_done(started, times, step, named)
    return times


@pytest.fixture(autouse=True)
def _no_report_left():
    stragglers._last_report = None
    yield
    stragglers._last_report = None
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    for key, hook in list(hooks.items()):  # the recorders' armed forward hooks
        if isinstance(getattr(hook, "__self__", None), StepTimeRecorder):
            del hooks[key]


def test_the_recorder_gathers_once_per_window_and_rank_0_names_the_slow_rank(caplog):
    comm = FakeComm(extra_ms=(0.0, 60.0, 0.0))
    recorder = StepTimeRecorder(10)
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        run_steps(recorder, comm, 30, module=torch.nn.Linear(2, 2))
    assert len(comm.gathers) == 3
    assert comm.gathers[0].endswith(socket.gethostname().encode())  # the host once
    assert len(comm.gathers[1]) == 8 * len(FIELDS)
    report = stragglers.straggler_report()
    assert (report.first_step, report.last_step) == (20, 29)  # step 30's row is stored after its reduction
    assert [s.rank for s in report.stragglers] == [2]
    assert not math.isnan(report.ranks[0].data_ms) and not math.isnan(report.ranks[0].forward_ms)
    assert sum("straggler: rank 2" in r.getMessage() for r in caplog.records) == 3


def test_without_module_calls_the_recorder_tells_data_and_forward_only_together():
    comm = FakeComm()
    recorder = StepTimeRecorder(10)
    run_steps(recorder, comm, 10)
    report = stragglers.straggler_report()
    assert math.isnan(report.ranks[0].data_ms) and report.ranks[0].data_forward_ms >= 0
    assert report.ranks[0].backward_ms >= 1.0


def test_a_window_in_which_some_rank_had_no_data_is_not_reported():
    comm = FakeComm(extra_ms=(0.0, 60.0, 0.0))
    recorder = StepTimeRecorder(10)
    run_steps(recorder, comm, 30, active=lambda step: 3 if 12 <= step <= 15 else 4)
    assert len(comm.gathers) == 2  # steps 11-20 (a join) dropped
    assert stragglers.straggler_report().first_step == 20


def test_a_step_whose_reduction_did_not_finish_stores_no_row():
    recorder, times = StepTimeRecorder(100), ReductionTimes()
    for num_reductions in (1, 2, 2, 2, 3):  # three step() calls without a reduction since the last
        recorder.step_done(time.perf_counter(), times, num_reductions, [])
    assert recorder._num_rows == 2  # steps 2 and 5: the first step has no previous end


def test_nobody_is_named_before_every_rank_has_five_rows(caplog):
    comm = FakeComm(extra_ms=(0.0, 60.0, 0.0))
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        run_steps(StepTimeRecorder(6), comm, 12)  # windows of 4 rows (steps 2-5), then 6 (6-11)
    assert len(comm.gathers) == 2  # both gathered: the ranks gather by reductions, whatever their rows
    assert stragglers.straggler_report().first_step == 6
    assert sum("straggler: rank 2" in r.getMessage() for r in caplog.records) == 1

    class FewRows(FakeComm):
        def gather_object(self, payload, root):
            payloads = super().gather_object(payload, root)
            row = array("d")
            row.frombytes(payloads[3][: 8 * len(FIELDS)])
            row[COLUMN["steps"]] = 4  # rank 3 stepped 4 times in the window
            return [*payloads[:3], row.tobytes() + payloads[3][8 * len(FIELDS) :]]

    stragglers._last_report = None
    run_steps(StepTimeRecorder(10), FewRows(extra_ms=(0.0, 60.0, 0.0)), 20)
    assert stragglers.straggler_report() is None


def test_the_line_names_the_optimizer_when_there_are_several():
    report = judge(table([5.0, 5.0, 45.0, 5.0]), hosts(4), 1, 20, optimizer="DistributedOptimizer #2")
    line = describe(report.stragglers[0], report)
    assert "made the others wait 40 ms per step (DistributedOptimizer #2, median of steps 1-20, 87 % of" in line
    first = StepTimeRecorder(5)
    assert StepTimeRecorder(5).number == first.number + 1  # made in the same order on every rank


def test_the_forward_hook_is_gone_after_the_first_call_of_the_optimizers_model():
    model = torch.nn.Sequential(torch.nn.Linear(1, 1))  # its parameters live in a child only
    recorder = StepTimeRecorder(100)
    run_steps(recorder, FakeComm(), 3, named=list(model.named_parameters()))
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    assert recorder._hook is not None and recorder._hook.id in hooks
    torch.nn.ReLU()(torch.zeros(1))  # no parameters: still armed
    torch.nn.Linear(1, 1)(torch.zeros(1))  # another model's (a second optimizer's, a teacher model)
    assert recorder._hook is not None and recorder._forward_at == 0.0
    called = time.perf_counter()
    model(torch.zeros(1))
    assert recorder._hook is None and not any(h == recorder._on_forward for h in hooks.values())
    assert 0.0 < recorder._forward_at - called < 0.010


def test_work_in_the_models_own_forward_before_its_first_layer_is_forward():
    class Top(torch.nn.Module):  # input normalisation, positional encodings, ... before the first layer
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def forward(self, x):
            time.sleep(0.030)
            return self.layer(x)

    model = Top()
    recorder = StepTimeRecorder(100)
    run_steps(recorder, FakeComm(), 3, named=list(model.named_parameters()))
    called = time.perf_counter()
    model(torch.zeros(1))
    assert 0.0 < recorder._forward_at - called < 0.010  # at the top module's call, not 30 ms later at the layer's


def test_a_first_call_under_no_grad_disarms_the_hook_and_leaves_the_step_unsplit():
    # An evaluation between steps: not called data nor forward (the hook would otherwise stay armed
    # through the whole evaluation, every module call on torch's hooked path).
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    recorder = StepTimeRecorder(100)
    run_steps(recorder, FakeComm(), 3, named=list(model.named_parameters()))
    with torch.no_grad():
        model(torch.zeros(1, 2))
    assert recorder._hook is None and recorder._forward_at == 0.0


def test_a_compiled_wrapper_starts_the_forward():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    class Wrapper(torch.nn.Module):  # as torch.compile's OptimizedModule: the model a child, whose calls no hook sees
        def __init__(self):
            super().__init__()
            self._orig_mod = model

        def forward(self, x):
            return torch.nn.functional.linear(x, model[0].weight, model[0].bias)

    recorder = StepTimeRecorder(100)
    run_steps(recorder, FakeComm(), 3, named=list(model.named_parameters()))
    Wrapper()(torch.zeros(1, 2))
    assert recorder._hook is None and recorder._forward_at > 0.0


def test_shutdown_disarms_the_forward_hook():
    from hpcddp.observe import step_times

    recorder = StepTimeRecorder(100)
    run_steps(recorder, FakeComm(), 3, named=[])
    assert recorder._hook is not None
    step_times._disarm_all()  # what hpcddp.shutdown() runs (registered with at_shutdown)
    assert recorder._hook is None


def test_a_window_is_labelled_with_the_steps_whose_rows_it_holds():
    # Steps 5-7 of 10 are slow: the window reported in reduction 10 holds steps 5-9 (step 10's row
    # is stored after its reduction) and says so; labelled 6-10 it would miss its slow step 5.
    comm = FakeComm()
    run_steps(StepTimeRecorder(5), comm, 10, slow_steps=(5, 6, 7))
    report = stragglers.straggler_report()
    assert (report.first_step, report.last_step) == (5, 9)
    assert report.step_ms >= 30.0 and report.table[0, COLUMN["steps"]] == 5


def test_a_launch_that_blocks_inside_backward_is_wait_not_backward():
    comm = FakeComm()
    recorder = StepTimeRecorder(5)
    times = ReductionTimes()
    for step in range(1, 6):
        times.backward_start = time.perf_counter()
        times.begin(1)
        times.bucket_launch[0] = time.perf_counter()
        blocked = time.perf_counter()
        time.sleep(0.02)  # gloo's agreement at bucket 0's launch, waiting for a slow rank
        times.launch_waited(blocked)
        times.backward_end = time.perf_counter()
        times.waited(times.backward_end)
        recorder.reduction_done(step, comm.size, comm)
        recorder.step_done(time.perf_counter(), times, step, [])
    rows = recorder._medians()
    assert rows[COLUMN["wait"]] >= 0.02 and rows[COLUMN["backward"]] < 0.01 and rows[COLUMN["compute"]] < 0.01


def test_a_timeline_marks_each_report(monkeypatch):
    spans = []

    class Recorder:
        def span(self, name, start, end, **args):
            spans.append((name, args))

    monkeypatch.setattr(timeline, "_recorder", Recorder())
    run_steps(StepTimeRecorder(5, record_timeline=True), FakeComm(extra_ms=(50.0, 0.0, 0.0)), 10)
    assert [name for name, _ in spans] == ["straggler report"] * 2
    assert spans[-1][1] == {"steps": "5-9", "stragglers": "rank 1 50 ms"}


def test_every_zero_turns_the_reports_off(monkeypatch):
    comm = FakeComm()
    monkeypatch.setenv("HPCDDP_STRAGGLER_EVERY", "0")
    assert step_times.recorder_for(comm, record_timeline=False) is None
    monkeypatch.setenv("HPCDDP_STRAGGLER_EVERY", "50")
    assert step_times.recorder_for(comm, record_timeline=False).every == 50
    monkeypatch.delenv("HPCDDP_STRAGGLER_EVERY")
    assert step_times.recorder_for(comm, record_timeline=False).every == 200  # on by default
    assert step_times.recorder_for(FakeComm(size=1, extra_ms=()), record_timeline=False) is None


def test_ranks_given_different_windows_all_turn_the_reports_off(monkeypatch, caplog):
    class OthersSay20(FakeComm):
        def allgather_object(self, obj):
            return [obj, (20, False, ""), (200, True, ""), (20, False, "")]

    monkeypatch.setenv("HPCDDP_STRAGGLER_EVERY", "50")  # this rank only: mpirun without -x on other hosts
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        assert step_times.recorder_for(OthersSay20(), record_timeline=False) is None
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "hpcddp: HPCDDP_STRAGGLER_EVERY differs between the ranks (20, 50, unset (200))"
    )


def test_a_bad_every_set_after_init_turns_the_reports_off_in_one_line(monkeypatch, caplog):
    monkeypatch.setenv("HPCDDP_STRAGGLER_EVERY", "ten")
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        assert step_times.recorder_for(FakeComm(), record_timeline=False) is None
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(
        "hpcddp: on rank 0 (and on 3 more rank(s)): environment variable HPCDDP_STRAGGLER_EVERY must be 0 "
    ), message
    assert message.endswith("got 'ten': straggler reports are off"), message


@pytest.mark.parametrize("raw", ["-1", "ten", "2.5", "1_000", "+5", "\u0661\u0662", "1", "4"])
def test_a_bad_every_names_the_variable_and_the_fix(raw):
    # 1-4: no window would ever hold the 5 steps a report needs: silence, not reports
    with pytest.raises(
        ValueError, match=f"HPCDDP_STRAGGLER_EVERY must be 0 .*or a whole number of steps >= 5 .*got '{re.escape(raw)}'"
    ):
        read_straggler_every({"HPCDDP_STRAGGLER_EVERY": raw})
    with pytest.raises(ValueError, match="HPCDDP_STRAGGLER_EVERY"):
        read_settings({"HPCDDP_STRAGGLER_EVERY": raw})  # init() stops at once


def test_the_optimizer_records_nothing_at_world_size_one(monkeypatch):
    import hpcddp

    monkeypatch.setenv("HPCDDP_STRAGGLER_EVERY", "20")
    from hpcddp.comm.local import LocalCommunicator

    model = torch.nn.Linear(2, 2)
    optimizer = hpcddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), communicator=LocalCommunicator()
    )
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    assert optimizer._step_times is None and optimizer.reducer._after_reduction is None


def test_rank_0_leaves_the_last_report_for_hpcddp_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDDP_RUN_STATUS", str(tmp_path))
    assert stragglers.run_status_lines(str(tmp_path)) == []
    stragglers.publish(judge(table([5.0, 5.0, 45.0, 5.0]), hosts(4), 1, 20))
    (line,) = stragglers.run_status_lines(str(tmp_path))
    assert line.startswith("straggler: rank 2 (host n0) made the others wait 40 ms per step")
    stragglers.publish(judge(table([5.0, 5.0, 5.0, 5.0]), hosts(4), 21, 40))
    assert stragglers.run_status_lines(str(tmp_path)) == ["no straggler in steps 21-40 (median step 6 ms)"]


class RatesComm:
    """Rank 0 of four under AsyncModelAverager: the others took ``steps`` steps in 1 s; ``off``: ranks whose reports are 0."""

    rank, size = 0, 4

    def __init__(self, steps, off=()):
        self.steps, self.off = steps, off
        self.gathers = 0

    def gather_object(self, payload, root):
        self.gathers += 1
        return [payload] + [
            array("d", [steps, 1.0, rank, rank not in self.off]).tobytes() + b"n1"
            for rank, steps in enumerate(self.steps, start=1)
        ]


def test_asynchronous_averaging_names_the_rank_with_the_fewest_steps_per_second(caplog):
    comm = RatesComm(steps=(100, 100, 30))
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        report = stragglers.report_step_rates(comm, 100, 1.0)
    assert report.steps_per_s == (100.0, 100.0, 100.0, 30.0) and report.typical == 100.0
    assert report.slow == (3,)  # 1/30 s - 1/100 s = 23 ms more per step: over 20 ms and 25 %
    (record,) = caplog.records
    assert record.getMessage().startswith("hpcddp: straggler: rank 3 (host n1) ran 30.0 steps/s where a typical")


def test_a_rank_whose_reports_are_off_still_gathers_the_step_rates_and_nobody_is_named(caplog):
    comm = RatesComm(steps=(100, 100, 30), off=(2,))
    with caplog.at_level(logging.WARNING, logger="hpcddp"):
        assert stragglers.report_step_rates(comm, 100, 1.0) is None
    assert comm.gathers == 1 and not caplog.records
