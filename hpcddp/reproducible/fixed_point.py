"""Exact sums of floating-point tensors in any order: integer digits in base 2**40 under one scale per tensor.

Every contribution to a tensor is cut at fixed bit positions (multiples of
``DIGIT_BITS``) into signed integer digits; digits at the same position are summed
as int64, which is exact and associative, so the sum does not depend on the order
of the contributions or on how they were split between ranks.

A tensor keeps ``num_digits`` digits from its ``position``: the digit that holds the
leading bit of the largest magnitude any contribution had. Lower digits are dropped
from every contribution alike, whenever they are dropped, so dropping early (when a
larger contribution arrives) and late (when the ranks agree on the position) give the
same result. Kept are all bits of every element within ``2**-KEPT_BELOW_LARGEST`` of the
tensor's largest magnitude; smaller ones are rounded toward zero at the last digit.

The digit sums of one rank are kept as float64, exact while below 2**53 (8191 digits of
40 bits), where float64 arithmetic is several times faster than int64 on a CPU. Summed
across ranks they stay float64 while the total stays within that (every partial sum is an
integer below 2**53, so exact in any order), and become int64 in place (``as_int64_``)
beyond it, up to 2**23 - 1 digits.
Everything runs in place on buffers the caller owns: on a CPU an allocation of a large
temporary costs more than the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = [
    "DIGIT_BITS",
    "KEPT_BELOW_LARGEST",
    "MAX_CONTRIBUTIONS",
    "MAX_LOCAL_CONTRIBUTIONS",
    "NO_DIGIT",
    "add_",
    "as_float64_",
    "as_int64_",
    "digits_needed",
    "position_of",
    "shift_down_",
    "to_float_",
]

#: bits per digit: a digit is below 2**40, so int64 holds the sum of 2**23 - 1 of them
DIGIT_BITS = 40
#: contributions summed per element before int64 could overflow (one per micro-batch)
MAX_CONTRIBUTIONS = 2 ** (63 - DIGIT_BITS) - 1
#: contributions one rank sums in float64 before a digit sum could leave float64's exact integers
MAX_LOCAL_CONTRIBUTIONS = 2 ** (53 - DIGIT_BITS) - 1
#: bits below a tensor's largest magnitude down to which every element keeps all its bits
KEPT_BELOW_LARGEST = 56
#: position of a tensor that only ever received zeros
NO_DIGIT = -128

_SIGNIFICAND_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def digits_needed(dtypes: Iterable[torch.dtype]) -> int:
    """Return how many digits a tensor of ``dtypes`` keeps (3, or 4 for float64).

    Args:
        dtypes: the floating-point dtypes summed.
    """
    bits = 0
    for dtype in dtypes:
        if dtype not in _SIGNIFICAND_BITS:
            raise TypeError(f"reproducible sums take float16, bfloat16, float32 or float64 tensors, got {dtype}")
        bits = max(bits, _SIGNIFICAND_BITS[dtype])
    # The leading bit may sit at the bottom of its digit: the digits below must hold the rest.
    return 1 + -(-(bits + KEPT_BELOW_LARGEST) // DIGIT_BITS)


def position_of(largest: float) -> int:
    """Return the position of the digit holding the leading bit of ``largest`` (>= 0), NO_DIGIT for 0."""
    if largest == 0:
        return NO_DIGIT
    return (math.frexp(largest)[1] - 1) // DIGIT_BITS


def shift_down_(digits: torch.Tensor, by: int) -> None:
    """Move the digits ``by`` positions down (the tensor's position rose by ``by``), dropping the lowest.

    Args:
        digits: (num_digits, n); row 0 holds the digit at the position, row k the one k lower.
        by: positions to move, >= 0.
    """
    if by <= 0:
        return
    rows = digits.shape[0]
    for row in range(rows - 1, -1, -1):
        if row >= by:
            digits[row].copy_(digits[row - by])
        else:
            digits[row].zero_()


def _scale_(values: torch.Tensor, exponent: int) -> torch.Tensor:
    """Multiply by 2**exponent exactly, in two steps (a float64 power of two reaches 2**1023 only)."""
    half = exponent // 2
    return values.mul_(2.0**half).mul_(2.0 ** (exponent - half))


def add_(digits: torch.Tensor, position: int, grad: torch.Tensor, values: torch.Tensor, rest: torch.Tensor) -> None:
    """Add ``grad`` exactly into the float64 ``digits`` at ``position``.

    Args:
        digits: (num_digits, n) float64 digit sums at ``position``.
        position: at least ``position_of(grad.abs().max())``.
        grad: n values of any float16, bfloat16, float32 or float64 dtype.
        values: (n,) float64 scratch.
        rest: (n,) float64 scratch.
    """
    exponent = -DIGIT_BITS * position  # grad * 2**exponent is below 2**DIGIT_BITS in magnitude
    if grad.dtype in (torch.float32, torch.float64) and -126 <= exponent <= 127:
        # Exact in grad's dtype: a power of two, and what underflows there lies below the last digit.
        torch.mul(grad.reshape(-1), 2.0**exponent, out=values)
    else:
        _scale_(values.copy_(grad.reshape(-1)), exponent)
    last = digits.shape[0] - 1
    for row in range(last + 1):
        torch.frac(values, out=rest)
        digits[row].add_(values.sub_(rest))  # the digit: values toward zero
        if row < last:
            torch.mul(rest, 2.0**DIGIT_BITS, out=values)


def as_int64_(digits: torch.Tensor) -> torch.Tensor:
    """Convert float64 digit sums to int64 in place (the same bytes) and return that int64 view."""
    # Each element is read and written at its own address, so an element-wise copy onto itself is safe.
    ints = digits.view(torch.int64)
    return ints.copy_(digits)


def as_float64_(ints: torch.Tensor) -> torch.Tensor:
    """Convert int64 digit sums to float64 in place (rounded where above 2**53) and return that view."""
    floats = ints.view(torch.float64)
    return floats.copy_(ints)


def to_float_(digits: torch.Tensor, position: int, out: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """Write the float64 value of ``digits`` at ``position``, divided by ``divisor``, into ``out``.

    Rounded the same way everywhere, not correctly: within 2**-51 of the exact quotient.

    Args:
        digits: (num_digits, n) float64 digit sums.
        position: their position.
        out: (n,) float64.
        divisor: what to divide by (the number of contributions, for their mean).
    """
    if position == NO_DIGIT:
        return out.zero_()
    out.copy_(digits[0])
    for row in range(1, digits.shape[0]):
        out.mul_(2.0**DIGIT_BITS).add_(digits[row])
    if divisor != 1:  # before scaling: a mean of float64 values near their maximum would overflow after
        out.div_(divisor)
    return _scale_(out, DIGIT_BITS * (position - digits.shape[0] + 1))
