"""Exact sums of floating-point tensors in any order: each element kept as integer digits in base 2**40.

Every element of every contribution is split at fixed bit positions (multiples of
``DIGIT_BITS``) into signed integer digits; digits at the same position are summed
as int64, which is exact and associative, so the sum does not depend on the order
of the contributions or on how they were split between ranks.

Per element only the ``num_digits`` positions from the highest one any contribution
reached are kept (``top``). A lower digit is dropped from every contribution alike,
whenever it is dropped, so dropping early (when a larger contribution arrives) and
dropping late (when the ranks agree on ``top``) give the same result. Kept are all the
bits of the largest contribution and at least 40 bits below its leading bit of every
other: the error of the sum is below ``count * 2**-40`` of the largest contribution.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "DIGIT_BITS",
    "MAX_CONTRIBUTIONS",
    "NO_DIGIT",
    "add_",
    "digits_needed",
    "realign_",
    "to_float",
    "top_digits",
]

#: bits per digit: a digit is below 2**40, so int64 holds the sum of 2**23 of them
DIGIT_BITS = 40
#: contributions summed per element before int64 could overflow (one per micro-batch)
MAX_CONTRIBUTIONS = 2 ** (63 - DIGIT_BITS) - 1
#: ``top`` of an element that only ever received zeros
NO_DIGIT = -128

_SIGNIFICAND_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
# The largest and smallest exponents float64 can scale by in one step.
_MAX_EXP, _MIN_EXP = 1023, -1074


def digits_needed(dtypes: Iterable[torch.dtype]) -> int:
    """Return how many digits keep every bit of the largest value of ``dtypes`` (2, or 3 for float64).

    Args:
        dtypes: the floating-point dtypes summed.
    """
    bits = 0
    for dtype in dtypes:
        if dtype not in _SIGNIFICAND_BITS:
            raise TypeError(f"reproducible sums take float16, bfloat16, float32 or float64 tensors, got {dtype}")
        bits = max(bits, _SIGNIFICAND_BITS[dtype])
    # A run of `bits` bits that starts anywhere inside the top digit ends at most this many digits below it.
    return 1 + -(-bits // DIGIT_BITS)


def top_digits(values: torch.Tensor) -> torch.Tensor:
    """Return, per element of the float64 ``values``, the position of its leading digit (int8; NO_DIGIT for 0)."""
    _, exponent = torch.frexp(values)
    position = torch.div(exponent - 1, DIGIT_BITS, rounding_mode="floor").to(torch.int8)
    return position.masked_fill_(values == 0, NO_DIGIT)


def realign_(digits: torch.Tensor, top: torch.Tensor, new_top: torch.Tensor) -> None:
    """Move each element's digits from positions ``top`` to positions ``new_top`` (>= ``top``), dropping those below.

    Args:
        digits: (num_digits, n) int64; row 0 holds the digit at ``top``, row k the one k positions lower.
        top: (n,) current leading positions.
        new_top: (n,) leading positions to move to, elementwise >= ``top``.
    """
    shift = new_top.to(torch.int32) - top.to(torch.int32)
    if not bool(shift.any()):
        return
    rows = digits.shape[0]
    moved = torch.zeros_like(digits)
    for by in range(rows):
        keep = shift == by
        for row in range(by, rows):
            moved[row] += torch.where(keep, digits[row - by], 0)
    digits.copy_(moved)


def add_(digits: torch.Tensor, top: torch.Tensor, values: torch.Tensor) -> None:
    """Add the float64 ``values`` exactly into ``digits`` (their leading positions in ``top``, both updated).

    Args:
        digits: (num_digits, n) int64 sums of digits.
        top: (n,) int8 leading positions, NO_DIGIT where nothing non-zero was added yet.
        values: (n,) float64 contribution (any float32, float16, bfloat16 or float64 value, exactly).
    """
    new_top = torch.maximum(top, top_digits(values))
    realign_(digits, top, new_top)
    top.copy_(new_top)
    significand, exponent = torch.frexp(values)
    # values / 2**(DIGIT_BITS * top), below 2**DIGIT_BITS in magnitude; every step below is exact in float64.
    scaled = torch.ldexp(significand, (exponent - DIGIT_BITS * new_top.to(torch.int32)).clamp_(_MIN_EXP, _MAX_EXP))
    for row in range(digits.shape[0]):
        digit = scaled.trunc()
        digits[row] += digit.to(torch.int64)
        scaled.sub_(digit).mul_(2.0**DIGIT_BITS)


def to_float(digits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Return the float64 value of the digit sums (rounded once per digit, the same way everywhere).

    Args:
        digits: (num_digits, n) int64 sums of digits, aligned to ``top``.
        top: (n,) leading positions.
    """
    value = digits[0].to(torch.float64)
    for row in range(1, digits.shape[0]):
        value = value * 2.0**DIGIT_BITS + digits[row].to(torch.float64)
    exponent = DIGIT_BITS * (top.to(torch.int32) - (digits.shape[0] - 1))
    # In two halves: the lowest digit of a float64 sum may sit below float64's smallest power of two.
    half = torch.div(exponent, 2, rounding_mode="floor").clamp_(_MIN_EXP, _MAX_EXP)
    value = torch.ldexp(torch.ldexp(value, half), (exponent - half).clamp_(_MIN_EXP, _MAX_EXP))
    return value.masked_fill_(top == NO_DIGIT, 0.0)
