"""The measurement records of paper A's steps (lib.infra.store): what the audit compares."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lib.infra import store

# What paper A measures, kept as committed records; the tolerances the audit allows when it recomputes one on
# another machine, each in units of the measurement's own uncertainty (lib.infra.store.half_width: the half-width of
# the normal 95% interval of a mean over prompts, texts or tweets).
# A recomputed mean may move by at most this fraction of its committed interval's half-width: greedy decoding on
# another CPU changes some continuations (a near-tied token flips), which moves a mean by a few prompts' worth; a
# move beyond the interval's own half-width is more than that noise.
AUDIT_FRACTION = 1.0


def _identical_share(a: Sequence[str], b: Sequence[str]) -> float:
    return float(np.mean([x == y for x, y in zip(a, b)])) if len(a) and len(a) == len(b) else 0.0


def _mean_check(name: str, committed: Sequence[float], fresh: Sequence[float]) -> "store.Check":
    hw = store.half_width(committed)
    return store.within(f"mean {name}", float(np.mean(committed)), float(np.mean(fresh)), AUDIT_FRACTION * hw,
                        f"{AUDIT_FRACTION:g} x the half-width {hw:.3g} of its 95% interval over {len(committed)} items")


def _compare_evaluation(c: dict, f: dict) -> list:
    """An evaluation: mean toxicity (and F1) within their interval's half-width; perplexity within 1% (a teacher-forced
    pass over fixed texts: only float noise moves it); the share of identical continuations, reported (the
    cross-CPU sensitivity of greedy decoding)."""
    checks = [_mean_check("toxicity", c["toxicities"], f["toxicities"])] if "toxicities" in c else \
        [store.within("toxicity", c["toxicity"], f["toxicity"], 0.01, "no per-prompt values kept: 0.01")]
    for k in ("perplexity", "perplexity_authors"):
        if k in c:
            checks.append(store.within(k, c[k], f[k], 0.01 * abs(c[k]), "1% of the committed value"))
    if "f1s" in c:
        checks.append(_mean_check("F1", c["f1s"], f["f1s"]))
    if "continuations" in c:
        checks.append(store.info("identical continuations (share)", 1.0,
                                 _identical_share(c["continuations"], f["continuations"]),
                                 "greedy decoding on this CPU against the committed one"))
    return checks


def _compare_probe(c: dict, f: dict) -> list:
    """The probe: held-out and Jigsaw accuracies within their binomial interval's half-width; the direction's cosine with
    the committed one, reported."""
    out = []
    n_val = max(1, round(c["n_train"] / 9))  # the 10% validation split beside n_train
    for k, n in (("val_accuracy", n_val), ("jigsaw_accuracy", len(c["test_labels"]) if c.get("test_labels") is not None else 0)):
        if n and np.isfinite(c[k]):
            hw = 1.96 * np.sqrt(max(c[k] * (1 - c[k]), 1e-4) / n)
            out.append(store.within(k, c[k], f[k], AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x the binomial 95% half-width "
                                    f"{hw:.3g} over {n} texts"))
    a, b = c["direction"].double(), f["direction"].double()
    out.append(store.info("cosine of the probe directions", 1.0, float(a @ b / (a.norm() * b.norm())), "reported"))
    return out


def _compare_pairs(c: dict, f: dict) -> list:
    """Preference pairs: the mean toxicity gap (rejected - chosen) within its interval's half-width; the share of identical
    chosen texts, reported."""
    gc = (c["pairs"].tox_rejected - c["pairs"].tox_chosen).to_numpy()
    gf = (f["pairs"].tox_rejected - f["pairs"].tox_chosen).to_numpy()
    return [_mean_check("toxicity gap of the pairs", gc, gf),
            store.info("pairs kept", len(gc), len(gf), "reported"),
            store.info("identical chosen continuations (share)", 1.0,
                       _identical_share(c["pairs"].chosen.tolist(), f["pairs"].chosen.tolist()), "reported")]


def _compare_gate(c: dict, f: dict) -> list:
    """The direction gate: each candidate's steering effect within its interval's half-width, and the same
    candidates validated."""
    tc, tf = c["table"], f["table"]
    out = []
    for d in tc.index:
        hw = float(tc.loc[d, "steer_high"] - tc.loc[d, "steer_low"]) / 2
        out.append(store.within(f"steering effect of {d!r}", tc.loc[d, "steer_effect"], tf.loc[d, "steer_effect"],
                                AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x its interval's half-width {hw:.3g}"))
    same = list(tc.index[tc.validated]) == list(tf.index[tf.validated])
    out.append(store.Check("same candidates validated", 1.0, float(same), "must be the same", same))
    return out


store.step("probe", 1, "paper A's toxicity probe: weights, accuracies, steering vector, features it was fit on",
           _compare_probe)
store.step("preference-pairs", 1, "paper A's preference pairs: prompts, greedy and steered continuations, scores",
           _compare_pairs)
store.step("direction-gate", 1, "paper A's direction gate: steering and promoted-token tests of each candidate",
           _compare_gate)
store.step("toxicity-perplexity-f1", 1, "one model's toxicity, perplexity and F1 (Lee et al. 2024), per item",
           _compare_evaluation)
store.step("evaluation", 1, "one model under one intervention: toxicity per prompt with its continuations, "
           "perplexity, F1", _compare_evaluation)
# A DPO run trained again on another CPU follows another float path: its loss over the last quarter of the steps
# may differ by this fraction of the committed one, and so may the mean relative change of W_out.
DPO_TOLERANCE = 0.05


def _compare_dpo_run(c: dict, f: dict) -> list:
    """A DPO run: the mean loss over the last quarter of its steps and the mean relative change of W_out within
    DPO_TOLERANCE of the committed ones; the number of weight tensors changed, reported."""
    q = max(1, len(c["log"]) // 4)
    lc, lf = float(c["log"].loss.iloc[-q:].mean()), float(f["log"].loss.iloc[-q:].mean())
    wc, wf = float(np.mean(c["w_out_change"])), float(np.mean(f["w_out_change"]))
    return [store.within(f"mean loss over the last {q} steps", lc, lf, DPO_TOLERANCE * abs(lc),
                         f"{DPO_TOLERANCE:.0%} of the committed value"),
            store.within("mean relative change of W_out", wc, wf, DPO_TOLERANCE * abs(wc),
                         f"{DPO_TOLERANCE:.0%} of the committed value"),
            store.info("weight tensors changed", c["changed_tensors"], f["changed_tensors"], "reported")]


store.step("dpo-run", 1, "paper A: one DPO run: its training log and how much each layer's W_out moved (the "
           "weights stay in the cache)", _compare_dpo_run)
