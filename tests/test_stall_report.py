"""The stall inspector's judgement and report from every rank's status (pure functions, no MPI)."""

import threading

import pytest

from hpcddp.comm import oplog
from hpcddp.comm.oplog import Descriptor, OperationLog, patient_collectives
from hpcddp.fault.stall import explain_stall
from hpcddp.fault.stall.report import exit_reason
from hpcddp.fault.stall.verdict import Exit, judge, stable

pytestmark = pytest.mark.unit

WORLD = "world"


def comm(members, started, running=(), p2p=(), recent=None, last_step=None, idle=65.0):
    running = [(desc, age) for desc, age in running]
    return {
        "members": tuple(members),
        "started": started,
        "running": running,
        "p2p": list(p2p),
        "recent": list(recent) if recent is not None else [d for d, _ in running],
        "last_step": last_step,
        "idle": idle,
    }


def status(rank, comms, waits=(), progress=0, cpu=None, clock=100.0):
    cpu = 0.0 if cpu is None else cpu  # CPU seconds outside hpcddp
    return {"rank": rank, "comms": comms, "waits": list(waits), "progress": progress, "cpu": cpu, "clock": clock}


def bucket(seq, shape, step, index=2):
    return Descriptor(seq, "allreduce", (shape,), "float32", f"bucket {index} of step {step}", step)


WAITING = [(WORLD, "allreduce", 70.0)]


# ---- reports ------------------------------------------------------------------------------------


def test_different_shapes_point_at_different_models():
    a, b = bucket(12, 10, 7), bucket(12, 12, 7)
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 12, [(a, 70.0)], last_step=7)}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 12, [(b, 70.0)], last_step=7)}, WAITING),
    }
    report = explain_stall(statuses, {}, 2, 60)
    assert "collective #12 has waited 70 s (stall_timeout=60 s)" in report
    assert "rank 0 submitted allreduce #12 of shape [10] float32 (bucket 2 of step 7)" in report
    assert "rank 1 submitted allreduce #12 of shape [12] float32 (bucket 2 of step 7) instead" in report
    assert "likely cause: different models on different ranks" in report
    assert report.endswith("waiting: ranks 0, 1; missing or different: rank 1")


def test_data_dependent_shapes_outside_the_optimizer():
    a = Descriptor(3, "allgather", (5, 2), "int64")
    b = Descriptor(3, "allgather", (4, 2), "float32")
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 3, [(a, 70.0)])}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 3, [(b, 70.0)])}, WAITING),
    }
    report = explain_stall(statuses, {}, 2, 60)
    assert "likely cause: data-dependent shapes: every rank must pass a tensor of the same shape and dtype" in report


def test_missing_and_silent_ranks_are_named_with_the_node_of_a_lost_rank():
    a, last = bucket(9, 10, 4, index=0), bucket(8, 10, 3, index=1)
    statuses = {
        0: status(0, {WORLD: comm(range(4), 9, [(a, 70.0)], recent=[last, a], last_step=4)}, WAITING),
        1: status(1, {WORLD: comm(range(4), 8, [], recent=[last], last_step=3, idle=66)}),
        2: status(2, {WORLD: comm(range(4), 9, [(a, 70.0)], recent=[last, a], last_step=4)}, WAITING),
        3: None,
    }
    report = explain_stall(statuses, {}, 4, 60, hosts=["n1", "n1", "n2", "n2"])
    assert "ranks 0, 2 submitted allreduce #9 of shape [10] float32 (bucket 0 of step 4)" in report
    assert (
        "rank 1 did not submit allreduce #9 (bucket 0 of step 4): its last collective was allreduce #8 of shape [10] "
        "float32 (bucket 1 of step 3), 66 s ago, and it waits in no collective" in report
    )
    assert "it skipped a backward or called step() early, ran out of data" in report
    assert "rank 3 on node n2 did not answer the inspector" in report
    assert report.endswith("waiting: ranks 0, 2; missing or different: ranks 1, 3")


def test_a_stall_inside_a_subgroup_names_ranks_of_the_whole_job():
    # 3 ranks; the group of ranks 1 and 2: rank 2 is in a world allreduce instead.
    sub, world = Descriptor(1, "allreduce", (3,), "float64"), Descriptor(4, "allreduce", (8,), "float32")
    statuses = {
        0: status(0, {WORLD: comm(range(3), 4, [(world, 20.0)])}, WAITING),
        1: status(1, {WORLD: comm(range(3), 3, []), "g": comm([1, 2], 1, [(sub, 70.0)])}, WAITING),
        2: status(2, {WORLD: comm(range(3), 4, [(world, 20.0)]), "g": comm([1, 2], 0, [])}, WAITING),
    }
    report = explain_stall(statuses, {}, 3, 60)
    assert "collective #1 on the group of ranks 1, 2 has waited 70 s" in report
    assert "rank 1 submitted allreduce #1 of shape [3] float64" in report
    assert "rank 2 did not submit allreduce #1" in report and "it waits in allreduce #4 of shape [8] float32" in report
    assert judge(statuses, {}) == "deadlock"


def test_running_collective_older_than_the_history_is_still_reported():
    running = bucket(5, 10, 2, index=0)
    later = [bucket(seq, 10, 2, index=seq) for seq in range(6, 10)]
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 9, [(running, 70.0)], recent=later, last_step=2)}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 5, [(bucket(5, 10, 2, index=0), 70.0)], last_step=2)}, WAITING),
    }
    assert "collective #5 has waited 70 s" in explain_stall(statuses, {}, 2, 60)


def test_patient_collectives_are_not_reported():
    patient = Descriptor(4, "broadcast_object", patient=True)
    statuses = {0: status(0, {WORLD: comm([0, 1], 4, [(patient, 500.0)])}, WAITING), 1: status(1, {})}
    assert explain_stall(statuses, {}, 2, 60) == "[hpcddp stall inspector] no rank is waiting in a collective any more"


# ---- verdicts -----------------------------------------------------------------------------------


def test_a_rank_that_computes_is_slow_never_deadlocked():
    a = Descriptor(6, "allreduce", (4,), "float32")
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 6, [(a, 70.0)])}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 5, [])}),  # no thread waits: it is busy and may still come
    }
    assert judge(statuses, {}) == "slow"


def test_every_rank_inside_the_same_long_transfer_is_slow_not_deadlocked():
    a = Descriptor(6, "allreduce", (1 << 28,), "float32")
    statuses = {r: status(r, {WORLD: comm([0, 1], 6, [(a, 70.0)])}, WAITING) for r in (0, 1)}
    assert judge(statuses, {}) == "slow"


def test_a_collective_against_a_receive_is_a_deadlock_and_a_matching_send_is_not():
    a = Descriptor(1, "allreduce", (4,), "float32")
    recv = ("recv", 0, 0, 30.0)
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 1, [(a, 30.0)])}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 0, [], p2p=[recv])}, [(WORLD, "recv from rank 0", 30.0)]),
    }
    assert judge(statuses, {}) == "deadlock"
    assert "it waits in recv from rank 0 (tag 0, 30 s)" in explain_stall(statuses, {}, 2, 5)
    statuses[0]["comms"][WORLD]["p2p"] = [("send", 1, 0, 30.0)]  # rank 0 did post the message
    assert judge(statuses, {}) == "slow"


def test_different_collectives_at_the_same_place_cannot_match():
    # With the agreement check off, a barrier against an allreduce never completes.
    a, b = Descriptor(7, "allreduce", (4,), "float32"), Descriptor(7, "barrier")
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 7, [(a, 9.0)])}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 7, [(b, 9.0)])}, WAITING),
    }
    assert judge(statuses, {}) == "deadlock"


def test_a_deadlock_is_certain_only_if_nothing_changed_between_two_snapshots():
    a = Descriptor(1, "allreduce", (4,), "float32")
    first = {
        0: status(0, {WORLD: comm([0, 1], 1, [(a, 3.0)])}, WAITING, progress=10),
        1: status(1, {WORLD: comm([0, 1], 0, [], p2p=[("recv", 0, 0, 3.0)])}, WAITING, progress=7),
    }
    second = {r: dict(s, clock=101.0, cpu=0.05) for r, s in first.items()}  # 5 % of a core
    assert stable(first, second)
    second[1] = dict(second[1], progress=8)  # rank 1 moved on between the two looks
    assert not stable(first, second)
    second[1] = None
    assert not stable(first, second)


def test_a_rank_whose_other_thread_computes_is_not_stuck_though_its_waits_do_not_move():
    a = Descriptor(1, "allreduce", (4,), "float32")
    first = {r: status(r, {WORLD: comm([0, 1], 1, [(a, 3.0)])}, WAITING, progress=5) for r in (0, 1)}
    second = {r: dict(s, clock=100.5) for r, s in first.items()}
    second[1]["cpu"] = 0.45  # 0.9 of a core in 0.5 s: threads of rank 1 outside hpcddp compute
    assert not stable(first, second)


def test_a_rank_that_exited_before_the_collective_ends_the_job_with_its_code():
    a = Descriptor(6, "allreduce", (4,), "float32")
    statuses = {0: status(0, {WORLD: comm([0, 1], 6, [(a, 2.0)])}, WAITING)}
    exits = {1: Exit("exited", 3, {WORLD: 5})}
    assert judge(statuses, exits) == "exited"
    reason, code = exit_reason(statuses, exits)
    assert code == 3
    assert (
        reason
        == "rank 1 exited with exit code 3 while rank 0 waits in allreduce #6 of shape [4] float32, which needs it"
    )
    assert "rank 1 exited with exit code 3 after #5: it will never submit #6" in explain_stall(statuses, exits, 2, 60)


def test_a_rank_that_left_after_taking_part_is_a_clean_end():
    a = Descriptor(6, "allreduce", (4,), "float32")
    statuses = {0: status(0, {WORLD: comm([0, 1], 6, [(a, 0.1)])}, WAITING)}
    # Rank 1 finished #6 (a ring completes on one rank first) and ended its script.
    assert judge(statuses, {1: Exit("ended its script", None, {WORLD: 6})}) == "slow"
    # A subgroup rank 1 closed still counts: it got to #6 there too.
    assert judge(statuses, {1: Exit("ended its script", 0, {"g": 2, WORLD: 6})}) == "slow"


def test_a_rank_that_does_not_answer_is_lost():
    statuses = {0: status(0, {WORLD: comm([0, 1], 1, [])}), 1: None}
    assert judge(statuses, {}) == "lost"


def test_a_rank_that_does_not_answer_but_uses_the_cpu_is_only_slow():
    # Rank 1 holds the GIL in a long C call; rank 3 neither answers nor computes.
    a = bucket(9, 10, 4, index=0)
    waiting = status(0, {WORLD: comm(range(4), 9, [(a, 70.0)])}, WAITING)
    statuses = {0: waiting, 1: None, 2: status(2, {WORLD: comm(range(4), 9, [(a, 70.0)])}, WAITING), 3: None}
    assert judge(statuses, {}, busy={1, 3}) == "slow"
    assert judge(statuses, {}, busy={1}) == "lost"
    report = explain_stall(statuses, {}, 4, 60, hosts=["n1", "n1", "n2", "n2"], busy={1})
    assert "rank 1 on node n1 is busy in a long call outside Python (CPU time advancing)" in report
    assert "rank 3 on node n2 did not answer the inspector: dead, stopped, or hung without using the CPU" in report
    assert report.endswith("waiting: ranks 0, 2; missing or different: ranks 1, 3")


# ---- the logs every road writes -----------------------------------------------------------------


def test_log_numbers_operations_as_they_start_and_carries_their_tags():
    log = OperationLog("k", (0, 1))
    pending = oplog.describe("allreduce", (3,), "float32", label="bucket 0 of step 5", step=5)
    first = log.start(oplog.describe("barrier"))
    second = log.start(pending)
    assert (first, second) == (1, 2)
    assert log.status()["recent"][-1] == Descriptor(2, "allreduce", (3,), "float32", "bucket 0 of step 5", 5)
    assert log.last_step == 5
    running, waited = log.running()
    assert running.seq == first and running.op == "barrier" and waited >= 0
    log.finish(first)
    log.finish(second)
    assert log.running() == (None, 0.0)
    with patient_collectives():
        assert oplog.describe("broadcast_object").patient
        assert oplog.is_patient()
    assert not oplog.is_patient()


def test_rank_status_shows_waits_messages_and_closed_communicators():
    log = OperationLog("k2", (0, 1))
    oplog.register(log)
    try:
        token = log.post("recv", 1, 4)
        started = threading.Event()
        release = threading.Event()

        def wait():
            with oplog.waiting(log, "recv from rank 1"):
                started.set()
                release.wait()

        thread = threading.Thread(target=wait)
        thread.start()
        started.wait()
        mine = oplog.rank_status(0)
        assert mine["comms"]["k2"]["p2p"][0][:3] == ("recv", 1, 4)
        assert [w[:2] for w in mine["waits"]] == [("k2", "recv from rank 1")]
        release.set()
        thread.join()
        log.delivered(token)
        log.finish(log.start(oplog.describe("barrier")))
        assert oplog.rank_status(0)["progress"] > mine["progress"]
    finally:
        oplog.unregister(log)
    assert oplog.started_counts()["k2"] == 1


@pytest.mark.parametrize("kind", ["send", "recv"])
def test_messages_are_named_in_reports(kind):
    statuses = {
        0: status(0, {WORLD: comm([0, 1], 0, [], p2p=[(kind, 1, 3, 12.0)])}, WAITING),
        1: status(1, {WORLD: comm([0, 1], 0, [])}),
    }
    assert judge(statuses, {}) == "slow"


# ---- replies of constant size: members come with a communicator's first member only -------------


def lean(status_, first_of=()):
    """``status_`` as a rank sends it to rank 0: member lists only for the communicators it is first of."""
    for key, c in status_["comms"].items():
        c["size"] = len(c["members"])
        if key not in first_of:
            del c["members"]
    return status_


def test_verdicts_from_replies_without_member_lists():
    a = Descriptor(6, "allreduce", (4,), "float32")
    waiting = {
        r: lean(status(r, {WORLD: comm(range(4), 6, [(a, 70.0)])}, WAITING), [WORLD] if r == 0 else [])
        for r in range(3)
    }
    # Rank 3 is still computing: slow; once it waits in the same allreduce nothing is wrong but time.
    computing = {**waiting, 3: lean(status(3, {WORLD: comm(range(4), 5, [])}))}
    assert judge(computing, {}) == "slow"
    # Rank 3 waits in a receive nobody sends: every rank is stuck.
    receiving = {**waiting, 3: lean(status(3, {WORLD: comm(range(4), 5, [], p2p=[("recv", None, 9, 70.0)])}, WAITING))}
    assert judge(receiving, {}) == "deadlock"
    # Rank 3 left after #5: the allreduce the others wait in can never complete.
    left = {**waiting, 3: None}
    exits = {3: Exit("exited", 4, {WORLD: 5})}
    assert judge(left, exits) == "exited"
    assert exit_reason(left, exits) == (
        "rank 3 exited with exit code 4 while ranks 0, 1, 2 wait in allreduce #6 of shape [4] float32, which needs it",
        4,
    )
    report = explain_stall(computing, {}, 4, 60)
    assert "rank 3 did not submit allreduce #6" in report
    assert report.endswith("waiting: ranks 0, 1, 2; missing or different: rank 3")


def test_a_subgroup_whose_first_member_is_not_rank_0_is_named_from_its_first_members_reply():
    sub = Descriptor(1, "allreduce", (3,), "float64")
    statuses = {
        0: status(0, {WORLD: comm(range(4), 3, [])}),
        1: lean(status(1, {WORLD: comm(range(4), 3, []), "g": comm([1, 3], 1, [(sub, 70.0)])}, WAITING), ["g"]),
        2: lean(status(2, {WORLD: comm(range(4), 3, [])})),
        3: lean(status(3, {WORLD: comm(range(4), 3, []), "g": comm([1, 3], 0, [])})),
    }
    report = explain_stall(statuses, {}, 4, 60)
    assert "collective #1 on the group of ranks 1, 3 has waited 70 s" in report
    assert "rank 3 did not submit allreduce #1" in report
    assert judge(statuses, {}) == "slow"


def test_long_lists_of_ranks_are_cut_short():
    # 200 ranks: rank 0 alone in allreduce #7; the others have not started it.
    a = Descriptor(7, "allreduce", (4,), "float32")
    statuses = {0: status(0, {WORLD: comm(range(200), 7, [(a, 70.0)])}, WAITING)}
    statuses.update({r: lean(status(r, {WORLD: comm(range(200), 6, [], recent=[])})) for r in range(1, 200)})
    report = explain_stall(statuses, {}, 200, 60)
    assert report.count("did not submit allreduce #7") == 8
    assert "  ... and 191 ranks (9-199) did not submit #7 either" in report
    assert report.endswith("waiting: rank 0; missing or different: 199 ranks (1-199)")
    assert len(report.splitlines()) < 25
