"""The stall report names the missing or different ranks and the likely cause (no MPI needed)."""

from hpcddp.stall import CollectiveLog, Descriptor, collective_tag, explain_stall


def status(rank, recent, running=None, last_step=None, waited=70.0, idle=65.0):
    return {
        "rank": rank,
        "running": running,
        "waited": waited if running else 0.0,
        "recent": recent,
        "last_step": last_step,
        "idle": idle,
    }


def bucket(seq, shape, step, index=2):
    return Descriptor(seq, "allreduce", (shape,), "float32", f"bucket {index} of step {step}", step)


def test_different_shapes_point_at_different_models():
    a, b = bucket(12, 10, 7), bucket(12, 12, 7)
    report = explain_stall({0: status(0, [a], a, 7), 1: status(1, [b], b, 7)}, 2, 60)
    assert "collective #12 has waited 70 s (stall_timeout=60 s)" in report
    assert "rank 0 submitted allreduce #12 of shape [10] float32 (bucket 2 of step 7)" in report
    assert "rank 1 submitted allreduce #12 of shape [12] float32 (bucket 2 of step 7) instead" in report
    assert "likely cause: different models on different ranks" in report
    assert report.endswith("waiting: ranks 0, 1; missing or different: rank 1")


def test_data_dependent_shapes_outside_the_optimizer():
    a = Descriptor(3, "allgather", (5, 2), "int64")
    b = Descriptor(3, "allgather", (4, 2), "float32")
    report = explain_stall({0: status(0, [a], a), 1: status(1, [b], b)}, 2, 60)
    assert "likely cause: data-dependent shapes: every rank must pass a tensor of the same shape and dtype" in report


def test_missing_and_silent_ranks():
    a, last = bucket(9, 10, 4, index=0), bucket(8, 10, 3, index=1)
    statuses = {
        0: status(0, [last, a], a, 4),
        1: status(1, [last], None, 3, idle=66),
        2: status(2, [last, a], a, 4),
        3: None,
    }
    report = explain_stall(statuses, 4, 60)
    assert "ranks 0, 2 submitted allreduce #9 of shape [10] float32 (bucket 0 of step 4)" in report
    assert (
        "rank 1 did not submit allreduce #9 (bucket 0 of step 4): its last collective was allreduce #8 of shape [10] "
        "float32 (bucket 1 of step 3), 66 s ago, and it waits in no collective" in report
    )
    assert (
        "it skipped a backward or called step() early, ran out of data (wrap the loop in hpcddp.join(optimizer)), "
        "or is busy outside hpcddp" in report
    )
    assert "rank 3 did not answer the inspector" in report
    assert report.endswith("waiting: ranks 0, 2; missing or different: ranks 1, 3")


def test_log_numbers_and_tags_submissions():
    log = CollectiveLog()
    log.submit("barrier")
    with collective_tag("bucket 0 of step 5", 5):
        desc = log.submit("allreduce", (3,), "float32")
    assert desc == Descriptor(2, "allreduce", (3,), "float32", "bucket 0 of step 5", 5)
    assert log.submit("broadcast", (1,), "int64").tag == ""
    assert log.last_step == 5 and log.waited() == (None, 0.0)
    log.start(desc)
    running, waited = log.waited()
    assert running is desc and waited >= 0


def test_running_collective_older_than_the_history_is_still_reported():
    # A model with more buckets in flight than the history holds: the running
    # collective has already left `recent` (this raised KeyError and silenced the inspector).
    running = bucket(5, 10, 2, index=0)
    later = [bucket(seq, 10, 2, index=seq) for seq in range(6, 10)]
    other = bucket(5, 10, 2, index=0)
    report = explain_stall({0: status(0, later, running, 2), 1: status(1, [other], other, 2)}, 2, 60)
    assert "collective #5 has waited 70 s" in report
    assert "ranks 0, 1 submitted allreduce #5" in report


def test_patient_collectives_are_marked():
    log = CollectiveLog()
    from hpcddp.stall import patient_collectives

    with patient_collectives():
        slow = log.submit("broadcast_object")
    quick = log.submit("allreduce", (3,), "float32")
    assert slow.patient and not quick.patient
