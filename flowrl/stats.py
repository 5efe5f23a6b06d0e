"""Statistics for comparing runs over seeds: Student t intervals, paired differences, curve areas.

Pure Python (float64), no torch, no CLI: ``flowrl compare`` and any script can use it.

- :func:`t_quantile` is exact up to float rounding: the Student t CDF is written with the
  regularised incomplete beta function (evaluated by its continued fraction) and inverted by
  bisection. No scipy needed.
- :func:`t_interval`: the two-sided ``confidence`` interval for the mean of ``n`` independent
  values, ``mean +- t_{(1+c)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation
  (divisor ``n - 1``). With fewer than 2 values there is no interval (``half_width is None``).
- :func:`paired_interval`: the same interval for the differences ``a[k] - b[k]`` over the keys
  (seeds) both have.
- :func:`curve_auc`: area under a curve by the trapezoid rule, divided by the span of x, so it
  is the curve's average height and has the metric's units (a single point: its value).
- :func:`value_at_budget`: the last point whose cost does not exceed a budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Hashable

# ----------------------------------------------------------------------------- Student t


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), for
    ``x < (a + 1) / (a + b + 2)``: I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * this."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 10_000):
        # even step: d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m))
        num = m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        # odd step: d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1))
        num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        delta = c * d
        f *= delta
        if abs(delta - 1.0) < 1e-15:
            return f
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc needs a, b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x == 0.0 or x == 1.0:
        return x
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (df > 0, not necessarily whole)."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom: t with P(T <= t) = p.

    >>> round(t_quantile(0.975, 4), 6)
    2.776445
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            raise ArithmeticError(f"t quantile out of range (p={p}, df={df})")
    for _ in range(400):  # bisection: the CDF is monotone, so this cannot go wrong
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- intervals


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def sample_sd(values: Sequence[float]) -> float:
    """Standard deviation with divisor n - 1 (needs at least 2 values)."""
    if len(values) < 2:
        raise ValueError("a sample standard deviation needs at least 2 values")
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with its two-sided Student t interval.

    ``sd``, ``half_width``, ``lo`` and ``hi`` are None when ``n < 2`` (no interval exists);
    ``mean`` is None when ``n == 0``.
    """

    n: int
    mean: float | None
    sd: float | None = None
    half_width: float | None = None
    confidence: float = 0.95

    @property
    def lo(self) -> float | None:
        return None if self.half_width is None or self.mean is None else self.mean - self.half_width

    @property
    def hi(self) -> float | None:
        return None if self.half_width is None or self.mean is None else self.mean + self.half_width

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "sd": self.sd, "half_width": self.half_width,
                "lo": self.lo, "hi": self.hi, "confidence": self.confidence}


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of ``values`` and the Student t interval ``mean +- t_{(1+c)/2, n-1} s / sqrt(n)``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return Interval(0, None, confidence=confidence)
    if n == 1:
        return Interval(1, values[0], confidence=confidence)
    sd = sample_sd(values)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean(values), sd, half, confidence)


def seeds_for_half_width(sd: float, target: float, confidence: float = 0.95, limit: int = 100_000) -> int:
    """The fewest values ``m >= 2`` whose t interval, at standard deviation ``sd``, has a half-width
    of at most ``target``: the smallest m with ``t_{(1+c)/2, m-1} sd / sqrt(m) <= target``. The
    quantile falls as m grows (12.7 at m = 2, 2.78 at m = 5 for 95%), so this is fewer than the
    normal approximation's scaling of a small sample's half-width would suggest.

    >>> seeds_for_half_width(0.05, 0.02)
    27
    """
    if sd < 0 or target <= 0:
        raise ValueError(f"need sd >= 0 and target > 0, got sd={sd}, target={target}")
    z = t_quantile(0.5 + confidence / 2.0, 1e12)  # the normal quantile: t's exceeds it, so m >= (z sd / target)^2
    m = max(2, math.floor((z * sd / target) ** 2))
    while t_quantile(0.5 + confidence / 2.0, m - 1) * sd / math.sqrt(m) > target:
        m += 1
        if m > limit:
            raise ArithmeticError(f"more than {limit} values needed (sd={sd}, target={target})")
    return m


def paired_differences(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """``a[k] - b[k]`` for every key (seed) in both mappings, in the order of ``a``."""
    return {k: float(a[k]) - float(b[k]) for k in a if k in b}


def paired_interval(a: Mapping[Hashable, float], b: Mapping[Hashable, float], confidence: float = 0.95) -> Interval:
    """The t interval of the paired differences ``a[k] - b[k]`` over shared keys."""
    return t_interval(list(paired_differences(a, b).values()), confidence)


# ----------------------------------------------------------------------------- curves


def curve_auc(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Normalised area under a curve: the trapezoid integral of y over x divided by
    ``x[-1] - x[0]`` (the curve's average height). ``xs`` strictly increasing; one point
    gives its value."""
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"curve_auc needs as many x as y values (at least one), got {len(xs)} and {len(ys)}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError("curve_auc needs strictly increasing x values")
    if len(xs) == 1:
        return float(ys[0])
    area = math.fsum((x1 - x0) * (y0 + y1) / 2.0 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    return area / (xs[-1] - xs[0])


def cumulative(costs: Sequence[float]) -> list[float]:
    """``[0, c0, c0 + c1, ...]``: the cost spent before each position (len(costs) + 1 values)."""
    out = [0.0]
    for c in costs:
        out.append(out[-1] + float(c))
    return out


def value_at_budget(points: Sequence[tuple[float, float]], budget: float) -> tuple[int, bool]:
    """Index of the last ``(cost, value)`` point whose cost is <= ``budget``, and whether the
    budget reaches beyond the last point (the curve ended before the budget was spent).

    ``points`` are in order of increasing cost; the first point must cost <= budget.
    """
    if not points:
        raise ValueError("value_at_budget needs at least one point")
    if points[0][0] > budget:
        raise ValueError(f"the first point already costs {points[0][0]} > budget {budget}")
    index = 0
    for i, (cost, _) in enumerate(points):
        if cost <= budget:
            index = i
        else:
            break
    return index, points[-1][0] < budget
