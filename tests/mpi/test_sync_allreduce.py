"""The blocking allreduce runs in the caller's thread, in order with queued asynchronous work."""

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
