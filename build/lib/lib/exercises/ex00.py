"""Notebook 00 (the tour): checks of its exercises and their reference solutions."""
import numpy as np
import torch
from scipy import stats as scipy_stats

from lib.exercises import generator, run_cases


def top_pushes(act: torch.Tensor, vv: torch.Tensor, unit: torch.Tensor, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    push = act.float() * (vv.float() @ unit.float())
    return push, [divmod(int(f), push.shape[1]) for f in torch.topk(push.flatten(), n).indices]


def check_top_pushes(fn) -> None:
    g = generator(0)
    cases = []
    for n_layers, d_mlp, d_model, n in [(3, 5, 4, 2), (4, 7, 6, 5), (2, 3, 8, 1)]:
        unit = torch.randn(d_model, generator=g)
        cases.append(((torch.randn(n_layers, d_mlp, generator=g), torch.randn(n_layers, d_mlp, d_model, generator=g),
                       unit / unit.norm(), n), {}))
    run_cases(fn, top_pushes, cases)


def top_layers(push: torch.Tensor, k: int) -> list[int]:
    return sorted(int(f) // push.shape[1] for f in torch.topk(push.flatten(), k).indices)


def check_top_layers(fn) -> None:
    g = generator(1)
    run_cases(fn, top_layers, [((torch.randn(6, 9, generator=g), 7), {}), ((torch.randn(3, 4, generator=g), 1), {}),
                               ((torch.randn(5, 2, generator=g) ** 3, 10), {})])


def low_entropy_heads(ent: torch.Tensor, threshold: float) -> tuple[torch.Tensor, float]:
    counts = (ent < threshold).sum(1)
    if counts.unique().numel() < 2:
        return counts, float("nan")
    return counts, float(scipy_stats.spearmanr(np.arange(len(counts)), counts.numpy()).statistic)


def check_low_entropy_heads(fn) -> None:
    g = generator(2)
    depth = torch.linspace(1.0, 0.0, 8)[:, None]  # entropy falling with depth: the count grows
    cases = [((torch.rand(8, 6, generator=g) * 0.5 + 0.5 * depth, 0.3), {}),
             ((torch.rand(5, 4, generator=g), 0.5), {}),
             ((torch.ones(4, 3), 0.1), {})]  # no head below: every count 0, the correlation NaN
    run_cases(fn, low_entropy_heads, cases)
