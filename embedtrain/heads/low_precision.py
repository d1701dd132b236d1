"""Low-precision class rows: bfloat16 or float8 storage, float32 arithmetic, rounding back by a
rule.

A class head stored in bfloat16 (``head.dtype: bf16``) or float8 e4m3 (``fp8``: 1 sign, 4
exponent and 3 mantissa bits, finite up to 448, subnormal below 2^-6) keeps no float32 copy of its
rows
(ELMO, Zhang et al., ICML 2025: the classifier trained in BF16/FP8 without master weights). A
step computes in float32 on the rows it touches, and the updated rows are rounded back:

* **stochastic** (:func:`stochastic_round_bf16`): up or down to the two neighbouring bfloat16
  values with odds proportional to the distance, so the rounding is unbiased (its expectation is
  the float32 value) and an update smaller than half a unit in the last place still moves the
  weight on average, where rounding to nearest would drop it (the reason low-precision training
  stalls without master weights);
* **nearest**: round to nearest even (``Tensor.to``).

float8 rows are stored unscaled: the rows start at ``N(0, 1/D)`` (|w| ~ 0.09 at D = 128, inside
e4m3's normal range) and every score reads them in float32. Stochastic rounding to e4m3
(:func:`stochastic_round_e4m3`) floors ``|x| / spacing + u`` with ``u`` from the same 16 random
bits; values beyond 448 are clamped to it (e4m3 has no infinity).

The random bits are counter-based, not drawn from a generator: each weight's 16 bits are a hash
(the SplitMix64 finaliser) of ``(seed, step, global row, column)``. A run is reproducible, a
resumed run draws what the uninterrupted one drew (the step is in the optimizer's state), and a
head split over any number of ranks rounds every weight exactly as one rank would.

Example:
    >>> new = rows.float() - lr * grad                       # float32 update of some rows
    >>> weight[rows_ids] = round_rows(new, rows_ids + start, torch.bfloat16,
    ...                               Rounding.STOCHASTIC, seed=0, step=7)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from embedtrain.models.options import HeadDtype, Rounding

DTYPES = {HeadDtype.FP32: torch.float32, HeadDtype.BF16: torch.bfloat16,
          HeadDtype.FP8: torch.float8_e4m3fn}
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
_E4M3_MIN_EXP = -6  # its smallest normal exponent: below 2^-6 the spacing stays 2^-9

# SplitMix64's constants as signed int64 (torch has no uint64 arithmetic; products wrap).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _signed64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_(x: Tensor) -> Tensor:
    """SplitMix64's finaliser, in place on an int64 tensor (a bijection of 64-bit words).

    torch's ``>>`` is arithmetic on signed integers; each shift is masked to be the logical one.
    """
    tmp = torch.empty_like(x)
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mult is not None:
            x.mul_(mult)
    return x


def stream_offset(seed: int, step: int) -> int:
    """The counter offset of one (seed, step): a hash, so nearby steps' streams do not overlap."""
    key = torch.tensor([_signed64((seed * 0x632BE59BD9B4E019 + step + 1) * _GOLDEN)])
    return int(_mix_(key))


def random_bits16(global_rows: Tensor, dim: int, seed: int, step: int) -> Tensor:
    """``[n, dim]`` int32 values in ``[0, 2^16)``, a hash of (seed, step, row, column).

    One 64-bit hash gives four columns their 16 bits each (its four 16-bit lanes).
    """
    words = -(-dim // 4)
    counter = global_rows.to(torch.int64)[:, None] * words + torch.arange(1, words + 1)
    counter.mul_(_GOLDEN).add_(stream_offset(seed, step))  # SplitMix64's counter: i * gamma
    lanes = _mix_(counter).view(torch.int16)[:, :dim]  # [n, 4 * words] -> the first dim lanes
    return lanes.to(torch.int32).bitwise_and_(0xFFFF)


def stochastic_round_bf16(x: Tensor, bits16: Tensor) -> Tensor:
    """float32 ``x`` rounded to bfloat16 with the given random bits (``[0, 2^16)``, ``x``'s shape).

    The 16 bits bfloat16 drops are ``x``'s low half: adding a uniform 16-bit number to them
    carries into the kept half with probability ``low / 2^16``, which is rounding the magnitude
    up with the odds of its distance (IEEE floats are sign-magnitude, so negative values round
    the same way). Non-finite values are rounded to nearest (they stay what they are). ``bits16``
    is used as the work buffer.
    """
    x = x.contiguous()
    kept = bits16.add_(x.view(torch.int32)).bitwise_right_shift_(16).to(torch.int16)
    out = kept.view(torch.bfloat16)
    if not math.isfinite(float(x.sum())):  # a cheap test first (a huge finite sum may trip it)
        out = torch.where(torch.isfinite(x), out, x.to(torch.bfloat16))
    return out


def stochastic_round_e4m3(x: Tensor, bits16: Tensor) -> Tensor:
    """float32 ``x`` rounded to float8 e4m3 with the given random bits (``[0, 2^16)``).

    The spacing of e4m3 values at ``|x|`` is ``2^(e - 3)`` for ``2^e <= |x| < 2^(e + 1)``
    (``e >= -6``; below, subnormals, ``2^-9``): ``floor(|x| / spacing + u) * spacing`` with ``u``
    uniform in ``[0, 1)`` is one of the two neighbours of ``|x|``, the upper one with the odds of
    the distance, and exactly representable (so the cast is exact). Magnitudes are clamped to
    448 (e4m3 has no infinity); NaN stays NaN.
    """
    a = x.abs()
    exponent = torch.frexp(a).exponent.sub_(1).clamp_(min=_E4M3_MIN_EXP)  # |x| in [2^e, 2^(e+1))
    spacing = torch.ldexp(torch.ones_like(a), exponent.sub_(3))
    u = bits16.to(torch.float32).mul_(1.0 / 65536)
    out = a.div_(spacing).add_(u).floor_().mul_(spacing).clamp_(max=E4M3_MAX)
    return torch.copysign(out, x).to(torch.float8_e4m3fn)


def round_rows(values: Tensor, global_rows: Tensor, dtype: torch.dtype, rounding: Rounding,
               seed: int, step: int) -> Tensor:
    """float32 rows ``values [n, D]`` (global row ids ``[n]``) in the storage ``dtype``."""
    if dtype == torch.float32:
        return values
    if dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"round_rows: no rounding to {dtype} (float32, bfloat16 or float8_e4m3fn)")
    if Rounding(rounding) is Rounding.NEAREST:  # e4m3: saturated, as stochastic rounding is
        return (values.clamp(-E4M3_MAX, E4M3_MAX) if dtype == torch.float8_e4m3fn
                else values).to(dtype)
    bits = random_bits16(global_rows, values.shape[1], seed, step)
    if dtype == torch.float8_e4m3fn:
        return stochastic_round_e4m3(values, bits)
    return stochastic_round_bf16(values, bits)
