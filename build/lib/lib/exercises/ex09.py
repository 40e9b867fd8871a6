"""Notebook 09 (global token dependency): checks of its exercises and their reference solutions."""
import numpy as np
import torch
from scipy.stats import spearmanr

from lib.exercises import generator, run_cases


def top_heads(g: np.ndarray, others: dict, k: int) -> tuple[list, dict]:
    g = np.asarray(g)
    order = np.argsort(-g, axis=None, kind="stable")[:k]
    heads = [tuple(int(i) for i in np.unravel_index(j, g.shape)) for j in order]
    return heads, {t: float(spearmanr(np.asarray(o).ravel(), g.ravel()).statistic) for t, o in others.items()}


def check_top_heads(fn) -> None:
    rng = np.random.default_rng(0)
    g = rng.random((4, 6))
    others = {"SST-2": g + rng.normal(0, 0.1, g.shape), "RTE": rng.random((4, 6))}
    run_cases(fn, top_heads, [((g, others, 5), {}), ((rng.random((2, 3)), {"x": rng.random((2, 3))}, 1), {})])


def exceeded(value: float, others: dict) -> list:
    return [name for name, v in sorted(others.items(), key=lambda kv: kv[1]) if v < value]


def check_exceeded(fn) -> None:
    others = {"SST-2": 0.3, "RTE": 0.05, "MRPC": 0.2, "CoLA": 0.6}
    run_cases(fn, exceeded, [((0.52, others), {}), ((0.01, others), {}), ((1.0, others), {}), ((0.2, others), {})])


def gtd_hops(A: torch.Tensor, hops: int) -> torch.Tensor:
    P = A.float()
    An = P
    for _ in range(hops - 1):
        An = An @ P
    return (An - P).clamp_min(0).sum(-1).mean(-1)


def check_gtd_hops(fn) -> None:
    g = generator(1)
    A = torch.softmax(torch.randn(2, 3, 5, 5, generator=g) * 2, -1)
    run_cases(fn, gtd_hops, [((A, 2), {}), ((A, 3), {}), ((A.double(), 1), {}),
                             ((torch.softmax(torch.randn(1, 2, 4, 4, generator=g), -1), 4), {})])
