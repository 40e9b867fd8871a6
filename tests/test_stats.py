"""lib.stats against the obvious answers and against scipy/statsmodels computed directly."""
import numpy as np
import pytest
import scipy.stats
from scipy import stats as st

from lib import stats


def test_paired_bootstrap_contains_the_mean_difference_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    base = rng.normal(size=400)
    treated = base + 0.3 + rng.normal(scale=0.5, size=400)
    e = stats.paired_bootstrap(treated, base, seed=1)
    assert e.low < e.value < e.high and abs(e.value - np.mean(treated - base)) < 1e-12
    assert e.low > 0.2 and e.high < 0.4 and e.n == 400 and "BCa" in e.method
    small = stats.paired_bootstrap(treated[:40], base[:40], seed=1)
    assert small.width > e.width


def test_paired_bootstrap_has_no_effect_where_none_is():
    rng = np.random.default_rng(3)
    base = rng.normal(size=300)
    e = stats.paired_bootstrap(base + rng.normal(scale=0.2, size=300), base, seed=0)
    assert e.low < 0 < e.high


def test_degenerate_binary_differences_get_an_exact_bound_not_zero_width():
    same = np.array([1, 0, 1, 1, 0] * 10, dtype=float)
    e = stats.paired_bootstrap(same, same)
    assert e.value == 0 and e.low < 0 < e.high
    assert np.isclose(e.high, st.binomtest(0, 50).proportion_ci(method="exact").high)
    constant = stats.paired_bootstrap(np.full(5, 2.0), np.full(5, 1.0))
    assert constant.width == 0  # a constant non-binary shift: zero width, which the verdict rule refuses
    assert stats.paired_bootstrap(np.full(5, 0.3), np.full(5, 0.3)).width == 0  # continuous no-op: no binary bound
    lost = stats.paired_bootstrap(np.zeros(40), np.ones(40))  # every fact lost
    assert lost.value == -1 and lost.high < -0.9 and lost.low == -1
    assert np.isclose(lost.high, -st.binomtest(40, 40).proportion_ci(method="exact").low)


def test_mcnemar_is_exact_and_counts_discordant_pairs():
    base = np.array([1] * 10 + [0] * 10, dtype=bool)
    treated = base.copy()
    treated[:7] = False  # 7 lost
    treated[10:11] = True  # 1 gained
    r = stats.mcnemar(treated, base)
    assert (r.gained, r.lost, r.n) == (1, 7, 20)
    assert np.isclose(r.pvalue, st.binomtest(1, 8, 0.5).pvalue)
    assert np.isclose(r.change, -6 / 20)
    assert stats.mcnemar(base, base).pvalue == 1.0


def test_sign_test_and_smallest_attainable_p():
    assert stats.min_sign_test_p(3) == pytest.approx(0.25)
    assert stats.min_sign_test_p(3, "greater") == pytest.approx(0.125)
    assert stats.sign_test([0.1, 0.2, 0.3]) == pytest.approx(0.25)
    assert stats.sign_test([0, 0, 0]) == 1.0


def test_paired_permutation_finds_a_shift_and_not_noise():
    rng = np.random.default_rng(1)
    base = rng.normal(size=60)
    assert stats.paired_permutation(base + 0.8, base + rng.normal(scale=0.5, size=60) * 0) < 0.001
    noise = base + rng.normal(scale=0.5, size=60)
    assert stats.paired_permutation(noise, base) > 0.05


def test_against_controls_rank_p_and_band():
    controls = np.arange(19, dtype=float)  # 0..18
    c = stats.against_controls(20.0, controls)
    assert c.beyond and c.pvalue == pytest.approx(1 / 20) and c.q == pytest.approx(np.quantile(controls, 0.95))
    inside = stats.against_controls(9.5, controls)
    assert not inside.beyond and inside.pvalue == pytest.approx(10 / 20)
    low = stats.against_controls(-1.0, controls, greater=False)
    assert low.beyond and low.q == pytest.approx(np.quantile(controls, 0.05))
    ten = stats.against_controls(12.0, np.arange(10, dtype=float))  # beyond all 10: p = 1/11, not beyond at 0.05
    assert not ten.enough and not ten.beyond and ten.pvalue == pytest.approx(1 / 11)


def test_the_rank_test_has_the_error_rate_it_states():
    """Under the null (effect and sets drawn alike), "beyond" at 19 sets happens in 5% of draws."""
    rng = np.random.default_rng(0)
    hits = [stats.against_controls(x[0], x[1:]).beyond for x in rng.normal(size=(4000, 20))]
    assert np.mean(hits) == pytest.approx(0.05, abs=0.012)


def test_the_two_sided_rank_test_finds_either_side_and_keeps_its_error_rate():
    controls = np.arange(19, dtype=float)  # 0..18, median 9
    high, low = stats.against_controls(30.0, controls, two_sided=True), stats.against_controls(-12.0, controls, two_sided=True)
    assert high.beyond and low.beyond and high.pvalue == pytest.approx(1 / 20) and high.two_sided
    assert "two-sided rank p" in high.fmt() and "distance from the median" in high.fmt()
    # one-sided in the wrong direction misses the low effect that two-sided finds
    assert not stats.against_controls(-12.0, controls).beyond
    inside = stats.against_controls(8.0, controls, two_sided=True)
    assert not inside.beyond and inside.pvalue > 0.5
    # an effect just beyond the top set is not beyond two-sided when the bottom set is as far from the centre
    assert not stats.against_controls(18.5, controls, two_sided=True).beyond
    rng = np.random.default_rng(1)
    hits = [stats.against_controls(x[0], x[1:], two_sided=True).beyond for x in rng.normal(size=(4000, 20))]
    assert np.mean(hits) == pytest.approx(0.05, abs=0.012)


def test_gap_interval_carries_the_control_sets_spread():
    """A gap against control sets that disagree with each other is less certain than one against sets that
    agree, at the same items: the two-level interval widens with the sets' spread; a planted gap is found, and
    an effect drawn like the sets has an interval around 0."""
    rng = np.random.default_rng(0)
    items = rng.normal(0, 1, 200)
    effect = items + 1.0
    tight = items[None, :] + rng.normal(0, 0.01, (19, 1))
    loose = items[None, :] + rng.normal(0, 1.0, (19, 1))
    a, b = stats.gap_interval(effect, tight), stats.gap_interval(effect, loose)
    assert a.low > 0.9 and a.high < 1.1 and b.width > 3 * a.width and "19 control sets" in b.method
    null = stats.gap_interval(items + rng.normal(0, 0.3, 200), items[None, :] + rng.normal(0, 0.3, (19, 200)))
    assert null.low < 0 < null.high


def test_gap_against_controls_is_the_raw_comparison_shifted():
    rng = np.random.default_rng(0)
    controls = rng.normal(2.0, 0.5, 10)
    for raw in (1.5, 2.6, 3.9):
        for greater in (True, False):
            a, g = stats.against_controls(raw, controls, greater=greater), stats.gap_against_controls(raw, controls, greater=greater)
            assert (g.beyond, g.pvalue) == (a.beyond, a.pvalue)
            assert g.effect == pytest.approx(raw - controls.mean()) and g.q == pytest.approx(a.q - controls.mean())
            assert np.mean(g.controls) == pytest.approx(0.0, abs=1e-12) and g.name.endswith("minus their mean")


def test_correct_matches_statsmodels_holm_and_bh():
    from statsmodels.stats.multitest import multipletests
    p = [0.001, 0.01, 0.02, 0.04, 0.3]
    for method in ("holm", "fdr_bh"):
        reject, adj = stats.correct(p, method)
        ref = multipletests(p, method=method)
        assert (reject == ref[0]).all() and np.allclose(adj, ref[1])
    with pytest.raises(ValueError, match="correction"):
        stats.correct(p, "magic")


def test_minimum_detectable_effects():
    # paired t-test power: d = 2.8/sqrt(n) roughly for large n
    mde = stats.mde_paired_continuous(100, sd=1.0)
    assert 0.25 < mde < 0.32
    assert stats.mde_paired_continuous(400, sd=1.0) < mde
    # the seeds a power calculation asks for: the smallest n whose detectable effect reaches the target
    n = stats.n_paired_continuous(0.25, sd=1.0)
    assert stats.mde_paired_continuous(n, sd=1.0) <= 0.25 < stats.mde_paired_continuous(n - 1, sd=1.0)
    assert stats.n_paired_continuous(0.5, sd=1.0) < n and stats.n_paired_continuous(0.25, sd=2.0) > n
    with pytest.raises(ValueError, match="positive"):
        stats.n_paired_continuous(0.0, sd=1.0)
    # a sign test needs at least 6 seeds, all in one direction, for p <= 0.05 (2 * 0.5**6 = 0.031)
    assert stats.min_sign_test_p(6) <= 0.05 < stats.min_sign_test_p(5)
    e = stats.Estimate(0.0, -0.1, 0.1, 50)
    assert stats.mde_from_interval(e) == pytest.approx(0.2 / 3.92 * 2.80, rel=0.01)


def test_across_seeds_gives_the_t_interval_of_the_mean():
    v = np.array([-0.2, 0.05, -0.05, -0.11, 0.03, 0.12, -0.15, -0.09, -0.07, -0.01])
    s = stats.across_seeds(v)
    half = scipy.stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    assert s.estimate.value == pytest.approx(v.mean())
    assert (s.estimate.low, s.estimate.high) == pytest.approx((v.mean() - half, v.mean() + half))
    assert s.estimate.width > stats.bootstrap_mean(v).width  # the BCa bootstrap over 10 seeds is narrower (under-covers)


def test_across_seeds_zero_spread_has_zero_width():
    s = stats.across_seeds([0.2, 0.2, 0.2])
    assert s.estimate.width == 0 and s.min_p == pytest.approx(0.25) and s.pvalue == pytest.approx(0.25)


def test_bad_input_fails_clearly():
    with pytest.raises(ValueError, match="length"):
        stats.paired_bootstrap([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="empty"):
        stats.bootstrap_mean([])
    with pytest.raises(ValueError, match="NaN"):
        stats.bootstrap_mean([1.0, float("nan")])


def test_relative_paired_change():
    rng = np.random.default_rng(2)
    base = rng.uniform(0.2, 0.6, size=200)
    e = stats.paired_bootstrap(base * 0.5, base, relative=True)
    assert e.value == pytest.approx(-0.5) and e.low <= -0.5 + 1e-9 <= e.high + 1e-9
    with pytest.raises(ValueError, match="non-zero"):
        stats.paired_bootstrap([1.0, 2.0], [0.0, 0.0], relative=True)


def test_share_interval_is_clopper_pearson_for_right_wrong_items_and_bca_for_shares():
    from statsmodels.stats.proportion import proportion_confint

    right = np.array([1] * 7 + [0] * 17, dtype=float)
    e = stats.share_interval(right)
    assert e.value == pytest.approx(7 / 24) and e.n == 24 and "Clopper-Pearson" in e.method
    assert (e.low, e.high) == pytest.approx(proportion_confint(7, 24, alpha=0.05, method="beta"))
    none = stats.share_interval(np.zeros(12))  # 0 of n: the interval keeps its width
    assert none.low == 0 and none.high == pytest.approx(1 - 0.025 ** (1 / 12))
    shares = np.tile([0.0, 0.5, 1.0, 0.5], 10)  # each fact's mean over two random sets: not binomial
    b = stats.share_interval(shares, seed=3)
    ref = stats.bootstrap_mean(shares, seed=3)
    assert (b.value, b.low, b.high, b.method) == (ref.value, ref.low, ref.high, ref.method)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.share_interval([0.5, 1.5])


def test_fmt_never_prints_negative_zero_and_decides_style_on_rounded_values():
    from lib.stats import Estimate

    assert Estimate(-0.3, -0.4, 0.2, 3).fmt(0) == "0 [0, 0]"  # was '+0 [-0, +0]' (10's key cell)
    assert Estimate(0.2, -0.001, 0.4, 3).fmt(2) == Estimate(0.2, 0.001, 0.4, 3).fmt(2) == "0.20 [0.00, 0.40]"
    assert Estimate(0.0, -0.05, 0.06, 3).fmt(2) == "+0.00 [-0.05, +0.06]"
    assert Estimate(-0.28, -0.47, -0.05, 3).fmt(2) == "-0.28 [-0.47, -0.05]"


def test_seeds_and_items_bootstrap_widens_with_seed_spread_and_matches_one_seed():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.2, 0.6, 200)
    one = (base - 0.1 + rng.normal(0, 0.05, 200))[None, :]
    e1 = stats.seeds_and_items_bootstrap(one, base, seed=0)
    ref = stats.paired_bootstrap(one[0], base, seed=0)
    assert abs(e1.value - ref.value) < 1e-12 and abs(e1.low - ref.low) < 0.01 and abs(e1.high - ref.high) < 0.01
    # three seeds that disagree by much more than the prompts do: the interval must cover their spread
    spread = np.stack([base - 0.3, base - 0.1, base + 0.1]) + rng.normal(0, 0.01, (3, 200))
    e3 = stats.seeds_and_items_bootstrap(spread, base, seed=0)
    per_item_only = stats.paired_bootstrap(spread.mean(0), base, seed=0)
    assert e3.width > 5 * per_item_only.width and e3.low < -0.2 and e3.high > -0.05
    # relative change, and a planted null: seeds centred on the base give an interval around 0
    rel = stats.seeds_and_items_bootstrap(one, base, relative=True, seed=0)
    assert abs(rel.value - (one.mean() / base.mean() - 1)) < 1e-12 and rel.high < 0
    null = stats.seeds_and_items_bootstrap(base[None, :] + rng.normal(0, 0.05, (3, 200)), base, seed=0)
    assert null.low < 0 < null.high
    assert stats.seeds_and_items_bootstrap(np.stack([base, base]), base).width == 0
    with pytest.raises(ValueError, match="n_seeds, n_items"):
        stats.seeds_and_items_bootstrap(base, base)


def test_bootstrap_mean_vectorized_gives_the_same_interval():
    # a statistic written for a batch of resamples [..., n] gives the interval of the same statistic one
    # resample at a time (notebook 04's resampled group shares use this)
    x = np.random.default_rng(3).normal(size=25)
    one = stats.bootstrap_mean(x, statistic=lambda a: float(np.median(a)), seed=1)
    many = stats.bootstrap_mean(x, statistic=lambda a, axis=-1: np.median(a, axis=axis), seed=1, vectorized=True, batch=64)
    assert many.value == pytest.approx(one.value) and many.method == one.method == "BCa bootstrap"
    assert (many.low, many.high) == pytest.approx((one.low, one.high), rel=1e-9)
