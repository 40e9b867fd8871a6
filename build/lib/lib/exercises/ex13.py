"""Notebook 13 (neuron versatility): checks of its exercises and their reference solutions."""
import numpy as np
from scipy.stats import binomtest

from lib.exercises import run_cases
from lib.exercises.ex11 import check_held_out_positives, held_out_positives  # noqa: F401 (the same exercise as 11's)


def n_shared(top_a, top_b) -> int:
    return len(np.intersect1d(top_a, top_b))


def check_n_shared(fn) -> None:
    rng = np.random.default_rng(0)
    run_cases(fn, n_shared, [((rng.choice(100, 20, replace=False), rng.choice(100, 20, replace=False)), {}),
                             ((np.array([3, 1, 2]), [2, 3, 3, 9]), {}), ((np.arange(5), np.arange(5, 9)), {})])


def overlap_over_null(observed: int, null) -> float:
    return observed / max(float(np.mean(null)), 1e-9)


def check_overlap_over_null(fn) -> None:
    run_cases(fn, overlap_over_null, [((58, [12, 15, 9, 11]), {}), ((3, np.array([0, 0, 0])), {}), ((0, [4.0]), {})])


def positives_lower_bound(correct: int, asked: int, n_questions: int) -> float:
    return float(binomtest(int(correct), int(asked)).proportion_ci().low) * n_questions


def check_positives_lower_bound(fn) -> None:
    run_cases(fn, positives_lower_bound, [((3, 5, 120), {}), ((0, 5, 80), {}), ((5, 5, 40), {}), ((np.int64(2), 10, 33), {})])
