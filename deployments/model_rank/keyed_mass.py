"""A sampled row's token weights as exact integers: the masses the keyed draw sums (docs/engine.md).

A token's weight is exp(y) with y = x / T - x_max / T in float64, computed by one fixed sequence of
correctly rounded float64 operations (a Cody-Waite reduction and a degree-11 polynomial, each multiply and
add a separate torch op, never fused), so it has the same bits on every device torch runs on. It is then
rounded to a whole number of units of 2^-K of the likeliest token's weight: every later sum of masses is
an integer below 2^53, exact in any order, so a parallel scan on a GPU and a loop on a CPU agree.
"""

import math

import torch

FLOOR = -25.0  # below this y a mass is 0 whatever K is (exp(-25) * 2^34 < 0.5): the draw never reads it
_INV_LN2 = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2: n * _LN2_HI is exact for |n| < 2^20
_LN2_LO = 1.90821492927058770002e-10
_TAYLOR = [1.0 / math.factorial(k) for k in range(12)]  # exp(r) on |r| <= ln(2) / 2, error under 1e-14
# Every constant above, in the order the CPU kernel reads them (kernels/cpu/keyed_draw.c): one source.
MASS_CONSTANTS = [_INV_LN2, _LN2_HI, _LN2_LO, FLOOR, *_TAYLOR]


def fraction_bits(vocab_size: int) -> int:
    """K: masses count units of 2^-K of the likeliest token's weight, so that a whole row of them sums
    below 2^52 (K = 34 up to 262,143 tokens, one bit less for each doubling beyond)."""
    return 52 - max(18, vocab_size.bit_length())


def masses(x: torch.Tensor, x_max: torch.Tensor, temperature: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 masses [R, N] of logits `x` [R, N] (float32) against each row's largest logit `x_max` [R, 1]
    at `temperature` [R, 1] (float64, above 0, a tensor on x's device: a scalar divisor may become a
    multiply by its reciprocal on some devices). Ties with the largest weigh exactly 2^K; a row whose
    largest logit is -inf, and any NaN, weigh nothing."""
    wide = x.to(torch.float64)
    top = x_max.to(torch.float64)
    y = torch.sub(torch.div(wide, temperature), torch.div(top, temperature))
    y = torch.where(wide == top, 0.0, y)  # exactly 0 for the likeliest, also when x / T overflows
    live = (y >= FLOOR) & (top > float("-inf"))
    y = torch.where(live, y, 0.0)
    scaled = torch.mul(_exp_reduced(y), _power_of_two(_reduction(y), bits))
    return torch.where(live, torch.round(scaled), 0.0).to(torch.int64)


def _power_of_two(n: torch.Tensor, bits: int) -> torch.Tensor:
    """2^(n + bits) exactly, from its exponent field (a library pow may round on some devices)."""
    exponent = n.to(torch.int64) + (bits + 1023)
    return torch.bitwise_left_shift(exponent, 52).view(torch.float64)


def _reduction(y: torch.Tensor) -> torch.Tensor:
    """n = round(y / ln 2): y = n ln 2 + r with |r| <= ln(2) / 2 (float64, a whole number)."""
    return torch.round(torch.mul(y, _INV_LN2))


def _exp_reduced(y: torch.Tensor) -> torch.Tensor:
    """exp(r) for r = y - n ln 2, one rounding per op: Horner's rule over the Taylor coefficients."""
    n = _reduction(y)
    r = torch.sub(torch.sub(y, torch.mul(n, _LN2_HI)), torch.mul(n, _LN2_LO))
    p = torch.full_like(r, _TAYLOR[-1])
    for coefficient in reversed(_TAYLOR[:-1]):
        p = torch.add(torch.mul(p, r), coefficient)
    return p
