"""hvd's op=hvd.Adasum and DistributedOptimizer(op=hvd.Adasum) against a numpy Adasum written here, at any size.

The reference follows Horovod 0.28.1's definition (horovod/common/ops/adasum/adasum.h):
adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b per tensor, dot products in
float64, a coefficient of 1 for a norm squared under sqrt(DBL_MIN), ranks paired as
[0, 1], [2, 3], then those pairs (r with r ^ level), each level stored in the tensor's dtype.
"""

import numpy as np
import pytest
import torch

import hpcddp
import hpcddp.horovod as hvd

POWER_OF_2 = hvd.size() & (hvd.size() - 1) == 0
needs_power_of_2 = pytest.mark.skipif(not POWER_OF_2, reason="Adasum needs a power-of-2 number of ranks")
TOLERANCE = {np.float64: 1e-12, np.float32: 2e-6, np.float16: 2e-3}
DTYPES = {np.float64: torch.float64, np.float32: torch.float32, np.float16: torch.float16}


def numpy_adasum(vectors, dtype):
    """Horovod's Adasum of ``vectors`` (rank order), each level rounded to ``dtype``."""
    vectors = [np.asarray(v, dtype=dtype).astype(np.float64).ravel() for v in vectors]
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    level = 1
    while level < len(vectors):
        for low in range(0, len(vectors), 2 * level):
            a, b = vectors[low], vectors[low + level]
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1.0 - dot / (2.0 * aa) if aa >= tiny else 1.0
            cb = 1.0 - dot / (2.0 * bb) if bb >= tiny else 1.0
            vectors[low] = (ca * a + cb * b).astype(dtype).astype(np.float64)
        level *= 2
    return vectors[0].astype(dtype)


def rank_array(rank, shape, dtype, seed=0):
    return np.random.default_rng([seed, rank]).normal(size=shape).astype(dtype)


def expected_for(shape, dtype, seed=0, scale=1.0):
    return numpy_adasum([rank_array(r, shape, dtype, seed) * dtype(scale) for r in range(hvd.size())], dtype)


def close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(actual.numpy().ravel(), np.asarray(expected).ravel(), rtol=tol, atol=tol)


@needs_power_of_2
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["f64", "f32", "f16"])
def test_every_allreduce_form_gives_numpys_adasum(dtype):
    shapes = [(5, 3), (7,), (2, 2, 2)]
    mine = [torch.from_numpy(rank_array(hvd.rank(), s, dtype, seed=i)) for i, s in enumerate(shapes)]
    expected = [expected_for(s, dtype, seed=i) for i, s in enumerate(shapes)]
    kept = [t.clone() for t in mine]
    out = hvd.allreduce(mine[0], op=hvd.Adasum, name="adasum.plain")
    assert out.shape == shapes[0] and out.dtype == DTYPES[dtype]
    close(out, expected[0], dtype)
    close(hvd.synchronize(hvd.allreduce_async(mine[1], op=hvd.Adasum)), expected[1], dtype)
    for t, k in zip(mine, kept):
        assert torch.equal(t, k)  # the out-of-place forms leave their input alone
    # Grouped: each tensor keeps its own dot products (per tensor, as in Horovod's fused buffer).
    for out, e in zip(hvd.grouped_allreduce(mine, op=hvd.Adasum), expected):
        close(out, e, dtype)
    for out, e in zip(hvd.synchronize(hvd.grouped_allreduce_async(mine, op=hvd.Adasum)), expected):
        close(out, e, dtype)
    in_place = [t.clone() for t in kept]
    assert hvd.allreduce_(in_place[0], op=hvd.Adasum) is in_place[0]
    hvd.synchronize(hvd.allreduce_async_(in_place[1], op=hvd.Adasum))
    hvd.grouped_allreduce_(in_place[2:], op=hvd.Adasum)
    for t, e in zip(in_place, expected):
        close(t, e, dtype)
    grouped = [t.clone() for t in kept]
    hvd.synchronize(hvd.grouped_allreduce_async_(grouped, op=hvd.Adasum))
    for t, e in zip(grouped, expected):
        close(t, e, dtype)


@needs_power_of_2
def test_scaling_and_compression_wrap_the_adasum():
    mine = torch.from_numpy(rank_array(hvd.rank(), (6,), np.float32, seed=7))
    out = hvd.allreduce(mine, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
    close(out, expected_for((6,), np.float32, seed=7, scale=0.5) * np.float32(3.0), np.float32)
    out = hvd.allreduce(mine, op=hvd.Adasum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    close(out.half(), expected_for((6,), np.float16, seed=7), np.float16)


@needs_power_of_2
def test_closed_forms_orthogonal_parallel_and_zero():
    n, me = hvd.size(), hvd.rank()
    # Orthogonal vectors: Adasum is their sum.
    orthogonal = torch.zeros(n, dtype=torch.float64)
    orthogonal[me] = me + 1.0
    assert hvd.allreduce(orthogonal, op=hvd.Adasum).tolist() == [r + 1.0 for r in range(n)]
    # The same vector on every rank: Adasum is that vector (the average).
    same = torch.tensor([3.0, -1.5, 0.25], dtype=torch.float64)
    assert torch.equal(hvd.allreduce(same, op=hvd.Adasum), same)
    # Zeros everywhere but on the last rank: a zero norm keeps coefficient 1, the result is that rank's vector.
    last = torch.tensor([1.0, 2.0, -4.0]) if me == n - 1 else torch.zeros(3)
    assert hvd.allreduce(last, op=hvd.Adasum).tolist() == [1.0, 2.0, -4.0]
    assert hvd.allreduce(torch.zeros(4), op=hvd.Adasum).tolist() == [0.0] * 4


@needs_power_of_2
def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match=r"op=hvd.Adasum reduces float16, float32 or float64 tensors, .* torch.int32"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="global process set only"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum, process_set=hvd.ProcessSet(list(range(hvd.size()))))
    with pytest.raises(NotImplementedError, match="reducescatter does not support op=hvd.Adasum"):
        hvd.reducescatter(torch.ones(hvd.size() * 2), op=hvd.Adasum)
    if hvd.size() > 1:
        # Another length on one rank fails the agreement on every rank, before any bytes move.
        with pytest.raises(RuntimeError):
            hvd.allreduce(torch.ones(3 + (hvd.rank() == 0)), op=hvd.Adasum, name="adasum.mismatch")


@pytest.mark.skipif(POWER_OF_2, reason="the world is a power of 2")
def test_a_world_that_is_not_a_power_of_2_is_refused():
    with pytest.raises(
        NotImplementedError, match=rf"power-of-2 number of ranks, as in Horovod, got size\(\)={hvd.size()}"
    ):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(NotImplementedError, match="power-of-2 number of ranks"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)


def make_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=generator, dtype=torch.float64)


def loss_of(model, x):
    return model(x).pow(2).sum() + model(x).sum()


def delta_reference(make_optimizer, steps):
    """One process: every rank's own optimizer steps from the common parameters; they move by the Adasum of the changes."""
    common = make_model()
    models = [make_model() for _ in range(hvd.size())]
    optimizers = [make_optimizer(m.parameters()) for m in models]
    for m in models:  # Horovod's optimizer starts every gradient at zero
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(steps):
        deltas = []
        for r, (m, opt) in enumerate(zip(models, optimizers)):
            with torch.no_grad():
                for p, c in zip(m.parameters(), common.parameters()):
                    p.copy_(c)
            opt.zero_grad()
            loss_of(m, batch(r, step)).backward()
            opt.step()
            deltas.append([(p - c).detach().numpy() for p, c in zip(m.parameters(), common.parameters())])
        with torch.no_grad():
            for i, c in enumerate(common.parameters()):
                reduced = numpy_adasum([d[i] for d in deltas], np.float64).reshape(c.shape)
                c.add_(torch.from_numpy(reduced))
    return common


@needs_power_of_2
@pytest.mark.parametrize(
    "make_optimizer",
    [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.Adam(ps, lr=0.05)],
    ids=["sgd-momentum", "adam"],
)
def test_adasum_optimizer_applies_the_adasum_of_the_local_updates(make_optimizer):
    model = make_model()
    base = make_optimizer(model.parameters())
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert isinstance(optimizer, type(base)) and type(optimizer).__name__ == type(base).__name__
    for step in range(3):
        optimizer.zero_grad()
        loss_of(model, batch(hvd.rank(), step)).backward()
        optimizer.synchronize()  # a no-op with Adasum, as in Horovod
        optimizer.step()
    expected = delta_reference(make_optimizer, steps=3)
    for a, b in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(AssertionError, match="skip_synchronize"):
        with optimizer.skip_synchronize():
            pass
    optimizer.close()


@needs_power_of_2
def test_adasum_optimizer_counts_backward_passes_and_refuses_what_horovod_refuses():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    if hvd.size() > 1:
        loss_of(model, batch(hvd.rank(), 0)).backward()
        with pytest.raises(AssertionError, match="backward_passes_per_step=1"):
            loss_of(model, batch(hvd.rank(), 0)).backward()
        with pytest.raises(NotImplementedError, match="global process set only"):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                op=hvd.Adasum,
                process_set=hvd.ProcessSet(list(range(hvd.size()))),
            )
        with pytest.raises(ValueError, match="compression=hvd.Compression.none or .fp16"):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, compression=hvd.Compression.powersgd
            )
    optimizer.close()
    hpcddp.barrier()
