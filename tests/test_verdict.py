"""The verdict rule on every branch, in both directions."""
import numpy as np
import pytest

from lib import stats, verdict
from lib.stats import Estimate


def crit(**kw):
    base = dict(finding="f", paper="p", effect="drop", threshold=0.1, paper_effect=0.2, control="random-k")
    return verdict.Criterion(**{**base, **kw})


def ctl(effect, greater=True, n=19):
    """n control sets, all of them less extreme than any effect the tests give (|values| <= 0.02)."""
    return stats.against_controls(effect, np.linspace(-0.02, 0.02, n), greater=greater)


def test_holds_needs_the_whole_interval_beyond_the_threshold_and_the_controls():
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=ctl(0.2))
    assert v.verdict == "holds" and "wholly at or beyond" in v.reason and "rank p = 0.05" in v.reason
    # same estimate, no control measured: cannot hold
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100))
    assert v.verdict == "inconclusive" and "no matched control" in v.reason
    # within the controls' spread
    wide = stats.against_controls(0.2, np.linspace(0, 0.4, 19))
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=wide)
    assert v.verdict == "inconclusive" and "not beyond" in v.reason


def test_one_control_set_above_the_effect_rules_out_beyond_at_19_sets():
    """The first edition's 95th percentile of the sets could lie below the effect while a set beat it."""
    sets = np.r_[np.linspace(-0.02, 0.02, 18), 0.3]  # one of 19 sets beats the effect 0.2
    c = stats.against_controls(0.2, sets)
    assert c.q < 0.2 and c.pvalue == pytest.approx(2 / 20) and not c.beyond
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=c)
    assert v.verdict == "inconclusive" and "not beyond" in v.reason


def test_a_two_sided_control_comparison_is_read_against_the_criterion_s_direction():
    """A two-sided comparison is accepted whatever the criterion's direction; beyond the controls on the other side
    of 0, the interval decides: "does not hold" when it excludes the threshold."""
    sets = np.linspace(-0.02, 0.02, 19)
    up = stats.against_controls(0.2, sets, two_sided=True)
    assert verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=up).verdict == "holds"
    down = stats.against_controls(-0.2, sets, two_sided=True)
    v = verdict.decide(crit(), Estimate(-0.2, -0.25, -0.15, 100), controls=down)
    assert down.beyond and v.verdict == "does not hold"
    # beyond the sets two-sided, but below them: no support for a rise, whatever the interval
    sets_high = np.linspace(0.5, 0.6, 19)
    below = stats.against_controls(0.2, sets_high, two_sided=True)
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=below)
    assert below.beyond and not below.beyond_toward(1) and v.verdict == "inconclusive" and "on the finding's side" in v.reason
    with pytest.raises(ValueError, match="criterion's direction"):  # one-sided the other way is still refused
        verdict.decide(crit(), Estimate(-0.2, -0.25, -0.15, 100), controls=stats.against_controls(-0.2, sets, greater=False))


def test_an_interval_straddling_the_threshold_settles_no_size():
    """Real (excludes 0, beyond the controls) but reaching past the threshold toward 0: neither holds nor partly."""
    v = verdict.decide(crit(), Estimate(0.12, 0.05, 0.19, 100), controls=ctl(0.12))
    assert v.verdict == "inconclusive" and "size is not settled" in v.reason
    c = crit(needs_control=False, control="paired base model", direction="less", threshold=-0.25, paper_effect=-0.5)
    v = verdict.decide(c, Estimate(-0.30, -0.49, -0.07, 256))  # point past the threshold, interval not
    assert v.verdict == "inconclusive" and "size is not settled" in v.reason


def test_a_wide_interval_containing_0_and_the_paper_effect_is_underpowered():
    v = verdict.decide(crit(), Estimate(0.05, -0.2, 0.4, 12), controls=ctl(0.05))
    assert v.verdict == "inconclusive" and "underpowered" in v.reason and "detectable effect" in v.reason
    v = verdict.decide(crit(), Estimate(0.02, -0.1, 0.3, 12), controls=ctl(0.02, n=10))  # few sets change nothing here
    assert v.verdict == "inconclusive"


def test_partly_holds_is_a_real_effect_shown_smaller_than_the_threshold():
    v = verdict.decide(crit(), Estimate(0.05, 0.03, 0.07, 100), controls=ctl(0.05))
    assert v.verdict == "partly holds" and "shown to be smaller" in v.reason
    paired = crit(needs_control=False, control="paired base model")
    assert verdict.decide(paired, Estimate(0.05, 0.03, 0.07, 100)).verdict == "partly holds"
    # smaller than the threshold, but not beyond the controls: the finding's size is still excluded
    v = verdict.decide(crit(), Estimate(0.05, 0.03, 0.07, 100), controls=stats.against_controls(0.05, np.linspace(0, 0.1, 19)))
    assert v.verdict == "does not hold"


def test_does_not_hold_only_when_the_interval_excludes_the_threshold():
    v = verdict.decide(crit(), Estimate(0.01, -0.02, 0.04, 500), controls=ctl(0.01))
    assert v.verdict == "does not hold" and "excludes an effect" in v.reason
    v = verdict.decide(crit(), Estimate(0.01, -0.02, 0.04, 500), controls=ctl(0.01, n=10))
    assert v.verdict == "does not hold"  # excluding the finding's size needs no control sets


def test_too_few_control_sets_cannot_make_an_effect_hold():
    for n in (2, 10, 18):
        v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=ctl(0.2, n=n))
        assert v.verdict == "inconclusive" and f"only {n} matched control sets" in v.reason and "at least 19" in v.reason
    assert verdict.MIN_CONTROLS == 19 and stats.min_controls(0.025) == 39 and stats.min_controls(0.01) == 99


def test_a_family_of_comparisons_needs_more_sets():
    """Two comparisons at 0.05 family-wise (Bonferroni, 0.025 each): 19 sets cannot reach it, 39 can."""
    c19 = stats.against_controls(0.2, np.linspace(-0.02, 0.02, 19), alpha=0.025)
    c39 = stats.against_controls(0.2, np.linspace(-0.02, 0.02, 39), alpha=0.025)
    assert not c19.enough and not c19.beyond and c39.beyond
    assert verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=c19).verdict == "inconclusive"
    assert verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=c39).verdict == "holds"


def test_only_an_uncertainty_interval_decides():
    for kind in ("null band", "spread"):
        with pytest.raises(ValueError, match=f"uncertainty interval of the estimate, got a {kind}"):
            verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100, interval=kind), controls=ctl(0.2))
    with pytest.raises(ValueError, match="interval must be one of"):
        Estimate(0.2, 0.1, 0.3, 10, interval="range")
    assert Estimate(0.2, 0.1, 0.3, 10, interval="spread").scaled(-1).interval == "spread"


def test_preconditions_come_first():
    pre = [verdict.require("relations known", 1, ">=", 2), verdict.require("DPO lowered toxicity", True, "==", True)]
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), preconditions=pre, controls=ctl(0.2))
    assert v.verdict == "inconclusive" and "relations known" in v.reason and "DPO" not in v.reason
    assert "NOT met" in v.ledger()["preconditions"] and "(met)" in v.ledger()["preconditions"]


def test_zero_spread_is_never_significance():
    v = verdict.decide(crit(needs_control=False, control=""), Estimate(0.002, 0.002, 0.002, 3))
    assert v.verdict == "inconclusive" and "zero spread" in v.reason


def test_direction_less_mirrors_greater():
    c = crit(direction="less", threshold=-0.1, paper_effect=-0.25)
    assert verdict.decide(c, Estimate(-0.2, -0.25, -0.15, 100), controls=ctl(-0.2, greater=False)).verdict == "holds"
    assert verdict.decide(c, Estimate(-0.05, -0.07, -0.03, 100), controls=ctl(-0.05, greater=False)).verdict == "partly holds"
    assert verdict.decide(c, Estimate(-0.12, -0.2, -0.05, 100), controls=ctl(-0.12, greater=False)).verdict == "inconclusive"
    assert verdict.decide(c, Estimate(0.0, -0.03, 0.03, 100), controls=ctl(0.0, greater=False)).verdict == "does not hold"
    with pytest.raises(ValueError, match="direction"):
        verdict.decide(c, Estimate(-0.2, -0.25, -0.15, 100), controls=ctl(-0.2, greater=True))


def test_paired_baseline_criterion_needs_no_control():
    c = crit(needs_control=False, control="paired base model")
    assert verdict.decide(c, Estimate(0.2, 0.15, 0.25, 100)).verdict == "holds"


def test_bad_criteria_fail_clearly():
    with pytest.raises(ValueError, match="side of zero"):
        crit(threshold=-0.1)
    with pytest.raises(ValueError, match="name it"):
        crit(control="")
    with pytest.raises(ValueError, match="comparison"):
        verdict.require("x", 1, "=>", 0)


def test_ledger_has_every_column():
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=ctl(0.2))
    row = v.ledger()
    assert set(row) == {"finding", "paper", "estimate", "control", "preconditions", "n", "verdict", "reason", "detectable",
                        "plot"}
    assert row["n"] == 100 and "[0.15, 0.25]" in row["estimate"] and "percentile" in row["control"]
    c = crit()
    assert row["plot"] == {"value": 0.2, "low": 0.15, "high": 0.25, "threshold": c.threshold, "direction": c.direction,
                           "paper_effect": c.paper_effect, "control_edge": ctl(0.2).q}
    bare = verdict.decide(crit(), None).ledger()["plot"]  # no estimate, no controls: the criterion only
    assert bare["value"] is None and bare["control_edge"] is None and bare["threshold"] == c.threshold


def test_bound_findings_need_the_whole_interval_on_their_side():
    c = crit(bound=True, direction="less", threshold=0.25, paper_effect=0.05, needs_control=False, control="")
    assert verdict.decide(c, Estimate(0.1, 0.05, 0.2, 100)).verdict == "holds"
    assert verdict.decide(c, Estimate(0.4, 0.3, 0.5, 100)).verdict == "does not hold"
    v = verdict.decide(c, Estimate(0.2, 0.1, 0.3, 100))
    assert v.verdict == "inconclusive" and "straddles" in v.reason
    with pytest.raises(ValueError, match="preconditions"):
        crit(bound=True, direction="less", threshold=0.25)


