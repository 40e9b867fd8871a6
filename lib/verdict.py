"""The one verdict rule every notebook calls (second edition).

A notebook states its :class:`Criterion` in a cell before any result (the only place its thresholds
live), measures an :class:`~lib.stats.Estimate` (an effect with an uncertainty interval), compares it with
matched controls (:func:`lib.stats.against_controls`, an exact rank test) where the finding needs them,
checks its named :class:`Precondition` s, and calls :func:`decide`. Each word is a statement about the
interval, never about the point estimate alone:

1. a precondition not met                            -> inconclusive: precondition not met: <which>
2. no estimate, or an interval of zero width         -> inconclusive (zero spread is never significance)
   an interval that is not an uncertainty interval   -> refused (ValueError): a null band or a spread
3. the whole interval at or beyond the threshold,
   beyond the controls (where they are needed)       -> holds
4. the whole interval between 0 and the threshold,
   beyond the controls                               -> partly holds (a real effect, shown to be smaller)
5. the interval lies below the threshold             -> does not hold (an effect of the finding's size is
                                                        excluded; the preconditions are met)
6. too few control sets for the rank test to reach
   its level (fewer than 19 at p <= 0.05)            -> inconclusive: not enough control sets
7. the interval excludes 0 but is not beyond the
   controls, or has no matched control               -> inconclusive: within controls / no control
8. the interval excludes 0, beyond the controls, but
   reaches past the threshold toward 0               -> inconclusive: a real effect whose size is not settled
9. the interval contains 0                           -> inconclusive: underpowered (detectable effect X)

"Beyond the controls" is the exact rank test of :class:`lib.stats.ControlComparison`: the effect's rank p-value
among n matched sets, (1 + #sets at least as extreme) / (n + 1), at most the comparison's ``alpha`` (0.05 unless a
family of comparisons divides it); one-sided in the paper's direction, or two-sided where the criterion says so,
and then it counts only on the paper's side of the sets (``ControlComparison.beyond_toward``). Its error rate is what it says, and it needs n >= 1 / alpha - 1 sets
(:func:`lib.stats.min_controls`: 19 at 0.05); a set at least as extreme as the effect then makes "beyond"
impossible. "Below" and "beyond" are read in the paper's direction (``Criterion.direction``), so an effect that
the paper reports as a fall is handled like one reported as a rise.

A *bound* finding ("the toxic neurons explain only a small share": ``Criterion(bound=True,
direction="less", threshold=0.25)``) is the mirror image: it holds when the whole interval lies on the
claimed side of the threshold, does not hold when the whole interval lies on the other side, and is
inconclusive when the interval straddles it. Controls of a bound finding enter as preconditions
(e.g. "top-N share beyond random-N sets").

The first edition (until 2026-12-07) called an effect "beyond" when it passed the interpolated 95th percentile of
10 control sets (a control could exceed it, and the rank p never went below 0.091), and read "holds" and "partly
holds" off the point estimate.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

from lib.stats import ControlComparison, Estimate, mde_from_interval, mde_from_width, min_controls

# Fewest matched control sets with which an effect can be "beyond" them at p <= 0.05 (the rank p-value cannot fall
# below 1 / (n + 1)); a comparison in a family needs more (lib.stats.min_controls of its alpha).
MIN_CONTROLS = min_controls(0.05)
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}


def _num(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)


@dataclass(frozen=True)
class Precondition:
    """A named condition the test needs (the model knows the facts, the direction is validated, the
    baseline shows the effect to be changed), with its measured value and threshold."""
    name: str
    value: Any
    op: str
    threshold: Any
    met: bool

    def fmt(self) -> str:
        return f"{self.name}: {_num(self.value)} {self.op} {_num(self.threshold)} ({'met' if self.met else 'NOT met'})"


def require(name: str, value: Any, op: str, threshold: Any) -> Precondition:
    """``require("relations the model knows", 6, ">=", 2)``; ``op`` in >=, >, <=, <, ==."""
    if op not in _OPS:
        raise ValueError(f"unknown comparison {op!r}: use one of {', '.join(_OPS)}")
    try:
        met = bool(_OPS[op](value, threshold))
    except TypeError as e:
        raise ValueError(f"precondition {name!r}: cannot compare {value!r} {op} {threshold!r}") from e
    return Precondition(name, value, op, threshold, met)


@dataclass(frozen=True)
class Criterion:
    """What counts, stated before any result.

    effect: what the estimate measures, in its units (e.g. "toxicity change, DPO - base").
    threshold: the smallest effect that counts as the finding, in the estimate's units and sign.
    paper_effect: the paper's effect in the same units (None where the paper gives no number).
    direction: "greater" when the paper's effect is a rise of the estimate, "less" for a fall.
    control: the matched control the effect must exceed ("" with ``needs_control=False`` when the
      paired comparison with the untreated model is itself the control, e.g. DPO vs its base model).
    setting: the one pre-specified setting the verdict uses, where the notebook sweeps several.
    bound: the finding is that the effect stays on the ``direction`` side of ``threshold`` (any sign).
    """
    finding: str
    paper: str
    effect: str
    threshold: float
    direction: str = "greater"
    paper_effect: float | None = None
    control: str = ""
    needs_control: bool = True
    setting: str = ""
    digits: int = 2
    notes: str = ""
    bound: bool = False

    def __post_init__(self):
        if self.direction not in ("greater", "less"):
            raise ValueError(f"direction must be 'greater' or 'less', got {self.direction!r}")
        if self.needs_control and not self.control:
            raise ValueError("a criterion that needs a control must name it (control=...)")
        s = 1 if self.direction == "greater" else -1
        if self.bound and self.needs_control:
            raise ValueError("a bound criterion takes its controls as preconditions: set needs_control=False")
        if not self.bound and s * self.threshold <= 0:
            raise ValueError(f"threshold {self.threshold} must lie on the {self.direction} side of zero")

    @property
    def sign(self) -> int:
        return 1 if self.direction == "greater" else -1

    def describe(self) -> str:
        word = "at least" if self.direction == "greater" else "at most"
        if self.bound:
            return "\n".join([f"Finding: {self.finding}", f"Paper: {self.paper}", f"Effect measured: {self.effect}",
                              f"Counts as the finding: the whole interval {word} "
                              f"{self.threshold:+.{self.digits}f}", *([f"Pre-specified setting: {self.setting}"] if self.setting else []),
                              *([f"Notes: {self.notes}"] if self.notes else [])])
        lines = [f"Finding: {self.finding}",
                 f"Paper: {self.paper}" + (f" (effect {self.paper_effect:+.{self.digits}f} in our units)"
                                          if self.paper_effect is not None else ""),
                 f"Effect measured: {self.effect}",
                 f"Counts as the finding: {word} {self.threshold:+.{self.digits}f}, interval excluding 0"
                 + (f", beyond {self.control}" if self.needs_control else f" (control: {self.control or 'paired baseline'})")]
        if self.setting:
            lines.append(f"Pre-specified setting: {self.setting}")
        if self.notes:
            lines.append(f"Notes: {self.notes}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str
    criterion: Criterion
    estimate: Estimate | None
    controls: ControlComparison | None = None
    preconditions: tuple[Precondition, ...] = field(default_factory=tuple)

    @property
    def n(self) -> int | None:
        return self.estimate.n if self.estimate is not None else None

    def ledger(self) -> dict:
        """The ledger's columns for this verdict."""
        d = self.criterion.digits
        return {
            "finding": self.criterion.finding,
            "paper": self.criterion.paper,
            "estimate": (f"{self.estimate.fmt(d)} ({self.criterion.effect})" if self.estimate is not None else "none"),
            "control": (self.controls.fmt(d) if self.controls is not None
                        else (f"none ({self.criterion.control})" if self.criterion.needs_control
                              else self.criterion.control or "paired baseline")),
            "preconditions": "; ".join(p.fmt() for p in self.preconditions) or "none stated",
            "n": self.n,
            "verdict": self.verdict,
            "reason": self.reason,
            "detectable": self.detectable(),
            "plot": self.plot(),
        }

    def detectable(self) -> str:
        """The smallest effect this measurement would find with 80% power, from its interval's width
        (:func:`lib.stats.mde_from_width`), 2 significant digits; "" without an interval."""
        p = self.plot()
        if p.get("low") is None or p.get("high") is None:
            return ""
        return f"{mde_from_width(float(p['high']) - float(p['low'])):.2g}"

    def plot(self) -> dict:
        """The numbers a forest plot of the ledger draws (None where absent): the estimate and its
        interval, the criterion's threshold, direction and the paper's effect (same units), and the
        control band's edge (the controls' 95th or 5th percentile, see lib.stats.against_controls)."""
        e, c, k = self.estimate, self.criterion, self.controls
        return {"value": None if e is None else e.value, "low": None if e is None else e.low,
                "high": None if e is None else e.high, "threshold": c.threshold, "direction": c.direction,
                "paper_effect": c.paper_effect, "control_edge": None if k is None else k.q}

    def __str__(self) -> str:
        return f"{self.verdict}: {self.reason}"


def decide(criterion: Criterion, estimate: Estimate | None, preconditions: Sequence[Precondition] = (),
           controls: ControlComparison | None = None) -> Verdict:
    """Apply the rule of this module's docstring."""
    pre = tuple(preconditions)
    c, d = criterion, criterion.digits

    def out(v: str, why: str) -> Verdict:
        return Verdict(v, why, c, estimate, controls, pre)

    if estimate is not None and estimate.interval != "uncertainty":
        raise ValueError(f"decide needs an uncertainty interval of the estimate, got a {estimate.interval} "
                         f"({estimate.method or 'no method named'}): a {estimate.interval} does not say how far the estimate may be off")
    if controls is not None and not controls.two_sided and controls.greater != (c.direction == "greater"):
        raise ValueError("the control comparison must be made in the criterion's direction")
    failed = [p for p in pre if not p.met]
    if failed:
        return out("inconclusive", "precondition not met: " + "; ".join(p.fmt() for p in failed))
    if estimate is None:
        return out("inconclusive", "no estimate with an uncertainty interval was measured")
    if estimate.width == 0:
        return out("inconclusive", f"zero spread over n = {estimate.n}: no interval, and zero spread is not significance")

    s = c.sign
    est = estimate.fmt(d)
    if c.bound:
        b = f"{c.threshold:+.{d}f}"
        lo_, hi_ = estimate.low, estimate.high
        inside = hi_ < c.threshold if c.direction == "less" else lo_ > c.threshold
        outside = lo_ > c.threshold if c.direction == "less" else hi_ < c.threshold
        side = "below" if c.direction == "less" else "above"
        if inside:
            return out("holds", f"{est} lies wholly {side} {b}")
        if outside:
            return out("does not hold", f"{est} lies wholly on the other side of {b}; preconditions met")
        return out("inconclusive", f"{est} straddles the bound {b}")

    lo, hi = sorted((s * estimate.low, s * estimate.high))
    beyond = controls is not None and controls.beyond_toward(s)
    thr = s * c.threshold
    paper = f"paper {c.paper_effect:+.{d}f}" if c.paper_effect is not None else "paper gives no number"
    if hi < thr:
        if lo > 0 and beyond:
            return out("partly holds", f"a real effect {est}, beyond {controls.fmt(d)}, shown to be smaller than the "
                       f"finding's threshold {c.threshold:+.{d}f} ({paper})")
        if lo > 0 and controls is None and not c.needs_control:
            return out("partly holds", f"a real effect {est} (against {c.control or 'the paired baseline'}), shown to be "
                       f"smaller than the finding's threshold {c.threshold:+.{d}f} ({paper})")
        return out("does not hold", f"{est} excludes an effect of {c.threshold:+.{d}f} ({paper}); preconditions met")
    if controls is not None and not controls.enough:
        return out("inconclusive", f"only {controls.n} matched control sets ({controls.name}): the rank test needs at "
                   f"least {min_controls(controls.alpha)} to reach p <= {controls.alpha:.2g} (rank p here "
                   f"{controls.pvalue:.2g}; estimate {est})")
    if lo <= 0:
        mde = mde_from_interval(estimate)
        return out("inconclusive", f"underpowered: {est} contains 0 and {c.threshold:+.{d}f} "
                   f"(detectable effect {mde:.{d}f}, {paper})")
    if controls is None and c.needs_control:
        return out("inconclusive", f"{est} excludes 0 but has no matched control ({c.control})")
    if controls is not None and not beyond:
        side = " on the finding's side of them" if controls.beyond else ""
        return out("inconclusive", f"{est} is not beyond {controls.fmt(d)}{side}")
    ctl = f", beyond {controls.fmt(d)}" if controls is not None else ""
    if lo >= thr:
        return out("holds", f"{est} lies wholly at or beyond {c.threshold:+.{d}f}{ctl}")
    return out("inconclusive", f"a real effect {est}{ctl}, but its size is not settled: the interval reaches past "
               f"the finding's threshold {c.threshold:+.{d}f} toward 0 ({paper})")
