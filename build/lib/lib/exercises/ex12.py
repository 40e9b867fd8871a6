"""Notebook 12 (neuron cumulativity): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd

from lib import stats
from lib.exercises import run_cases


def _runs(seed: int, n_items: int = 5) -> pd.DataFrame:
    """A frame of runs as the notebook's ``measured`` builds them: facts at two ks, top and random sets, r and others."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in (10, 20):
        for condition, n_sets in (("top", 1), ("random", 2)):
            for s in range(n_sets):
                for tested in ("r", "others"):
                    for item in rng.permutation(n_items):
                        base_lp = -rng.random() * 3
                        rows.append({"k": k, "condition": condition, "set": s, "tested": tested, "item": f"f{item}",
                                     "correct": bool(rng.random() < 0.5), "logprob": base_lp - rng.random() * 2,
                                     "base_correct": bool(rng.random() < 0.7), "base_logprob": base_lp})
    return pd.DataFrame(rows)


def gap_closes_at(gaps: dict):
    return next((k for k in sorted(gaps) if gaps[k].low <= 0), None)


def check_gap_closes_at(fn) -> None:
    def e(low):
        return stats.Estimate(low + 0.1, low, low + 0.2, 50)

    run_cases(fn, gap_closes_at, [(({30: e(0.5), 76: e(0.2), 152: e(-0.1), 304: e(-0.3)},), {}),
                                  (({304: e(-0.2), 30: e(0.4), 152: e(0.0)},), {}),  # keys out of order; low == 0 reaches it
                                  (({30: e(0.5), 76: e(0.1)},), {})])


def mean_fall(runs: pd.DataFrame, k: int) -> float:
    per_fact = runs[runs.k == k].groupby("item")[["logprob", "base_logprob"]].mean()
    return float((per_fact.base_logprob - per_fact.logprob).mean())


def check_mean_fall(fn) -> None:
    df = _runs(1)
    run_cases(fn, mean_fall, [((df[df.condition == "random"], 10), {}), ((df[df.tested == "r"], 20), {})])


def top_outside_site(attr: np.ndarray, site_of: np.ndarray, site: int, n: int) -> np.ndarray:
    a = np.where(np.asarray(site_of) != site, np.asarray(attr, dtype=float), -np.inf)
    return np.argsort(-a, kind="stable")[:n]


def check_top_outside_site(fn) -> None:
    rng = np.random.default_rng(2)
    attr, site_of = rng.normal(size=40), rng.integers(0, 3, 40)
    run_cases(fn, top_outside_site, [((attr, site_of, 2, 3), {}), ((attr, site_of, 0, 5), {}),
                                     ((attr.astype(np.float32), np.zeros(40, dtype=int), 1, 1), {})])


def units_at_ranks(attr: np.ndarray, ranks: list) -> list:
    order = np.argsort(-np.asarray(attr, dtype=float), kind="stable")
    return [int(order[rk]) for rk in ranks]


def check_units_at_ranks(fn) -> None:
    rng = np.random.default_rng(3)
    run_cases(fn, units_at_ranks, [((rng.normal(size=50), [0, 10, 49]), {}), ((rng.normal(size=400), [300, 10]), {}),
                                   ((np.array([1.0, 3.0, 3.0, 0.5]), [0, 1, 2, 3]), {})])
