"""flowrl.stats against values obtained by a second route: published t tables, closed forms of
the t distribution for 1 and 2 degrees of freedom, numerical integration of the t density, and
intervals computed by hand (the arithmetic is written out in the comments)."""

from __future__ import annotations

import math

import pytest

from flowrl.stats import (
    betainc,
    cumulative,
    curve_auc,
    paired_differences,
    paired_interval,
    seeds_for_half_width,
    t_cdf,
    t_interval,
    t_quantile,
    value_at_budget,
)

# Two-sided 95% (p = 0.975), 90% (p = 0.95) and 99% (p = 0.995) critical values of Student's t,
# as printed in standard tables (6 decimals).
TABLE = [
    (0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 3, 3.182446), (0.975, 4, 2.776445),
    (0.975, 5, 2.570582), (0.975, 9, 2.262157), (0.975, 10, 2.228139), (0.975, 29, 2.045230),
    (0.975, 30, 2.042272), (0.975, 100, 1.983972), (0.95, 4, 2.131847), (0.95, 10, 1.812461),
    (0.995, 4, 4.604095), (0.995, 9, 3.249836),
]


@pytest.mark.parametrize("p,df,expected", TABLE)
def test_t_quantile_matches_the_printed_table(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=5e-7)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=5e-7)


@pytest.mark.parametrize("p", [0.55, 0.75, 0.9, 0.975, 0.999])
def test_t_quantile_closed_forms_for_one_and_two_degrees_of_freedom(p):
    # df = 1 is the Cauchy distribution: F^-1(p) = tan(pi (p - 1/2)).
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
    # df = 2: F^-1(p) = (2p - 1) / sqrt(2 p (1 - p)).
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)


def test_t_quantile_tends_to_the_normal_quantile():
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-6)


@pytest.mark.parametrize("df", [4.0, 7.5])
@pytest.mark.parametrize("t", [-2.0, 0.3, 1.0, 2.5])
def test_t_cdf_matches_simpson_integration_of_the_density(df, t):
    # density f(x) = Gamma((df+1)/2) / (sqrt(df pi) Gamma(df/2)) (1 + x^2/df)^(-(df+1)/2);
    # F(t) = 1/2 + integral_0^t f (the density is symmetric), by composite Simpson's rule.
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def f(x):
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    n = 2000
    h = t / n
    simpson = f(0) + f(t) + sum((4 if k % 2 else 2) * f(k * h) for k in range(1, n))
    assert t_cdf(t, df) == pytest.approx(0.5 + simpson * h / 3, abs=1e-10)


def test_betainc_special_cases():
    # I_x(1, 1) = x; I_x(a, 1) = x^a; I_x(1, b) = 1 - (1 - x)^b
    assert betainc(1, 1, 0.3) == pytest.approx(0.3, abs=1e-14)
    assert betainc(2.5, 1, 0.6) == pytest.approx(0.6**2.5, abs=1e-14)
    assert betainc(1, 3, 0.2) == pytest.approx(1 - 0.8**3, abs=1e-14)
    assert betainc(2, 3, 0.0) == 0.0 and betainc(2, 3, 1.0) == 1.0


def test_t_interval_by_hand():
    # values 0.80 0.84 0.79 0.86 0.81: sum 4.10, mean 0.82
    # deviations -0.02 +0.02 -0.03 +0.04 -0.01, squares 0.0004 0.0004 0.0009 0.0016 0.0001 = 0.0034
    # s^2 = 0.0034 / 4 = 0.00085, s = 0.0291548, s / sqrt(5) = 0.0130384
    # t_{0.975, 4} = 2.776445, half-width = 2.776445 * 0.0130384 = 0.0362004
    iv = t_interval([0.80, 0.84, 0.79, 0.86, 0.81])
    assert iv.n == 5
    assert iv.mean == pytest.approx(0.82, abs=1e-12)
    assert iv.sd == pytest.approx(0.0291548, abs=1e-7)
    assert iv.half_width == pytest.approx(0.0362004, abs=1e-7)
    assert (iv.lo, iv.hi) == (pytest.approx(0.7837996, abs=1e-7), pytest.approx(0.8562004, abs=1e-7))


def test_t_interval_with_fewer_than_two_values_has_no_interval():
    one = t_interval([0.7])
    assert one.mean == 0.7 and one.half_width is None and one.lo is None and one.sd is None
    none = t_interval([])
    assert none.n == 0 and none.mean is None


def test_paired_interval_by_hand():
    # pairs by seed (variant - baseline): 0.83-0.80, 0.85-0.84, 0.83-0.79, 0.88-0.86, 0.84-0.81
    #   = 0.03 0.01 0.04 0.02 0.03 (seed 9 has no baseline run: not paired); mean 0.13 / 5 = 0.026
    # deviations 0.004 -0.016 0.014 -0.006 0.004, squares (1e-6) 16 256 196 36 16 = 520e-6
    # s^2 = 520e-6 / 4 = 130e-6, s = 0.0114018, s / sqrt(5) = 0.00509902
    # half-width = 2.776445 * 0.00509902 = 0.0141572
    base = {0: 0.80, 1: 0.84, 2: 0.79, 3: 0.86, 4: 0.81}
    variant = {0: 0.83, 1: 0.85, 2: 0.83, 3: 0.88, 4: 0.84, 9: 0.99}
    assert list(paired_differences(variant, base)) == [0, 1, 2, 3, 4]
    iv = paired_interval(variant, base)
    assert iv.n == 5
    assert iv.mean == pytest.approx(0.026, abs=1e-12)
    assert iv.sd == pytest.approx(0.0114018, abs=1e-7)
    assert iv.half_width == pytest.approx(0.0141572, abs=1e-7)


def test_seeds_for_half_width_by_the_table():
    # sd 0.05, target 0.02: 0.02 / 0.05 = 0.4 = t / sqrt(m). m = 26: t(25) = 2.059539, 2.059539 / 5.09902
    # = 0.40391 > 0.4; m = 27: t(26) = 2.055529, 2.055529 / 5.196152 = 0.39559 <= 0.4. So 27, where
    # scaling a 5-value half-width (2.776445 * 0.05 / sqrt(5) = 0.062083) by (0.062083 / 0.02)^2 * 5 gives 49.
    assert seeds_for_half_width(0.05, 0.02) == 27
    # sd 0.02, target 0.02: t(m-1) <= sqrt(m); m = 6: 2.570582 > 2.449490; m = 7: t(6) = 2.446912 <= 2.645751
    assert seeds_for_half_width(0.02, 0.02) == 7
    assert seeds_for_half_width(0.0, 0.02) == 2  # no spread: the fewest values an interval needs
    for sd in (0.01, 0.03, 0.07, 0.2):  # the answer is the first m that meets the target
        m = seeds_for_half_width(sd, 0.02)
        assert t_interval_half(sd, m) <= 0.02 < (t_interval_half(sd, m - 1) if m > 2 else math.inf)


def t_interval_half(sd: float, m: int) -> float:
    return t_quantile(0.975, m - 1) * sd / math.sqrt(m)


def test_curve_auc_by_hand():
    # trapezoids: (0.5+0.7)/2*1 = 0.6, (0.7+0.6)/2*1 = 0.65, (0.6+0.9)/2*2 = 1.5; 2.75 / (4 - 0) = 0.6875
    assert curve_auc([0, 1, 2, 4], [0.5, 0.7, 0.6, 0.9]) == pytest.approx(0.6875, abs=1e-15)
    assert curve_auc([0, 1, 2], [1.0, 2.0, 3.0]) == pytest.approx(2.0)  # a line: its mid value
    assert curve_auc([5], [0.3]) == 0.3
    with pytest.raises(ValueError):
        curve_auc([0, 0], [1, 2])


def test_cumulative_and_value_at_budget():
    assert cumulative([1.5, 1.5, 2.0]) == [0.0, 1.5, 3.0, 5.0]
    points = [(0.0, 0.5), (1.5, 0.6), (3.0, 0.7)]
    assert value_at_budget(points, 2.0) == (1, False)
    assert value_at_budget(points, 3.0) == (2, False)
    assert value_at_budget(points, 10.0) == (2, True)
    assert value_at_budget(points, 0.0) == (0, False)
