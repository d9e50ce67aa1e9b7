"""Bucket assignment follows DDP's rule; gradients are views into the flat buffers."""

import pytest
import torch

from hpcddp.ddp.buckets import MB, assign_buckets, build_buckets

pytestmark = pytest.mark.unit


def tensors(*sizes, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in sizes]


def test_reverse_order_and_first_bucket_small():
    # 4-byte floats: 0.25M elements = 1 MiB.
    params = tensors(*[MB // 4] * 6)
    assert assign_buckets(params, bucket_cap_bytes=2 * MB, first_bucket_bytes=MB) == [[5], [4, 3], [2, 1], [0]]


def test_bucket_closes_once_it_reaches_its_cap():
    params = tensors(100, 100, 100, 100)
    # 400 bytes each; cap 1000 bytes -> 3 tensors (1200 >= 1000) then the rest.
    assert assign_buckets(params, bucket_cap_bytes=1000, first_bucket_bytes=1000) == [[3, 2, 1], [0]]


def test_one_large_tensor_gets_its_own_bucket():
    params = tensors(10, 10_000_000, 10)
    assert assign_buckets(params, 25 * MB, MB) == [[2, 1], [0]]


def test_dtypes_never_share_a_bucket():
    params = [
        torch.zeros(10),
        torch.zeros(10, dtype=torch.float64),
        torch.zeros(10),
        torch.zeros(10, dtype=torch.float64),
    ]
    buckets = assign_buckets(params, 25 * MB, MB)
    for bucket in buckets:
        assert len({params[i].dtype for i in bucket}) == 1
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3]


def test_views_share_the_flat_buffer():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    (bucket,) = build_buckets(params, 25 * MB, MB)
    assert [p.shape for p in bucket.params] == [torch.Size([5]), torch.Size([3, 4])]
    bucket.views[1].fill_(2.0)
    assert bucket.buffer[5:17].eq(2.0).all()
    assert bucket.used.numel() == 2 and bucket.buffer.numel() == 17 + 2


def test_compression_allocates_a_wire_buffer():
    params = [torch.nn.Parameter(torch.randn(8))]
    (bucket,) = build_buckets(params, 25 * MB, MB, wire_dtype=torch.float16)
    assert bucket.wire.dtype == torch.float16 and bucket.wire.numel() == bucket.buffer.numel()


def test_views_keep_the_strides_of_channels_last_parameters():
    # As DDP's bucket views: fused CUDA optimizers (AdamW(fused=True)) need grad and param of one layout.
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    linear = torch.nn.Linear(4, 5)
    params = [conv.weight, conv.bias, linear.weight]
    (bucket,) = build_buckets(params, 25 * MB, 25 * MB)
    for param, view in zip(bucket.params, bucket.views):
        assert (view.shape, view.stride()) == (param.shape, param.stride())
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    # Each view covers its own block of the buffer, in its layout: writing the parameter's values shows them there.
    offset = 0
    for param, view in zip(bucket.params, bucket.views):
        view.copy_(torch.arange(param.numel(), dtype=view.dtype).view(param.shape))
        block = bucket.buffer[offset : offset + param.numel()]
        torch.testing.assert_close(block, view.permute(*_memory_order(view)).reshape(-1))
        offset += param.numel()


def test_a_parameter_with_gaps_gets_a_contiguous_view():
    base = torch.zeros(4, 6)
    param = torch.nn.Parameter(base[:, ::2])  # strides (6, 2): not dense
    (bucket,) = build_buckets([param], 25 * MB, 25 * MB)
    assert bucket.views[0].shape == param.shape and bucket.views[0].is_contiguous()


def _memory_order(tensor):
    """Dims from outermost to innermost in memory."""
    return sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))


def test_used_flags_are_written_as_ones_and_zeros():
    from hpcddp.ddp.buckets import write_used_flags

    used = torch.full((6,), 7.0)
    for flags in (
        [True] * 6,
        [False] * 6,
        [True, False, True, True, False, True],
        [False, True, True, False, False, True],
    ):
        write_used_flags(used, flags)
        assert used.tolist() == [float(f) for f in flags]


def test_unused_gradients_of_several_buckets_go_back_to_none():
    from hpcddp.ddp.buckets import drop_unused_grads

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 5)]
    buckets = build_buckets(params, bucket_cap_bytes=1, first_bucket_bytes=1)
    assert len(buckets) == 3
    for bucket in buckets:
        for param, view in zip(bucket.params, bucket.views):
            param.grad = view
        bucket.used.fill_(2)  # summed over two ranks
    buckets[1].used.fill_(0)
    drop_unused_grads(buckets)
    assert [p.grad is None for p in params] == [p is buckets[1].params[0] for p in params]
