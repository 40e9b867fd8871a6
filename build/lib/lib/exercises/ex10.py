"""Notebook 10 (SAOBP's small-scale gains): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd

from lib import stats
from lib.exercises import run_cases


def minus_smallest(gains: pd.DataFrame) -> pd.DataFrame:
    rows = {}
    for s in gains.columns:
        d = stats.across_seeds((gains[s] - gains[gains.columns[0]]).to_numpy(), seed=0).estimate
        rows[s] = {"minus smallest": d.value, "minus smallest low": d.low, "minus smallest high": d.high}
    out = pd.DataFrame(rows).T
    out.index.name = "size"
    return out


def check_minus_smallest(fn) -> None:
    rng = np.random.default_rng(0)
    gains = pd.DataFrame(rng.normal(1, 3, (10, 3)), columns=["mini", "wide", "deep"], index=pd.Index(range(10), name="seed"))
    run_cases(fn, minus_smallest, [((gains,), {}), ((gains[["deep", "mini"]].iloc[:4],), {})])


def quarter_losses(losses) -> list:
    return [float(np.mean(q)) for q in np.array_split(np.asarray(losses, dtype=float), 4)]


def check_quarter_losses(fn) -> None:
    rng = np.random.default_rng(1)
    run_cases(fn, quarter_losses, [((rng.random(400),), {}), ((rng.random(10).tolist(),), {}), ((np.arange(7.0),), {})])


def perplexity_gain(baseline_ppl, treated_ppl) -> np.ndarray:
    b, t = np.asarray(baseline_ppl, dtype=float), np.asarray(treated_ppl, dtype=float)
    return 100 * (b - t) / b


def check_perplexity_gain(fn) -> None:
    run_cases(fn, perplexity_gain, [(([100.0, 80.0, 50.0], [90.0, 84.0, 50.0]), {}), ((np.array([12.5]), np.array([10])), {})])


def deep_difference(baseline: np.ndarray, saobp_: np.ndarray, last_third: list) -> np.ndarray:
    cols = list(last_third)
    return np.asarray(saobp_, dtype=float)[..., cols].mean(-1) - np.asarray(baseline, dtype=float)[..., cols].mean(-1)


def check_deep_difference(fn) -> None:
    rng = np.random.default_rng(2)
    run_cases(fn, deep_difference, [((rng.random((4, 5, 8)), rng.random((4, 5, 8)), [6, 7]), {}),
                                    ((rng.random((2, 3, 3)), rng.random((2, 3, 3)), [2]), {})])
