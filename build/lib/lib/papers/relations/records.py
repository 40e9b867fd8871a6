"""The measurement records of paper C's steps (lib.infra.store): what the audit compares."""
from __future__ import annotations

from __future__ import annotations


import numpy as np

from lib.infra import store
from lib.papers.relations.study import top_of

# ----------------------------------------------------------------------------- records (lib.infra.store)
# What paper C measures, kept as committed records, and what the audit allows when it measures one again on
# another machine. A recomputed accuracy or mean log-probability may move by at most AUDIT_FRACTION of the
# committed value's 95% half-width: greedy answers on another CPU flip where two tokens nearly tie, which moves
# a mean by a few facts' worth, less than its own interval.
AUDIT_FRACTION = 1.0
# A top set measured again must share at least this share of its units with the committed one: AvgPrec over a
# few hundred prompts takes few distinct values, so units near the k-th tie on AvgPrec and are ordered by the
# tie-break, a float quantity that float noise in the responses reorders.
TOP_SHARED = 0.9
# Scores measured again (attributions, AvgPrec by tokens) must correlate with the committed ones at least this much.
MIN_R = 0.99


def _binomial_check(name: str, committed, fresh) -> "store.Check":
    c, f = np.asarray(committed, dtype=float), np.asarray(fresh, dtype=float)
    p, n = float(c.mean()) if c.size else float("nan"), c.size
    hw = 1.96 * np.sqrt(max(p * (1 - p), 1e-4) / max(n, 1))
    return store.within(name, p, float(f.mean()) if f.size else float("nan"), AUDIT_FRACTION * hw,
                        f"{AUDIT_FRACTION:g} x the binomial 95% half-width {hw:.3g} over {n} prompts")


def _shared_share(a, b) -> float:
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    return len(np.intersect1d(a, b)) / max(1, len(a))


def _compare_answers(c: dict, f: dict) -> list:
    """Answers: accuracy within its binomial half-width, mean gold log-probability within its half-width;
    the share of identical continuations, reported (the cross-CPU sensitivity of greedy decoding)."""
    out = [_binomial_check("accuracy", c["correct"], f["correct"])]
    if len(c["logprob"]) > 1:
        hw = store.half_width(c["logprob"])
        out.append(store.within("mean gold log-probability", float(np.mean(c["logprob"])), float(np.mean(f["logprob"])),
                                AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x the half-width {hw:.3g} of its 95% interval "
                                f"over {len(c['logprob'])} prompts"))
    same = float(np.mean([x == y for x, y in zip(c["continuation"], f["continuation"])])) if len(c["continuation"]) else 1.0
    out.append(store.info("identical continuations (share)", 1.0, same, "greedy decoding on this CPU against the committed one"))
    return out


def _compare_study(c: dict, f: dict) -> list:
    """A study: the same relations selected; identification accuracy within its binomial half-width; each
    relation's top-k sharing at least TOP_SHARED of its units with the committed one."""
    same = list(c["chosen"]) == list(f["chosen"])
    out = [store.Check("same relations selected", 1.0, float(same), "must be the same", same),
           _binomial_check("identification accuracy", c["correct"], f["correct"])]
    if same:
        for j, name in enumerate(c["chosen"]):
            share = _shared_share(top_of(c["ap"][j], c["tiebreak"][j], c["k"]), top_of(f["ap"][j], f["tiebreak"][j], f["k"]))
            out.append(store.at_least(f"top-{c['k']} of {name} shared (share)", share, TOP_SHARED,
                                      "near-ties at the k-th unit may swap"))
    return out


def _compare_ranking(c, f) -> list:
    """Rankings: the top-depth sets share at least TOP_SHARED of their units, on average over the tasks."""
    share = float(np.mean([_shared_share(a, b) for a, b in zip(c, f)]))
    return [store.at_least(f"top-{np.shape(c)[1]} shared, mean over {len(c)} tasks (share)", share, TOP_SHARED,
                           "near-ties at the last unit may swap")]


def _r_check(name: str, a, b) -> "store.Check":
    x, y = np.asarray(a, dtype=float).reshape(-1), np.asarray(b, dtype=float).reshape(-1)
    r = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float(np.array_equal(x, y))
    return store.at_least(f"correlation of {name}", r, MIN_R, "per-unit scores recomputed on this machine")


store.step("relation-answers", 1, "paper C: greedy answers to fact prompts, with or without units off: each prompt's "
           "continuation, right or wrong, the gold's rank and log-probability", _compare_answers)
store.step("relation-study", 1, "paper C's identification pass: answers to every identification prompt, the "
           "relations selected, their positive and negative rows, every unit's AvgPrec and tie-break", _compare_study)
store.step("relation-ranking", 1, "paper C: the best units of (positives, negatives) scoring tasks, in order",
           _compare_ranking)
store.step("relation-attribution", 1, "paper C: first-order attribution of each unit on a relation's positives",
           lambda c, f: [_r_check("attributions", c, f)])
store.step("relation-token-ap", 1, "paper C: every unit's AvgPrec with the responses pooled over part of the tokens",
           lambda c, f: [_r_check(f"AvgPrec ({part})", c[part][0], f[part][0]) for part in c])
