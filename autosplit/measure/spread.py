"""Ratios between measured times, printed with their uncertainty (pure numbers, no torch).

A time here is a median with a relative spread s (a fraction: 0.03 is ±3 %): the value is taken
to lie in ``median · (1 − s) … median · (1 + s)``. The spread of a verified time is half its
interquartile range over its median (see :mod:`autosplit.verify.plans`).

The ratio ``a / b`` of two such times then lies in
``a(1 − s_a) / (b(1 + s_b)) … a(1 + s_a) / (b(1 − s_b))``. When that interval contains 1 the
two times are not told apart by the measurements and the claim reads "within noise"; an
unknown spread (``None``, e.g. an analytic estimate or an unverified plan) gives no interval
and the text says the figure is a prediction from block sums.

A ratio of two *predicted* steps is further from the measured ratio than the timings' spreads
say: they are taken in one verification session, and the runtime the plans then train on (its
cost per action, the overlap of the ranks' work) varies from one window to the next. Such a
claim widens its interval by :data:`PREDICTION_ERROR` each way (``error=``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PREDICTION_ERROR", "Claim", "half_iqr", "ratio_with_spread", "relative_spread",
           "spread_text"]

PREDICTION_ERROR = 0.03
"""How far the ratio of two verified predicted steps may be from the ratio measured when the
plans train, beyond the spreads of the timings it comes from (a fraction each way): the
accuracy claimed for a verified ratio (the README's Results, "How far the predictions hold").
benchmarks/accuracy.py (2 CPU workers, Intel Xeon; five runs of 39 ratios before this
allowance) measured 22–37 of the 39 ratio errors within 3 %; the printed intervals without
it held 20–30 of the 39 measured ratios, with it 30–39 (36 or more in four runs of five); the
first run after it, 37 of 39 (30 errors within 3 %, the largest 10 %)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """How much longer time a is than time b, and how sure that is.

    Attributes:
        text: what to print, e.g. ``"×1.52 ± 0.05 faster"`` or ``"within noise (×1.02 …)"``.
        ratio: a / b.
        low: the smallest ratio the spreads (and the ratio's ``error``) allow (``ratio`` when
            a spread is unknown).
        high: the largest ratio they allow.
        within_noise: the interval contains 1: the measurements (and, for a predicted ratio,
            the prediction's accuracy) do not tell a from b.
        known: both spreads were known (the interval means something).
    """

    text: str
    ratio: float
    low: float
    high: float
    within_noise: bool
    known: bool


def _check(name: str, value: float, minimum: float, maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (minimum <= value < maximum) or math.isnan(value):
        raise ValueError(f"{name} must be in [{minimum}, {maximum}), got {value!r}")
    return float(value)


def ratio_with_spread(
    a_ms: float,
    a_spread: float | None,
    b_ms: float,
    b_spread: float | None,
    *,
    more: str = "faster",
    less: str = "slower",
    error: float = 0.0,
) -> Claim:
    """Claim about a / b: with ``more``/``less`` words for a ratio above / below 1.

    ``a_ms / b_ms`` > 1 means b is shorter: with the default words, "b is ×ratio faster".

    Args:
        a_ms, b_ms: the two times (ms), > 0.
        a_spread, b_spread: their relative spreads (fractions ≥ 0), or ``None`` if unknown.
        more, less: the word after the ratio when it is above / below 1.
        error: how far the ratio itself may be off beyond the spreads (a fraction ≥ 0; two
            predicted steps: :data:`PREDICTION_ERROR`): the interval's ends are divided and
            multiplied by ``1 + error``. Unused when a spread is unknown.

    Raises:
        TypeError: a time, spread or error that is not a number.
        ValueError: a time ≤ 0 or not finite, a spread or error < 0 or not finite.
    """
    a = _check("a_ms", a_ms, 0.0)
    b = _check("b_ms", b_ms, 0.0)
    widen = 1 + _check("error", error, 0.0)
    if a <= 0 or b <= 0:
        raise ValueError(f"times must be > 0 ms, got {a_ms!r} and {b_ms!r}")
    ratio = a / b
    if a_spread is None or b_spread is None:
        word = more if ratio >= 1 else less
        shown = ratio if ratio >= 1 else 1 / ratio
        return Claim(f"×{shown:.2f} {word} (predicted from block sums, not verified)",
                     ratio, ratio, ratio, False, False)
    sa = _check("a_spread", a_spread, 0.0)
    sb = _check("b_spread", b_spread, 0.0)
    low = max(a * (1 - sa), 0.0) / (b * (1 + sb)) / widen
    high = a * (1 + sa) / (b * (1 - sb)) * widen if sb < 1 else math.inf
    if low <= 1.0 <= high:
        top = f"×{high:.2f}" if math.isfinite(high) else "∞"
        text = f"within noise (×{ratio:.2f}, ×{low:.2f} … {top})"
        return Claim(text, ratio, low, high, True, True)
    if ratio >= 1:
        shown, lo, hi, word = ratio, low, high, more
    else:  # shown the other way round, so that the number reads "how many times"
        shown, lo, hi, word = 1 / ratio, 1 / high, (1 / low if low > 0 else math.inf), less
    if math.isinf(hi):
        text = f"at least ×{lo:.2f} {word}"
    else:
        text = f"×{shown:.2f} ± {(hi - lo) / 2:.2f} {word}"
    return Claim(text, ratio, low, high, False, True)


def spread_text(spread: float | None) -> str:
    """``" ± 3%"`` for a known relative spread, ``""`` for an unknown one."""
    if spread is None:
        return ""
    return f" ± {spread:.0%}" if spread >= 0.005 else " ± <1%"


def half_iqr(values: Sequence[float]) -> float:
    """Half the interquartile range of ``values`` (their unit; 0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2


def relative_spread(values: Sequence[float]) -> float:
    """:func:`half_iqr` over the median (a fraction; 0 for fewer than two values or a median
    ≤ 0): the spread every measured time here carries."""
    median = statistics.median(values) if values else 0.0
    return half_iqr(values) / median if median > 0 else 0.0
