"""A rank that does not answer the stall inspector: busy in one long C call (alive) or stopped (lost)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hpcddp.fault.stall import StallInspector, liveness
from hpcddp.testing import run_script

from .conftest import ROOT

LIMIT_S = 180  # a busy 2-core machine starts two torch processes in ~10 s
TIMEOUT_S = 2
#: a rank silent this long was declared lost before the fix: stall_timeout, the inspector's wait for answers, 2 ticks
LOST_AFTER_S = TIMEOUT_S + StallInspector.ANSWER_WITHIN_S + 2
#: how long rank 1's call is meant to last (the fit to this machine is rough when others load it)
SILENT_S = LOST_AFTER_S + 8

# One match of a catastrophically backtracking pattern is one C call that holds the GIL
# throughout (the regex engine never releases it), as a list.sort() of 40M floats or a long
# pickle would; every extra "a" doubles its time, so the length is fitted to this machine.
SCRIPT = f"""
    import os, re, signal, time, torch, hpcddp
    hpcddp.init()
    hpcddp.allreduce(torch.ones(1))

    def hold_the_gil(seconds):
        pattern = re.compile(r"(a+)+$")
        n, took = 16, 0.0
        while took < 0.2:
            n += 1
            started = time.monotonic()
            pattern.match("a" * n + "b")
            took = time.monotonic() - started
        while took < seconds:
            n, took = n + 1, 2 * took
        started = time.monotonic()
        pattern.match("a" * n + "b")
        return time.monotonic() - started

    me = f"rank {{hpcddp.rank()}}"
    how = [what.removeprefix(me + " ") for what in os.environ["HOW"].split(",") if what.startswith(me + " ")]
    if "busy" in how:
        print(f"{{me}} held the GIL for {{hold_the_gil({SILENT_S}):.1f}} s", flush=True)
    elif "stopped" in how:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif "paused" in how:  # PAUSES times for PAUSE_S, awake 0.3 s in between
        import subprocess
        for _ in range(int(os.environ.get("PAUSES", "1"))):
            subprocess.Popen(["sh", "-c", f"sleep {{os.environ['PAUSE_S']}}; kill -CONT {{os.getpid()}}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.3)
        print(f"{{me}} resumed", flush=True)
    elif "sleeping" in how:  # in Python, outside hpcddp: it answers the inspector but waits in no operation
        time.sleep(float(os.environ["SLEEP_S"]))
    total = hpcddp.allreduce(torch.full((1,), float(hpcddp.rank() + 1)), op=hpcddp.ReduceOp.SUM)
    print(f"rank {{hpcddp.rank()}} sum {{int(total)}}", flush=True)
"""


@pytest.mark.unit
def test_a_process_is_busy_while_it_computes_not_while_it_sleeps_or_once_stopped_or_dead():
    computing = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeping = subprocess.Popen(["sleep", "60"])
    try:
        process, asleep = ((p.pid, int(liveness._stat(p.pid)[19])) for p in (computing, sleeping))
        assert liveness.busy_processes([process, asleep]) == {process}
        assert liveness.busy_processes([(computing.pid, process[1] + 1)]) == set()  # another process, same pid
        computing.send_signal(signal.SIGSTOP)
        assert liveness.busy_processes([process]) == set()
    finally:
        for p in (computing, sleeping):
            p.kill()
            p.wait()
    assert liveness.busy_processes([process]) == set()
    assert liveness.this_process()[1] == os.getpid()


def launch(tmp_path, how, timeout_s=TIMEOUT_S, num_ranks=2, **env):
    started = time.monotonic()
    env = {"HPCDDP_STALL_TIMEOUT": str(timeout_s), "HOW": how, **env}
    result = run_script(num_ranks, SCRIPT, tmp_path, timeout=LIMIT_S, env=env, cwd=ROOT)
    assert not result.timed_out, f"the job hung until the time limit:\n{result.stdout[-5000:]}"
    return result.stdout, time.monotonic() - started


@pytest.mark.ranks
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_holding_the_gil_in_one_long_c_call_is_busy_not_lost(tmp_path, rank):
    # Rank 1 does not answer rank 0's questions; rank 0 does not answer rank 1's alarm.
    out, _ = launch(tmp_path, f"rank {rank} busy")
    held = re.search(rf"rank {rank} held the GIL for ([\d.]+) s", out)
    assert held and float(held.group(1)) >= LOST_AFTER_S, out[-5000:]
    assert "rank 0 sum 3" in out and "rank 1 sum 3" in out, out[-5000:]
    assert "aborting" not in out and "did not answer" not in out, out[-5000:]
    assert re.search(rf"rank {rank} on (node )?\S+ is busy in a long call outside Python \(CPU time advancing\)", out)


@pytest.mark.ranks
def test_a_stopped_rank_is_still_lost(tmp_path):
    out, elapsed = launch(tmp_path, "rank 1 stopped")
    assert "sum 3" not in out, out[-5000:]
    assert re.search(r"rank 1 on node \S+ did not answer the inspector: dead, stopped", out), out[-5000:]
    assert "aborting the job: ranks were lost" in out, out[-5000:]
    assert elapsed < 90, f"{elapsed:.0f} s"


#: a longer stall timeout, for a pause that the old rule (lost after ANSWER_WITHIN_S of silence) took for a lost rank
PAUSED_TIMEOUT_S = 30
#: the pause: a rank was declared lost PAUSED_TIMEOUT_S + ANSWER_WITHIN_S + 2 ticks + 1 s of liveness after the
#: others began to wait (43 s) before the fix, and is now after PAUSED_TIMEOUT_S + lost_after (30 + 30 s)
PAUSE_S = 52


@pytest.mark.ranks
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_paused_for_less_than_the_stall_timeout_past_the_stall_is_not_lost(tmp_path, rank):
    # A rank silent and using no CPU for a while (its node's links stalled, the VM paused, a
    # debugger attached) answers late, not never: the job must go on, as after a slow network.
    out, elapsed = launch(tmp_path, f"rank {rank} paused", timeout_s=PAUSED_TIMEOUT_S, PAUSE_S=str(PAUSE_S))
    assert f"rank {rank} resumed" in out, out[-5000:]
    assert "aborting" not in out, out[-5000:]
    assert "rank 0 sum 3" in out and "rank 1 sum 3" in out, out[-5000:]
    assert elapsed >= PAUSE_S


@pytest.mark.ranks
def test_a_rank_that_wakes_briefly_between_pauses_longer_than_a_round_is_not_lost(tmp_path):
    # Each pause outlasts a round of questions (10 s) but not the 12 s a rank must stay silent:
    # rank 1 answers every round late. Before the fix its late answers were thrown away, and
    # its silence counted from the first round it missed: lost about 35 s in, though alive.
    out, _ = launch(tmp_path, "rank 1 paused", timeout_s=12, PAUSE_S="11.5", PAUSES="5")
    assert "rank 1 resumed" in out, out[-5000:]
    assert "aborting" not in out, out[-5000:]
    assert "rank 0 sum 3" in out and "rank 1 sum 3" in out, out[-5000:]


@pytest.mark.ranks
def test_a_stopped_rank_is_lost_while_rank_0_waits_in_no_operation(tmp_path):
    # Rank 0 computes outside hpcddp (a long evaluation), rank 1 waits for rank 2, which is
    # stopped for good. Rank 0 only asks when rank 1 alarms (every stall timeout); before the fix
    # it forgot rank 2's silence between alarms and never counted it lost (until rank 0 itself
    # waited a stall timeout and a lost_after more).
    out, elapsed = launch(tmp_path, "rank 0 sleeping,rank 2 stopped", timeout_s=20, num_ranks=3, SLEEP_S="75")
    assert re.search(r"rank 2 on node \S+ did not answer the inspector: dead, stopped", out), out[-5000:]
    assert "aborting the job: ranks were lost" in out, out[-5000:]
    assert elapsed < 75, f"{elapsed:.0f} s: not before rank 0 woke"
