"""Notebook 04 (four neuron groups): checks of its exercises and their reference solutions."""
import numpy as np
import torch
from scipy import stats as sps

from lib.exercises import generator, run_cases


def four_shares(delta: torch.Tensor, cos: torch.Tensor, m_base: torch.Tensor) -> np.ndarray:
    d = delta.double().clamp_min(0)
    total = float(d.sum())
    if total <= 0:
        return np.full(4, np.nan)
    signs = [(1, 1), (1, -1), (-1, 1), (-1, -1)]  # TP, TN, AP, AN
    return np.array([float(d[(c * cos > 0) & (m * m_base > 0)].sum()) / total for c, m in signs])


def check_four_shares(fn) -> None:
    g = generator(0)
    cases = [((torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)), {})
             for _ in range(3)]
    cases.append(((-torch.rand(2, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)), {}))
    run_cases(fn, four_shares, cases)


def positive_delta_ratio(mb, md, ub, ud, reference) -> float:
    d = mb * ub - md * ud
    return float(d.clamp_min(0).sum() / reference.clamp_min(0).sum())


def check_positive_delta_ratio(fn) -> None:
    g = generator(1)
    run_cases(fn, positive_delta_ratio, [(tuple(torch.randn(2, 6, generator=g) for _ in range(5)), {}) for _ in range(3)])


def alignment_of_changes(delta: np.ndarray, cos: np.ndarray, top_frac: float) -> tuple[float, float]:
    a, c = np.abs(np.asarray(delta, dtype=float)), np.abs(np.asarray(cos, dtype=float))
    n_top = max(1, int(len(a) * top_frac))
    top_a, top_c = set(np.argsort(-a, kind="stable")[:n_top]), set(np.argsort(-c, kind="stable")[:n_top])
    return float(sps.spearmanr(a, c).statistic), len(top_a & top_c) / n_top


def check_alignment_of_changes(fn) -> None:
    rng = np.random.default_rng(2)
    c = rng.normal(size=300)
    run_cases(fn, alignment_of_changes, [((c * rng.normal(1, 0.3, 300), c, 0.05), {}), ((rng.normal(size=50), rng.normal(size=50), 0.01), {}),
                                         ((rng.normal(size=40), rng.normal(size=40), 0.25), {})])
