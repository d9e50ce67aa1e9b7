"""PowerSGD (Vogels et al., 2019): each gradient matrix travels as two thin factors, with error feedback.

Per bucket and reduction, as torch's ``powerSGD_hook`` does:

1. every matrix-shaped gradient G (a tensor viewed as ``shape[0] x rest``) becomes
   M = G + E (E: what earlier reductions left out); P = M Q, with Q the last
   reduction's (warm start, its columns scaled to unit length) or random;
2. one allreduce carries every P of the bucket, the tensors left uncompressed (1-D
   ones, and matrices too small to gain ``min_compression_rate``) and the bucket's tail;
3. each summed P is orthonormalised (QR), Q = M^T P, and a second allreduce sums the Qs;
4. the gradient becomes P Q^T, an approximation of the sum over the ranks, and
   E = M - P Q^T / size: summed over the ranks, the part of the sum left out.

A summed P or Q with an inf or NaN (a non-finite gradient or overflow on any rank; every rank
sees the same sums) makes that reduction's gradient non-finite and starts the memory afresh.
Float64 gradients are factored in float64, the others in float32.

The first Q of each bucket is drawn from ``torch.Generator().manual_seed(random_seed +
bucket index)`` as one ``randn`` over the bucket's Qs in bucket order, the same on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...comm.base import Communicator, ReduceOp
from ..buckets import Bucket
from .staged import BucketCodec, Compressor, StagedReduction

__all__ = ["PowerSGD"]


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"PowerSGD {name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """PowerSGD gradient compression for ``DistributedOptimizer(compression=...)``.

    The arguments are those of torch's ``PowerSGDState`` (same names and meaning);
    ``compression="powersgd"`` uses the defaults.

    Args:
        matrix_approximation_rank: columns of P and Q (torch's default 1; 2-4 track
            the uncompressed run more closely at 2-4x the traffic).
        start_powerSGD_iter: reductions sent uncompressed before compression starts
            (torch's default is 1000; hpcddp's 10 compresses short runs too).
        min_compression_rate: a matrix is compressed only when its factors are at
            least this many times smaller than it.
        use_error_feedback: carry what compression left out into the next reduction.
        warm_start: start each reduction's power iteration from the last Q.
        random_seed: seed of the first Qs (the same on every rank).
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    random_seed: int = 0
    name = "powersgd"

    def __post_init__(self) -> None:
        _check_int("matrix_approximation_rank", self.matrix_approximation_rank, 1)
        _check_int("start_powerSGD_iter", self.start_powerSGD_iter, 0)
        _check_int("random_seed", self.random_seed, 0)
        rate = self.min_compression_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
            raise ValueError(f"PowerSGD min_compression_rate must be a finite number > 0, got {rate!r}")

    def codec(self, bucket: Bucket, comm: Communicator) -> BucketCodec:
        return _PowerSGDCodec(self, bucket, comm)


class _Matrix:
    """One compressed gradient: its rows x cols view, and its slices of the P and Q buffers."""

    def __init__(self, view: torch.Tensor, rank: int, p_at: int, q_at: int, p_all: torch.Tensor, q_all: torch.Tensor):
        rows = view.shape[0]
        cols = view.numel() // rows
        # A channels_last view keeps its rows (dim 0 outermost) but not its columns' order: the
        # matrix is each row's memory, the same column permutation on every rank.
        self.grad = view.view(rows, cols) if view.is_contiguous() else view.as_strided((rows, cols), (cols, 1))
        self.p = p_all[p_at : p_at + rows * rank].view(rows, rank)
        self.q = q_all[q_at : q_at + cols * rank].view(cols, rank)
        #: M while a reduction runs, the error E between reductions (the codec's dtype)
        self.memory = torch.zeros(rows, cols, dtype=p_all.dtype, device=view.device)


class _PowerSGDCodec(BucketCodec):
    def __init__(self, settings: PowerSGD, bucket: Bucket, comm: Communicator) -> None:
        self.settings, self.bucket, self.comm = settings, bucket, comm
        device = bucket.buffer.device
        shapes, plain = [], []
        p_size = q_size = 0
        for view in bucket.views:
            rows = view.shape[0] if view.dim() >= 2 else 0
            cols = view.numel() // rows if rows else 0
            rank = min(settings.matrix_approximation_rank, rows, cols)
            if rows and (rows + cols) * rank * settings.min_compression_rate < rows * cols:
                shapes.append((view, rank, p_size, q_size))
                p_size += rows * rank
                q_size += cols * rank
            else:
                plain.append(view)
        tail = bucket.buffer[bucket.grads.numel() :]
        plain_size = sum(view.numel() for view in plain)
        # First allreduce: [P of each matrix | uncompressed gradients | tail]; second: [Q of each matrix].
        # float32 at least (fp16/bf16 gradients are factored in float32), float64 for float64 models.
        dtype = torch.float64 if bucket.buffer.dtype == torch.float64 else torch.float32
        self._first = torch.zeros(p_size + plain_size + tail.numel(), dtype=dtype, device=device)
        self._second = torch.zeros(q_size, dtype=dtype, device=device)
        self._p_part = self._first[:p_size]
        # (gradient view, its slot in the first allreduce) for each tensor sent as it is, then the tail
        slots = self._first[p_size:].split([view.numel() for view in plain] + [tail.numel()])
        self._exact = [(view, slot.view_as(view)) for view, slot in zip([*plain, tail], slots)]
        self._matrices = [_Matrix(view, rank, p, q, self._first, self._second) for view, rank, p, q in shapes]
        self._generator = torch.Generator().manual_seed(settings.random_seed + bucket.index)
        self._draw_q()

    def _draw_q(self) -> None:
        self._second.copy_(torch.randn(self._second.numel(), generator=self._generator))
        self._poisoned = False

    def reset(self) -> None:
        for matrix in self._matrices:
            matrix.memory.zero_()
        self._draw_q()

    def keep_unapplied(self, views: Sequence[torch.Tensor]) -> None:
        if not self.settings.use_error_feedback:
            return
        unapplied = {view.data_ptr() for view in views}
        for matrix in self._matrices:
            if matrix.grad.data_ptr() in unapplied:
                matrix.memory.add_(matrix.grad, alpha=1.0 / self.comm.size)

    def launch(self, reduction: int, *, label: str, step: int | None) -> StagedReduction | None:
        if not self._matrices or reduction < self.settings.start_powerSGD_iter:
            return None
        for matrix in self._matrices:
            if self.settings.use_error_feedback:
                matrix.memory.add_(matrix.grad)
            else:
                matrix.memory.copy_(matrix.grad)
            torch.matmul(matrix.memory, matrix.q, out=matrix.p)
        self._pack()
        first = self.comm.allreduce_async_(self._first, ReduceOp.SUM, label=label, step=step)
        stages = [functools.partial(self._second_stage, label=label, step=step), self._decompress]
        return StagedReduction(f"PowerSGD bucket {self.bucket.index}", [first], stages, self.bucket.buffer)

    def _pack(self) -> None:
        for view, slot in self._exact:
            slot.copy_(view)

    def _second_stage(self, *, label: str, step: int | None):
        # The summed P is the same on every rank: so is the decision. An inf or NaN in any rank's
        # gradient or memory shows here, and would stay in the memory for good.
        self._poisoned = not bool(torch.isfinite(self._p_part).all())
        for matrix in self._matrices:
            matrix.p.copy_(torch.linalg.qr(matrix.p).Q)
            torch.matmul(matrix.memory.t(), matrix.p, out=matrix.q)
        return [self.comm.allreduce_async_(self._second, ReduceOp.SUM, label=label, step=step)]

    def _decompress(self):
        share = 1.0 / self.comm.size
        self._poisoned = self._poisoned or not bool(torch.isfinite(self._second).all())
        for matrix in self._matrices:
            if matrix.grad.dtype == matrix.p.dtype:
                approx = torch.matmul(matrix.p, matrix.q.t(), out=matrix.grad)
            else:
                approx = matrix.p @ matrix.q.t()
                matrix.grad.copy_(approx)
            if self.settings.use_error_feedback:
                matrix.memory.sub_(approx, alpha=share)
        if self._poisoned:
            self.reset()  # this reduction's gradient is non-finite (skip_nonfinite skips it); the next starts afresh
        elif not self.settings.warm_start:
            self._draw_q()
        else:
            # Q = M^T P has M's magnitude, and the next P = M Q its square: unit columns keep it in
            # range (P's QR ignores the scale of its columns, so the result is the same).
            for matrix in self._matrices:
                matrix.q.div_(torch.linalg.vector_norm(matrix.q, dim=0).clamp_min_(torch.finfo(matrix.q.dtype).tiny))
        for view, slot in self._exact:
            view.copy_(slot)
        return []
