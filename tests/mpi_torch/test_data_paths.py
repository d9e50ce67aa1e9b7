"""Every tensor layout a user can pass, through every torch collective, against gloo on the same ranks.

The reference is gloo given contiguous copies of the same tensors (gloo itself reduces a
strided slice wrongly, silently: 12 of 24 values of ``t[::2]`` at 2 ranks); the hpcddp
backend, given the layout, must write the same values into the caller's tensor (bitwise:
both reduce in rank order for these sizes). Inputs are made from the rank so that a rank
that kept its own data, or data in the wrong layout, shows.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
LAYOUTS = ["contiguous", "transposed", "strided", "channels_last", "zero_size"]


def rank_size():
    return dist.get_rank(), dist.get_world_size()


def base(dtype, rank, shape=(4, 6), salt=0):
    values = torch.arange(int(torch.tensor(shape).prod())).reshape(shape) % 7 + 3 * rank + salt
    return values.to(dtype)


_reference = False  # True while the reference runs: every tensor made contiguous


@contextlib.contextmanager
def reference_run():
    global _reference
    _reference = True
    try:
        yield
    finally:
        _reference = False


def laid_out(tensor):
    return tensor.contiguous() if _reference else tensor


def shaped(layout, dtype, rank, salt=0):
    """A tensor of the given layout holding rank-dependent values (a fresh one per call)."""
    return laid_out(_shaped(layout, dtype, rank, salt))


def _shaped(layout, dtype, rank, salt):
    if layout == "contiguous":
        return base(dtype, rank, (4, 6), salt)
    if layout == "transposed":
        return base(dtype, rank, (6, 4), salt).t()
    if layout == "strided":
        return base(dtype, rank, (8, 6), salt)[::2]
    if layout == "channels_last":
        return base(dtype, rank, (2, 3, 2, 2), salt).contiguous(memory_format=torch.channels_last)
    if layout == "zero_size":
        return base(dtype, rank, (0, 6), salt)
    raise AssertionError(layout)


def both(gloo, run):
    """Run ``run`` over gloo on contiguous tensors, then over the default (hpcddp) group; both outcomes."""
    outcomes = []
    for group in (gloo, None):
        try:
            if group is gloo:
                with reference_run():
                    outcomes.append(("ok", run(group)))
            else:
                outcomes.append(("ok", run(group)))
        except (RuntimeError, ValueError, TypeError) as err:
            outcomes.append(("error", err))
    return outcomes


def assert_same(gloo, run):
    (gloo_kind, expected), (kind, got) = both(gloo, run)
    assert gloo_kind == "ok", f"the reference failed: {expected}"
    assert kind == "ok", f"gloo gave values, hpcddp raised: {got}"
    for e, g in zip(expected if isinstance(expected, list) else [expected], got if isinstance(got, list) else [got]):
        assert e.shape == g.shape, (e.shape, g.shape)
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_and_broadcast_write_the_callers_tensor(gloo, dtype, layout):
    rank, _ = rank_size()

    def all_reduce(group):
        t = shaped(layout, dtype, rank)
        dist.all_reduce(t, group=group)
        return t

    def broadcast(group):
        t = shaped(layout, dtype, rank)
        dist.broadcast(t, 0, group=group)
        return t

    assert_same(gloo, all_reduce)
    assert_same(gloo, broadcast)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_gathers_scatters_and_messages_fill_outputs_of_any_layout(gloo, dtype, layout):
    rank, size = rank_size()

    def out(salt=-1):
        return shaped(layout, dtype, 0, salt=100 + salt)  # a fill value no rank sends

    def all_gather(group):
        outputs = [out() for _ in range(size)]
        dist.all_gather(outputs, shaped(layout, dtype, rank), group=group)
        return outputs

    def gather(group):
        outputs = [out() for _ in range(size)] if rank == 0 else None
        dist.gather(shaped(layout, dtype, rank), outputs, dst=0, group=group)
        return outputs or []

    def scatter(group):
        output = out()
        inputs = [shaped(layout, dtype, r, salt=5) for r in range(size)] if rank == 0 else None
        dist.scatter(output, inputs, src=0, group=group)
        return output

    def send_recv(group):
        t = shaped(layout, dtype, rank, salt=9) if rank == 0 else out()
        if rank == 0:
            for peer in range(1, size):
                dist.send(t, peer, group=group)
        else:
            dist.recv(t, 0, group=group)
        return t

    for run in (all_gather, gather, scatter, send_recv):
        assert_same(gloo, run)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_flat_collectives_fill_outputs_of_any_layout(gloo, layout):
    rank, size = rank_size()

    def output_of(rows):
        if layout == "transposed":
            return laid_out(torch.full((6, rows), -1.0).t())  # (rows, 6) with strides (1, rows)
        if layout == "strided":
            return laid_out(torch.full((rows * 2, 6), -1.0)[::2])
        return torch.full((rows, 6), -1.0)

    def all_gather_into_tensor(group):
        output = output_of(2 * size)
        dist.all_gather_into_tensor(output, torch.full((2, 6), float(rank + 1)), group=group)
        return output

    def reduce_scatter_tensor(group):
        output = output_of(2)
        source = torch.arange(2 * size * 6, dtype=torch.float32).reshape(2 * size, 6) * (rank + 1)
        dist.reduce_scatter_tensor(output, source, group=group)
        return output

    def all_to_all_single(group):
        output = output_of(size)
        source = torch.arange(size * 6, dtype=torch.float32).reshape(size, 6) + 100 * rank
        dist.all_to_all_single(output, source, group=group)
        return output

    for run in (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single):
        assert_same(gloo, run)


def test_uneven_all_to_all_single_where_a_rank_sends_nothing(gloo):
    rank, size = rank_size()
    # Rank 0 routes nothing (an MoE step where no token went to any expert on it).
    sends = [0] * size if rank == 0 else [r + 1 for r in range(size)]
    receives = [0 if r == 0 else rank + 1 for r in range(size)]

    def run(group):
        source = torch.arange(sum(sends) * 3, dtype=torch.float32).reshape(-1, 3) + 1000 * rank
        output = torch.full((sum(receives), 3), -1.0)
        dist.all_to_all_single(output, source, receives, sends, group=group)
        return output

    assert_same(gloo, run)


def test_an_expanded_tensor_takes_the_result_as_over_gloo(gloo):
    rank, size = rank_size()
    summed = [[float(sum(r + 1 for r in range(size)))] * 3, [float(sum(r + 5 for r in range(size)))] * 3]
    for collective, want in (("all_reduce", summed), ("broadcast", [[1.0] * 3, [5.0] * 3])):
        results = []
        for group in (gloo, None):
            t = torch.tensor([[float(rank + 1)], [float(rank + 5)]]).expand(2, 3)
            if collective == "all_reduce":
                dist.all_reduce(t, group=group)
            else:
                dist.broadcast(t, 0, group=group)
            results.append(t.tolist())
        assert results == [want, want], (collective, results)
    t = torch.ones(2)
    dist.all_reduce(t)  # the group still works on every rank
    assert t.tolist() == [float(dist.get_world_size())] * 2


def test_an_expanded_tensor_takes_reduces_result_on_the_root(gloo):
    rank, size = rank_size()
    t = torch.tensor([[float(rank + 1)], [float(rank + 5)]]).expand(2, 3)
    dist.reduce(t, 0)
    if rank == 0:
        assert t.tolist() == [
            [float(sum(r + 1 for r in range(size)))] * 3,
            [float(sum(r + 5 for r in range(size)))] * 3,
        ]


def test_in_place_all_gather_whose_input_is_a_slice_of_the_output(gloo):
    rank, size = rank_size()

    def run(group):
        output = torch.full((size * 5,), -1.0)
        chunk = output[rank * 5 : (rank + 1) * 5]
        chunk.copy_(torch.arange(5.0) + 10 * rank)
        dist.all_gather_into_tensor(output, chunk, group=group)
        return output

    assert_same(gloo, run)


def test_broadcast_of_every_parameter_syncs_a_transposed_weight(gloo):
    rank, _ = rank_size()
    torch.manual_seed(rank)
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        model.weight.set_(model.weight.detach().t().contiguous().t())  # a transposed, non-contiguous weight
    assert not model.weight.is_contiguous()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    torch.manual_seed(0)
    reference = torch.nn.Linear(5, 3)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "HPCDDP_CHECK_COLLECTIVES=0"])
def test_a_ranks_own_argument_errors_raise_with_or_without_the_agreement_check(check):
    rank, size = rank_size()
    comm = dist.distributed_c10d._get_default_group().communicator
    saved, comm.check_collectives = comm.check_collectives, check
    try:
        with pytest.raises(ValueError, match="output"):
            dist.all_gather_into_tensor(torch.empty(size * 4 + 4), torch.ones(4))  # one chunk too many
        with pytest.raises(ValueError, match="output_tensor_list"):
            dist.all_gather([torch.empty(4) for _ in range(size - 1)], torch.ones(4))  # one output too few
    finally:
        comm.check_collectives = saved
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)  # nothing was sent: the next collective pairs up as usual
    assert t.tolist() == [float(sum(range(size)))] * 3
