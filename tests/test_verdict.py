"""The verdict rule on every branch, in both directions."""
import numpy as np
import pytest

from lib import stats, verdict
from lib.stats import Estimate


def crit(**kw):
    base = dict(finding="f", paper="p", effect="drop", threshold=0.1, paper_effect=0.2, control="random-k")
    return verdict.Criterion(**{**base, **kw})


def ctl(effect, greater=True):
    return stats.against_controls(effect, np.linspace(-0.02, 0.02, 20), greater=greater)


def test_holds_needs_interval_threshold_and_controls():
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=ctl(0.2))
    assert v.verdict == "holds" and "excludes 0" in v.reason
    # same estimate, no control measured: cannot hold
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100))
    assert v.verdict == "inconclusive" and "no matched control" in v.reason
    # within the controls' band
    wide = stats.against_controls(0.2, np.linspace(0, 0.4, 20))
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=wide)
    assert v.verdict == "inconclusive" and "not beyond" in v.reason


def test_partly_holds_is_a_real_but_smaller_effect():
    v = verdict.decide(crit(), Estimate(0.05, 0.03, 0.07, 100), controls=ctl(0.05))
    assert v.verdict == "partly holds"


def test_does_not_hold_only_when_the_interval_excludes_the_threshold():
    v = verdict.decide(crit(), Estimate(0.01, -0.02, 0.04, 500), controls=ctl(0.01))
    assert v.verdict == "does not hold" and "excludes an effect" in v.reason
    v = verdict.decide(crit(), Estimate(0.02, -0.1, 0.3, 12), controls=ctl(0.02))
    assert v.verdict == "inconclusive" and "underpowered" in v.reason and "detectable effect" in v.reason


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


def test_too_few_controls_cannot_make_an_effect_hold():
    few = stats.against_controls(0.2, [0.0, 0.01])
    v = verdict.decide(crit(), Estimate(0.2, 0.15, 0.25, 100), controls=few)
    assert v.verdict == "inconclusive" and "only 2 matched controls" in v.reason
