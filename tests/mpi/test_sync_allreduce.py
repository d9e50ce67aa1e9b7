"""The blocking allreduce runs in the caller's thread, in order with queued asynchronous work."""

import numpy as np
import pytest
import torch

import hpcddp


def test_blocking_allreduce_after_pending_async_work_keeps_order():
    n = hpcddp.size()
    big = torch.full((1 << 18,), float(hpcddp.rank() + 1))
    small = torch.full((4,), 2.0 * (hpcddp.rank() + 1))
    handle = hpcddp.allreduce_async_(big, op="sum")
    # Queued behind `big` (or run by whoever is free): must not overtake it.
    out = hpcddp.allreduce_(small, op="average")
    assert out is small
    torch.testing.assert_close(small, torch.full((4,), float(n + 1)))
    handle.wait()
    torch.testing.assert_close(big, torch.full((1 << 18,), n * (n + 1) / 2))


def test_blocking_allreduce_of_every_supported_kind():
    n = hpcddp.size()
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        t = torch.full((5,), hpcddp.rank() + 1, dtype=dtype)
        assert hpcddp.allreduce_(t, op="sum") is t
        assert t.tolist() == [n * (n + 1) // 2] * 5, dtype
    t = torch.arange(6.0).reshape(2, 3)[:, ::2]  # not contiguous: staged through a copy
    expected = t * n
    hpcddp.allreduce_(t, op="sum")
    torch.testing.assert_close(t, expected)


# 8 elements, and 1.2 MB: above the two-level allreduce's threshold, planned on a flat communicator.
SIZES = [8, 300_000]


@pytest.mark.parametrize("count", SIZES)
def test_planned_allreduce_repeated_then_mismatched_raises_on_every_rank(count):
    # The same signature again and again (its plan is kept), then one rank changes
    # shape, dtype or op: every rank raises, and the next matching call still sums right.
    n, rank = hpcddp.size(), hpcddp.rank()
    t = torch.full((count,), float(rank + 1))
    for _ in range(3):
        t.fill_(rank + 1)
        hpcddp.allreduce_(t, op="sum")
        assert np.array_equal(t.numpy(), np.full(count, n * (n + 1) / 2, dtype=np.float32))
    last = n - 1
    mismatches = [
        (torch.ones(count if rank != last else count + 1), "sum"),
        (torch.ones(count, dtype=torch.float32 if rank != last else torch.float64), "sum"),
        (torch.ones(count), "sum" if rank != last else "max"),
    ]
    for tensor, op in mismatches:
        with pytest.raises(hpcddp.CollectiveMismatchError):
            hpcddp.allreduce_(tensor, op=op)
    t.fill_(rank + 1)
    hpcddp.allreduce_(t, op="average")
    assert np.array_equal(t.numpy(), np.full(count, (n + 1) / 2, dtype=np.float32))


@pytest.mark.parametrize("count", SIZES)
def test_planned_allreduce_pairs_with_a_rank_whose_tensor_is_not_contiguous(count):
    # Rank 0 passes a view (the general path), the others a contiguous tensor of the
    # same shape (the planned path): the same MPI calls, so they sum together.
    n, rank = hpcddp.size(), hpcddp.rank()
    base = torch.full((count, 2), float(rank + 1))
    tensor = base[:, 0] if rank == 0 else torch.full((count,), float(rank + 1))
    hpcddp.allreduce_(tensor, op="sum")
    assert np.array_equal(tensor.numpy(), np.full(count, n * (n + 1) / 2, dtype=np.float32))


def test_planned_allreduce_with_checks_off_then_on_still_agrees():
    # A kept plan knows whether checks were on: switching them must not reuse the other's.
    n, rank, comm = hpcddp.size(), hpcddp.rank(), hpcddp.communicator()
    t = torch.ones(3)
    comm.check_collectives = False
    try:
        hpcddp.allreduce_(t, op="sum")
    finally:
        comm.check_collectives = True
    assert t.tolist() == [float(n)] * 3
    with pytest.raises(hpcddp.CollectiveMismatchError):
        hpcddp.allreduce_(torch.ones(3 if rank else 2), op="sum")


def test_out_of_place_average_divides_without_torch_kernels(monkeypatch):
    # The out-of-place result is made by MPI itself (no copy of the input first), and the
    # division of an average is its one extra pass, on one thread (numpy), not on torch's
    # intra-op threads, which fight unbound ranks for the cores (4 MiB: 28 ms against 0.3).
    calls = []
    for name in ("div_", "copy_", "clone", "mul_"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    n, rank = hpcddp.size(), hpcddp.rank()
    source = torch.arange(1 << 16, dtype=torch.float32) * (rank + 1)
    out = hpcddp.allreduce(source)
    assert calls == []
    expected = np.arange(1 << 16, dtype=np.float32) * np.float32(n * (n + 1) / 2) / np.float32(n)
    assert np.array_equal(out.numpy(), expected)
    assert torch.equal(source, torch.arange(1 << 16, dtype=torch.float32) * (rank + 1))
