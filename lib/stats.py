"""Statistics shared by every notebook: intervals, paired tests, controls, corrections, power.

Thin wrappers over scipy.stats and statsmodels (no hand-written resampling loops), returning small
frozen dataclasses that the verdict rule (:mod:`lib.verdict`) and the claims ledger read.

Conventions
- *Paired* means one value per item (prompt, fact, seed) under each of two conditions, in the same
  item order; the effect is ``treated - baseline``.
- Intervals are two-sided at ``level`` (default 0.95). Bootstrap intervals are BCa
  (``scipy.stats.bootstrap``); where the data have no spread (every difference equal), BCa is
  undefined: right/wrong outcomes then get an exact (Clopper-Pearson) interval on the share of items
  changed, anything else a zero-width interval, which the verdict rule never counts as significance.
"""
from __future__ import annotations

import math
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from scipy import stats as _st

LEVEL = 0.95
N_RESAMPLES = 2000


# What an Estimate's interval is. Only an uncertainty interval of the estimate (a confidence or bootstrap interval)
# can decide a verdict (lib.verdict.decide refuses the others): a null band says where the estimate would fall by
# chance, and a spread (max - min) describes the data; neither says how far the estimate itself may be off.
INTERVALS = ("uncertainty", "null band", "spread")


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its two-sided interval, and what that interval is (:data:`INTERVALS`)."""
    value: float
    low: float
    high: float
    n: int  # items (prompts, facts, seeds) behind the estimate
    level: float = LEVEL
    method: str = ""
    interval: str = "uncertainty"

    def __post_init__(self):
        if self.interval not in INTERVALS:
            raise ValueError(f"interval must be one of {', '.join(INTERVALS)}, got {self.interval!r}")

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def scaled(self, factor: float) -> "Estimate":
        """The same estimate in other units (e.g. x100 for points); a negative factor swaps the ends."""
        lo, hi = sorted((self.low * factor, self.high * factor))
        return Estimate(self.value * factor, lo, hi, self.n, self.level, self.method, self.interval)

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        """'0.12 [0.05, 0.19]'; ``digits`` should match the interval's resolution. Signs and the signed
        style are decided on the rounded values, so float noise around 0 never prints '-0' or flips the
        style between machines."""
        v, lo, hi = (round(x, digits) + 0.0 for x in (self.value, self.low, self.high))  # -0.0 + 0.0 == 0.0
        f = f"{{:+.{digits}f}}" if lo < 0 < hi or v < 0 else f"{{:.{digits}f}}"
        return f"{f.format(v)}{unit} [{f.format(lo)}, {f.format(hi)}]"


def _as_float(x) -> np.ndarray:
    a = np.asarray(x, dtype=float).ravel()
    if a.size == 0:
        raise ValueError("no data: the sample is empty")
    if not np.isfinite(a).all():
        raise ValueError("the sample holds NaN or infinite values")
    return a


def _degenerate(t: np.ndarray, b: np.ndarray, value: float, level: float, method: str) -> Estimate:
    """Interval for paired differences with no spread (BCa undefined).

    Right/wrong outcomes (both samples 0/1) get an exact binomial interval: with no item changed, the
    share that could change either way is bounded by Clopper-Pearson for 0 of n; with every item
    changed the same way (all lost or all gained), the share changed is at least the lower bound for
    n of n. Anything else gets a zero-width interval, which the verdict rule never counts.
    """
    n, d = t.size, t - b
    binary = np.isin(t, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all()
    if binary and d[0] == 0:
        hi = _st.binomtest(0, n).proportion_ci(confidence_level=level, method="exact").high
        return Estimate(value, -hi, hi, n, level, f"{method}; no item changed: exact bound")
    if binary:
        lo = _st.binomtest(n, n).proportion_ci(confidence_level=level, method="exact").low
        ends = sorted((d[0] * lo, d[0] * 1.0))
        return Estimate(value, ends[0], ends[1], n, level, f"{method}; every item changed alike: exact bound")
    return Estimate(value, value, value, n, level, f"{method}; no spread: zero-width interval")


def bootstrap_mean(x: Sequence[float], level: float = LEVEL, n_resamples: int = N_RESAMPLES,
                   seed: int = 0, statistic: Callable = np.mean, vectorized: bool = False,
                   batch: int | None = None) -> Estimate:
    """BCa bootstrap interval of ``statistic`` (default the mean) of one sample. ``vectorized``: the
    statistic takes a batch of resamples [..., n] (and ``axis=-1``) and returns one value per resample,
    ``batch`` of them at a time (``scipy.stats.bootstrap``'s arguments: the same interval, faster)."""
    a = _as_float(x)
    value = float(statistic(a))
    if a.size < 2 or np.all(a == a[0]):
        return Estimate(value, value, value, a.size, level, "bootstrap; no spread: zero-width interval")
    res = _st.bootstrap((a,), statistic, confidence_level=level, n_resamples=n_resamples, method="BCa",
                        random_state=np.random.default_rng(seed), vectorized=vectorized, batch=batch)
    lo, hi = res.confidence_interval
    return Estimate(value, float(lo), float(hi), a.size, level, "BCa bootstrap")


def share_interval(x: Sequence[float], level: float = LEVEL, n_resamples: int = N_RESAMPLES, seed: int = 0) -> Estimate:
    """Interval of a share of items (an accuracy) from per-item values in [0, 1]. Right/wrong items
    (every value 0 or 1) get the exact Clopper-Pearson interval (``scipy.stats.binomtest``), which keeps
    its width at 0 of n and n of n; per-item shares (e.g. one fact's share of right answers over several
    random neuron sets, not a binomial count) get the BCa bootstrap over items of :func:`bootstrap_mean`."""
    a = _as_float(x)
    if ((a < 0) | (a > 1)).any():
        raise ValueError("a share needs per-item values in [0, 1]")
    if np.isin(a, (0.0, 1.0)).all():
        right = int(a.sum())
        ci = _st.binomtest(right, a.size).proportion_ci(confidence_level=level, method="exact")
        return Estimate(right / a.size, float(ci.low), float(ci.high), a.size, level, "exact Clopper-Pearson")
    return bootstrap_mean(a, level=level, n_resamples=n_resamples, seed=seed)


def paired_bootstrap(treated: Sequence[float], baseline: Sequence[float], level: float = LEVEL,
                     n_resamples: int = N_RESAMPLES, seed: int = 0, statistic: Callable = np.mean,
                     relative: bool = False) -> Estimate:
    """Paired BCa bootstrap interval of ``statistic(treated) - statistic(baseline)`` (with ``relative``:
    ``statistic(treated) / statistic(baseline) - 1``), items resampled together
    (``scipy.stats.bootstrap(..., paired=True)``)."""
    t, b = _as_float(treated), _as_float(baseline)
    if t.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {b.size}")
    if relative and statistic(b) == 0:
        raise ValueError("a relative change needs a non-zero baseline statistic")
    value = float(statistic(t) / statistic(b) - 1) if relative else float(statistic(t) - statistic(b))
    d = t - b
    if t.size < 2 or np.all(d == d[0]):
        if relative:
            return Estimate(value, value, value, t.size, level, "paired bootstrap; no spread: zero-width interval")
        return _degenerate(t, b, value, level, "paired bootstrap")

    def diff(a, c, axis=-1):
        if relative:
            return statistic(a, axis=axis) / statistic(c, axis=axis) - 1
        return statistic(a, axis=axis) - statistic(c, axis=axis)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=_st.DegenerateDataWarning)
        warnings.simplefilter("ignore", category=RuntimeWarning)  # BCa's acceleration on near-constant data
        res = _st.bootstrap((t, b), diff, paired=True, confidence_level=level, n_resamples=n_resamples,
                            method="BCa", random_state=np.random.default_rng(seed), vectorized=True)
    lo, hi = (float(v) for v in res.confidence_interval)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # BCa can fail on near-constant data
        res = _st.bootstrap((t, b), diff, paired=True, confidence_level=level, n_resamples=n_resamples,
                            method="percentile", random_state=np.random.default_rng(seed), vectorized=True)
        lo, hi = (float(v) for v in res.confidence_interval)
        return Estimate(value, lo, hi, t.size, level, "paired percentile bootstrap")
    return Estimate(value, lo, hi, t.size, level, "paired BCa bootstrap")


@dataclass(frozen=True)
class PairedBinary:
    """Exact McNemar test of paired right/wrong outcomes (treated vs baseline)."""
    gained: int  # wrong at baseline, right when treated
    lost: int    # right at baseline, wrong when treated
    n: int
    pvalue: float

    @property
    def change(self) -> float:
        return (self.gained - self.lost) / self.n


def mcnemar(treated_correct: Sequence[bool], baseline_correct: Sequence[bool]) -> PairedBinary:
    """Exact McNemar test (statsmodels; the binomial sign test on the discordant pairs)."""
    from statsmodels.stats.contingency_tables import mcnemar as _mcnemar

    t = np.asarray(treated_correct, dtype=bool).ravel()
    b = np.asarray(baseline_correct, dtype=bool).ravel()
    if t.shape != b.shape or t.size == 0:
        raise ValueError(f"paired outcomes must be non-empty and of equal length ({t.size} vs {b.size})")
    gained, lost = int((~b & t).sum()), int((b & ~t).sum())
    table = [[int((b & t).sum()), lost], [gained, int((~b & ~t).sum())]]
    p = 1.0 if gained + lost == 0 else float(_mcnemar(table, exact=True).pvalue)
    return PairedBinary(gained, lost, t.size, p)


def sign_test(differences: Sequence[float], alternative: str = "two-sided") -> float:
    """Exact sign test of paired differences (zeros dropped): p-value of a binomial test at 1/2."""
    d = _as_float(differences)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    if pos + neg == 0:
        return 1.0
    return float(_st.binomtest(pos, pos + neg, 0.5, alternative=alternative).pvalue)


def min_sign_test_p(n: int, alternative: str = "two-sided") -> float:
    """The smallest p-value an exact sign test (or McNemar) can reach with ``n`` paired items
    (all of them changed in one direction): with n = 3 seeds it is 0.25 two-sided, 0.125 one-sided."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return float(_st.binomtest(n, n, 0.5, alternative=alternative).pvalue)


def paired_permutation(treated: Sequence[float], baseline: Sequence[float], alternative: str = "two-sided",
                       n_resamples: int = 9999, seed: int = 0) -> float:
    """Paired permutation test of the mean difference (condition labels swapped within items;
    ``scipy.stats.permutation_test(permutation_type='samples')``). Returns the p-value."""
    t, b = _as_float(treated), _as_float(baseline)
    if t.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {t.size} vs {b.size}")
    if np.all(t == b):
        return 1.0

    def stat(a, c, axis=-1):
        return np.mean(a - c, axis=axis)

    res = _st.permutation_test((t, b), stat, permutation_type="samples", alternative=alternative,
                               n_resamples=n_resamples, vectorized=True, random_state=np.random.default_rng(seed))
    return float(res.pvalue)


ALPHA = 0.05  # the rank test's level where a comparison stands alone


def min_controls(alpha: float = ALPHA) -> int:
    """The fewest control sets with which the exact rank test can reach p <= ``alpha``: the effect beyond all
    ``n`` sets gives p = 1 / (n + 1), so n >= 1 / alpha - 1 (19 at 0.05; 39 at 0.025, two comparisons
    Bonferroni-corrected; 99 at 0.01)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    return int(math.ceil(1 / alpha - 1 - 1e-9))


@dataclass(frozen=True)
class ControlComparison:
    """An effect against a distribution of matched random controls (same size, same layers, ...): an exact
    Monte-Carlo rank test. The effect and the control sets are exchangeable under the null (no effect beyond what
    any matched set has), so the rank p-value (1 + #sets at least as extreme) / (n + 1) has exactly the error rate
    it states; "beyond" is p <= ``alpha``. A set at least as extreme as the effect adds 1 / (n + 1) to p: with 19
    sets, one such set makes "beyond" at 0.05 impossible."""
    effect: float
    controls: tuple[float, ...]
    name: str
    q: float          # the control band's edge: the 95th (or 5th) percentile of the controls, for plots and reading
    pvalue: float     # rank p-value: (1 + #controls at least as extreme) / (n_controls + 1)
    greater: bool     # True: a larger effect is more extreme
    alpha: float = ALPHA  # the level of "beyond" (a family of comparisons: alpha / their number)
    two_sided: bool = False  # True: extreme on either side, by the distance from the pooled median
    centre: float | None = None  # two-sided: the pooled median the distances are measured from

    @property
    def n(self) -> int:
        return len(self.controls)

    @property
    def enough(self) -> bool:
        """Whether there are enough sets for the rank test to reach ``alpha`` at all (:func:`min_controls`)."""
        return self.n >= min_controls(self.alpha)

    @property
    def beyond(self) -> bool:
        return self.enough and self.pvalue <= self.alpha + 1e-12

    def beyond_toward(self, sign: int) -> bool:
        """``beyond``, and on the side ``sign`` (+1: above, -1: below) of the controls: a two-sided comparison
        finds an effect on either side, but supports a claimed rise only above them and a fall only below."""
        if not self.two_sided:
            return self.beyond and (1 if self.greater else -1) == sign
        return self.beyond and (self.effect - self.centre) * sign > 0

    def fmt(self, digits: int = 2) -> str:
        side = ("95th percentile of the distance from the median" if self.two_sided
                else "95th percentile" if self.greater else "5th percentile")
        return (f"{self.name}: {'two-sided ' if self.two_sided else ''}rank p = {self.pvalue:.2g} ({self.n} sets; beyond at "
                f"p <= {self.alpha:.2g}), {side} {self.q:.{digits}f}")


def against_controls(effect: float, controls: Sequence[float], name: str = "matched random controls",
                     greater: bool = True, quantile: float = 0.95, alpha: float = ALPHA,
                     two_sided: bool = False) -> ControlComparison:
    """Where ``effect`` falls in the distribution of control effects: the exact rank test of
    :class:`ControlComparison` at level ``alpha`` (a family of m comparisons: ``alpha / m``, Bonferroni), and the
    ``quantile`` band edge for plots. With 10 controls p cannot fall below 1/11, so nothing is beyond at 0.05.

    ``two_sided``: an effect is extreme on either side, ranked by its distance from the median of the effect and
    the controls together (a symmetric function of all n + 1 values, so they stay exchangeable under the null and
    the test stays exact); ``q`` is then the ``quantile`` of the controls' distances."""
    c = _as_float(controls)
    if two_sided:
        centre = float(np.median(np.r_[float(effect), c]))
        dist, d_eff = np.abs(c - centre), abs(float(effect) - centre)
        return ControlComparison(float(effect), tuple(float(v) for v in c), name, float(np.quantile(dist, quantile)),
                                 (1 + int((dist >= d_eff).sum())) / (c.size + 1), greater, float(alpha), True, centre)
    if greater:
        q, more = float(np.quantile(c, quantile)), int((c >= effect).sum())
    else:
        q, more = float(np.quantile(c, 1 - quantile)), int((c <= effect).sum())
    return ControlComparison(float(effect), tuple(float(v) for v in c), name, q, (1 + more) / (c.size + 1), greater,
                             float(alpha))


def gap_against_controls(effect: float, controls: Sequence[float], name: str = "matched random controls",
                         greater: bool = True, quantile: float = 0.95, alpha: float = ALPHA) -> ControlComparison:
    """:func:`against_controls` in the units of a gap estimate (effect minus the controls' mean, as
    notebooks 11 and 12 report): ``effect`` and every control minus the controls' mean. The same
    comparison shifted by a constant, so ``beyond`` and the rank p-value are those of the raw one."""
    c = _as_float(controls)
    m = float(c.mean())
    return against_controls(float(effect) - m, c - m, name=f"{name}, minus their mean", greater=greater, quantile=quantile,
                            alpha=alpha)


def gap_interval(effect: Sequence[float], controls: np.ndarray, level: float = LEVEL, n_resamples: int = N_RESAMPLES,
                 seed: int = 0) -> Estimate:
    """Interval of mean(effect) - mean(controls): an effect measured per item (``effect`` [n_items], e.g. one
    log-prob drop per fact) against matched control sets measured on the same items (``controls``
    [n_sets, n_items]). Both levels are resampled, the control sets and the items (the same items for the effect
    and the sets, so the pairing is kept), so the interval carries the control sets' spread as well as the items':
    :func:`seeds_and_items_bootstrap` with the sets as its seeds, read the other way round."""
    c = np.asarray(controls, dtype=float)
    est = seeds_and_items_bootstrap(c, effect, level=level, n_resamples=n_resamples, seed=seed).scaled(-1.0)
    return dataclasses.replace(est, method=f"two-level percentile bootstrap ({c.shape[0]} control sets x {est.n} items)")


def control_permutation(effects: Sequence[float], controls: Sequence[float], alternative: str = "greater",
                        n_resamples: int = 9999, seed: int = 0) -> float:
    """Permutation test that a set of effects (e.g. one per relation) is larger than a set of control
    effects (``scipy.stats.permutation_test``, independent samples, difference of means)."""
    e, c = _as_float(effects), _as_float(controls)

    def stat(a, b, axis=-1):
        return np.mean(a, axis=axis) - np.mean(b, axis=axis)

    res = _st.permutation_test((e, c), stat, permutation_type="independent", alternative=alternative,
                               n_resamples=n_resamples, vectorized=True, random_state=np.random.default_rng(seed))
    return float(res.pvalue)


def correct(pvalues: Sequence[float], method: str = "holm", alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Multiple-testing correction (statsmodels ``multipletests``): 'holm' (family-wise) or 'fdr_bh'
    (Benjamini-Hochberg). Returns (reject, adjusted p-values)."""
    from statsmodels.stats.multitest import multipletests

    if method not in ("holm", "fdr_bh", "bonferroni"):
        raise ValueError(f"unknown correction {method!r}: use 'holm', 'fdr_bh' or 'bonferroni'")
    p = _as_float(pvalues)
    reject, p_adj, _, _ = multipletests(p, alpha=alpha, method=method)
    return reject, p_adj


def mde_paired_continuous(n: int, sd: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable mean difference of a paired continuous design: the effect a two-sided paired
    t-test at ``alpha`` finds with probability ``power`` when the differences have s.d. ``sd``
    (statsmodels ``TTestPower``)."""
    from statsmodels.stats.power import TTestPower

    if n < 2:
        raise ValueError(f"n must be at least 2, got {n}")
    d = TTestPower().solve_power(effect_size=None, nobs=n, alpha=alpha, power=power, alternative="two-sided")
    return float(d * sd)


def n_paired_continuous(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """The number of pairs (seeds) a two-sided paired t-test at ``alpha`` needs to find a mean difference of
    ``effect`` with probability ``power`` when the differences have s.d. ``sd`` (statsmodels ``TTestPower``,
    rounded up): the inverse of :func:`mde_paired_continuous`."""
    from statsmodels.stats.power import TTestPower

    if not effect > 0 or not sd > 0:
        raise ValueError(f"effect and sd must be positive, got effect={effect!r}, sd={sd!r}")
    n = TTestPower().solve_power(effect_size=effect / sd, nobs=None, alpha=alpha, power=power, alternative="two-sided")
    return int(math.ceil(float(n)))


def mde_from_interval(est: Estimate, power: float = 0.8) -> float:
    """Minimum detectable effect implied by an interval: (z_a/2 + z_power) * SE, with the SE read off
    the interval's half-width. 0.71 x the interval's width at 95% and 80% power."""
    return mde_from_width(est.width, est.level, power)


def mde_from_width(width: float, level: float = LEVEL, power: float = 0.8) -> float:
    """:func:`mde_from_interval` from an interval's width and level alone (e.g. a ledger row's)."""
    if not 0 < level < 1 or not 0 < power < 1:
        raise ValueError(f"level and power must lie in (0, 1), got {level!r}, {power!r}")
    z = _st.norm.ppf(0.5 + level / 2)
    return float((z + _st.norm.ppf(power)) * width / (2 * z))


@dataclass(frozen=True)
class SeedSummary:
    """An effect measured once per seed, with a sign test across seeds."""
    estimate: Estimate
    values: tuple[float, ...]
    pvalue: float
    min_p: float = field(default=1.0)

    def fmt(self, digits: int = 2) -> str:
        return (f"{self.estimate.fmt(digits)} over {len(self.values)} seeds; sign test p = {self.pvalue:.2g}"
                f" (smallest attainable {self.min_p:.2g})")


def across_seeds(values: Sequence[float], level: float = LEVEL, seed: int = 0) -> SeedSummary:
    """Summarise a per-seed effect: Student t interval of the mean over seeds (``scipy.stats.ttest_1samp``;
    zero-width when every seed gives the same value, which is never significance) and an exact two-sided
    sign test. Not the BCa bootstrap: over a handful of seeds (10) it covers less than its level, and it
    excluded 0 or a threshold where the t interval does not (notebooks 07 and 10). ``seed`` is
    kept for callers; the t interval draws nothing."""
    v = _as_float(values)
    if v.size < 2:
        est = Estimate(float(v[0]), float(v[0]), float(v[0]), 1, level, "one seed")
    elif np.all(v == v[0]):
        est = Estimate(float(v[0]), float(v[0]), float(v[0]), v.size, level, "t interval; no spread: zero-width interval")
    else:
        ci = _st.ttest_1samp(v, 0.0).confidence_interval(confidence_level=level)
        est = Estimate(float(v.mean()), float(ci.low), float(ci.high), v.size, level, "Student t interval over seeds")
    return SeedSummary(est, tuple(float(x) for x in v), sign_test(v), min_sign_test_p(v.size))


def seeds_and_items_bootstrap(treated: np.ndarray, baseline: Sequence[float], level: float = LEVEL,
                              n_resamples: int = N_RESAMPLES, seed: int = 0, relative: bool = False) -> Estimate:
    """Interval of mean(treated) - mean(baseline) (``relative``: mean(treated) / mean(baseline) - 1) when
    the treatment was run with several seeds: ``treated`` [n_seeds, n_items] (e.g. one DPO model per
    training seed, each scored on the same prompts), ``baseline`` [n_items] (the untreated model).

    A two-level percentile bootstrap: each resample draws the seeds with replacement and, independently,
    the items with replacement (the same items for treated and baseline, so the pairing is kept), so the
    interval carries both the seed-to-seed and the item-to-item variability. scipy's bootstrap resamples
    one level only, hence this small vectorised version. With one seed it is the plain paired
    percentile bootstrap over items."""
    t, b = np.asarray(treated, dtype=float), _as_float(baseline)
    if t.ndim != 2 or t.shape[1] != b.size:
        raise ValueError(f"treated must be [n_seeds, n_items] with n_items = {b.size}, got shape {list(t.shape)}")
    if relative and b.mean() == 0:
        raise ValueError("a relative change needs a non-zero baseline mean")

    def stat(tm, bm):
        return tm / bm - 1 if relative else tm - bm

    value = float(stat(t.mean(), b.mean()))
    n_seeds, n = t.shape
    d = t - b[None, :]
    if np.all(d == d.flat[0]) and np.all(b == b[0]):  # nothing varies: no interval to draw
        return Estimate(value, value, value, n, level, "two-level bootstrap; no spread: zero-width interval")
    rng = np.random.default_rng(seed)
    s_idx = rng.integers(0, n_seeds, size=(n_resamples, n_seeds))
    i_idx = rng.integers(0, n, size=(n_resamples, n))
    seed_means = t[s_idx].mean(1)  # [n_resamples, n]: each resample's seeds, averaged per item
    tm = np.take_along_axis(seed_means, i_idx, axis=1).mean(1)
    bm = b[i_idx].mean(1)
    if relative and np.any(bm == 0):
        bm = np.where(bm == 0, np.nan, bm)
    boot = stat(tm, bm)
    alpha = (1 - level) / 2
    lo, hi = np.nanquantile(boot, [alpha, 1 - alpha])
    return Estimate(value, float(lo), float(hi), n, level, f"two-level percentile bootstrap ({n_seeds} seeds x {n} items)")
