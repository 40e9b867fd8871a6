"""Notebook 14 (neuron interference): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd

from lib import stats
from lib.exercises import run_cases


def near_miss_shares(per_fact: pd.DataFrame, n_top: int) -> tuple[float, float]:
    risers = per_fact.sort_values(["lp change", "item"], ascending=[False, True], kind="stable").head(n_top)
    return float(risers["baseline rank"].between(1, 2).mean()), float(per_fact["baseline rank"].between(1, 2).mean())


def check_near_miss_shares(fn) -> None:
    rng = np.random.default_rng(0)
    n = 30
    facts = pd.DataFrame({"item": [f"f{i:02d}" for i in range(n)], "baseline rank": rng.integers(0, 6, n),
                          "rank off": rng.integers(0, 6, n), "lp change": rng.normal(size=n).round(1)})  # ties in lp change
    run_cases(fn, near_miss_shares, [((facts, 10), {}), ((facts.sample(frac=1, random_state=1), 5), {}), ((facts.iloc[:4], 10), {})])


def count_rises(p: np.ndarray, change: np.ndarray, alpha: float, method: str) -> int:
    corrected = np.asarray(stats.correct(np.asarray(p, dtype=float), method)[1])
    return int(((corrected <= alpha) & (np.asarray(change) > 0)).sum())


def check_count_rises(fn) -> None:
    rng = np.random.default_rng(1)
    p = np.r_[rng.uniform(0, 0.01, 5), rng.uniform(0, 1, 15)]
    change = rng.normal(size=20)
    change[:3] = np.abs(change[:3])
    run_cases(fn, count_rises, [((p, change, 0.05, "holm"), {}), ((p, change, 0.05, "fdr_bh"), {}),
                                ((p.tolist(), change.tolist(), 0.2, "fdr_bh"), {})])


def beyond_random(top: int, randoms: list) -> tuple[bool, float]:
    return all(top > x for x in randoms), (1 + sum(x >= top for x in randoms)) / (len(randoms) + 1)


def check_beyond_random(fn) -> None:
    run_cases(fn, beyond_random, [((4, [0, 1, 3, 2]), {}), ((3, [0, 3, 5, 1, 1]), {}), ((0, [0, 0]), {}), ((2, []), {}), ((np.int64(5), np.array([1, 6])), {})])
