"""The single-process communicator's newer operations and the collective-check switch, without MPI."""

import pytest
import torch

from hpcddp.comm.agreement import CollectiveCall, agreement_vector, describe_call, disagrees, mismatch_message
from hpcddp.comm.base import Handle, ReduceOp, even_splits, parse_op, splits_error
from hpcddp.comm.local import LocalCommunicator
from hpcddp.env.settings import read_settings
from hpcddp.runtime.config import InitConfig

pytestmark = pytest.mark.unit


def test_local_operations_are_the_identity_with_checked_arguments():
    comm = LocalCommunicator()
    t = torch.arange(6.0).reshape(3, 2)
    assert comm.reduce_async_(t, ReduceOp.PRODUCT, 0).wait() is t
    torch.testing.assert_close(comm.gather_async(t, 0).wait(), t)
    torch.testing.assert_close(comm.reducescatter_async(t, ReduceOp.SUM).wait(), t)
    out, received = comm.alltoall_async(t, [3]).wait()
    torch.testing.assert_close(out, t)
    assert received.tolist() == [3]
    target = torch.empty(3, 2)
    assert comm.scatter_async_(target, [t], 0).wait() is target
    torch.testing.assert_close(target, t)
    with pytest.raises(ValueError, match="splits must add up"):
        comm.alltoall_async(t, [2])
    with pytest.raises(ValueError, match="root must be a rank in"):
        comm.gather_async(t, 1)


def test_local_send_to_self_in_either_order():
    comm = LocalCommunicator()
    got = torch.empty(2)
    pending = comm.recv_async_(got, 0, tag=3)
    assert not pending.poll()
    comm.send_async(torch.tensor([1.0, 2.0]), 0, tag=3)
    assert pending.wait() is got and got.tolist() == [1.0, 2.0]
    comm.send_async(torch.tensor([5.0]), 0)
    with pytest.raises(ValueError, match="does not fit"):
        comm.recv_async_(torch.empty(2), 0).wait()


def test_local_split():
    comm = LocalCommunicator()
    assert comm.split([0]).size == 1
    with pytest.raises(ValueError, match="ranks must be distinct ranks in"):
        comm.split([1])


def test_even_splits_follow_horovod():
    assert even_splits(7, 3) == [3, 2, 2]
    assert even_splits(2, 3) == [1, 1, 0]
    assert splits_error([1, 2], 3, 2) is None
    assert "one per rank" in splits_error([3], 3, 2)
    assert parse_op("prod") is ReduceOp.PRODUCT


def test_agreement_vectors_and_message():
    a = describe_call("allreduce", torch.ones(2, 3), reduce_op=ReduceOp.SUM, name="grad")
    b = describe_call("allreduce", torch.ones(2, 4), reduce_op=ReduceOp.SUM, name="grad")
    combined = [min(x, y) for x, y in zip(agreement_vector(a), agreement_vector(a))]
    assert not disagrees(combined)
    combined = [min(x, y) for x, y in zip(agreement_vector(a), agreement_vector(b))]
    assert disagrees(combined)
    message = mismatch_message([a, b])
    assert message.startswith(
        "allreduce of tensor 'grad': the ranks disagree: shape differs (rank 0: [2, 3]; rank 1: [2, 4])"
    )
    bad = CollectiveCall("alltoall", error="splits must add up")
    assert disagrees(agreement_vector(bad))
    assert "rank 1: splits must add up" in mismatch_message([CollectiveCall("alltoall"), bad])
    # Names are compared too (Horovod's name=): the same shape under another name is a mismatch.
    x, y, unnamed = (describe_call("allreduce", torch.ones(4), reduce_op=ReduceOp.SUM, name=n) for n in ("x", "y", ""))
    assert disagrees([min(p, q) for p, q in zip(agreement_vector(x), agreement_vector(y))])
    message = mismatch_message([x, y, unnamed])
    assert message.startswith(
        "allreduce: the ranks disagree: tensor name differs (rank 0: 'x'; rank 1: 'y'; rank 2: no name); "
    )
    assert "where Horovod matches them by name" in message


def test_a_completion_hook_that_raises_is_logged_and_the_others_still_run(caplog):
    handle, seen = Handle("allreduce"), []
    handle.on_completion(lambda: 1 / 0)
    handle.on_completion(lambda: seen.append("second"))
    handle.set_result(5)  # in an engine's runner: an exception here would stop every later collective
    assert seen == ["second"] and handle.wait() == 5
    assert "a completion hook of allreduce failed" in caplog.text and "ZeroDivisionError" in caplog.text


def test_check_collectives_from_the_environment():
    assert read_settings({"HPCDDP_CHECK_COLLECTIVES": "0"}) == {"check_collectives": False}
    assert read_settings({"HPCDDP_CHECK_COLLECTIVES": "1"}) == {"check_collectives": True}
    with pytest.raises(ValueError, match="HPCDDP_CHECK_COLLECTIVES must be 0 or 1, got 'maybe'"):
        read_settings({"HPCDDP_CHECK_COLLECTIVES": "maybe"})
    with pytest.raises(ValueError, match="check_collectives must be True or False"):
        InitConfig(check_collectives="no")


def test_one_table_of_reduction_ops_and_of_dtypes():
    import torch.distributed as dist

    from hpcddp.comm.dtypes import DTYPES, HALF_DTYPES, dtype_name, dtype_named
    from hpcddp.comm.names import COLLECTIVES, ROWS_MAY_DIFFER
    from hpcddp.comm.reduction import REDUCTIONS, from_torch, to_torch

    for op in ReduceOp:
        if op is not ReduceOp.AVERAGE:
            assert from_torch(to_torch(op)) is op  # torch's op travels as itself
    assert from_torch(dist.ReduceOp.AVG) is ReduceOp.AVERAGE
    assert to_torch(ReduceOp.AVERAGE) == dist.ReduceOp.SUM  # an average travels as a sum
    assert REDUCTIONS[ReduceOp.PRODUCT].mpi == "PROD" and set(REDUCTIONS) == set(ReduceOp)
    assert HALF_DTYPES == (torch.float16, torch.bfloat16)
    for dtype in (*DTYPES, torch.bool):
        assert dtype_named(dtype_name(dtype)) is dtype
    assert ROWS_MAY_DIFFER <= set(COLLECTIVES)
    with pytest.raises(ValueError, match="PREMUL_SUM is NCCL-only"):
        from_torch(dist._make_nccl_premul_sum(2.0))


def test_a_handle_completed_from_another_thread_wakes_every_waiter_and_times_out_as_an_event():
    import threading
    import time

    handle = Handle("x")
    assert not handle.poll()
    for timeout in (0, -1, 0.05):
        with pytest.raises(TimeoutError):
            handle.wait(timeout)
    results: list = []
    waiters = [threading.Thread(target=lambda: results.append(handle.wait())) for _ in range(4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    threading.Thread(target=handle.set_result, args=(7,)).start()
    for waiter in waiters:
        waiter.join(5)
    assert results == [7, 7, 7, 7] and handle.poll() and handle.wait(0) == 7


def test_a_waiter_interrupted_holding_the_completion_lock_leaves_the_others_waiting_a_slice_at_most():
    import threading

    handle = Handle("x")
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(handle.wait()))
    waiter.start()
    handle._done._set = True  # set, its lock still taken: as after a Ctrl-C inside another waiter
    handle._result = 3
    waiter.join(2)
    assert results == [3]


def test_waiting_for_a_steps_buckets_raises_the_first_failure_in_bucket_order():
    from hpcddp.comm.base import BucketSums

    handles = [Handle("b0"), Handle("b1"), Handle("b2")]
    for handle in handles:
        handle.set_result("sum")

    def copy_back_fails(_):
        raise RuntimeError("copy back failed")

    handles[1].then(copy_back_fails)
    with pytest.raises(RuntimeError, match="copy back failed"):
        BucketSums.wait(handles)
    assert handles[0].waited and not handles[2].waited
