"""Notebook 07 (attention entropy collapse): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd
import torch

from lib.exercises import generator, run_cases


def third_means(per_text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(per_text, dtype=float)
    k = max(1, x.shape[1] // 3)
    return x[:, :k].mean(axis=1), x[:, -k:].mean(axis=1)


def check_third_means(fn) -> None:
    rng = np.random.default_rng(0)
    run_cases(fn, third_means, [((rng.random((5, 9)),), {}), ((rng.random((3, 7)),), {}), ((rng.random((2, 2)),), {}),
                                ((rng.random((4, 1)),), {})])


def argmax_shares(pattern: torch.Tensor, mask: torch.Tensor) -> dict:
    m = mask.bool()
    first_key = m.int().argmax(1)
    top = pattern.argmax(-1)
    q = torch.arange(top.shape[1]).expand_as(top)
    real = m & (q > first_key[:, None] + 1)
    return {"argmax first": float((top == first_key[:, None])[real].double().mean()),
            "argmax previous": float((top == q - 1)[real].double().mean()),
            "argmax self": float((top == q)[real].double().mean())}


def _patterns(g: torch.Generator, b: int, n: int, pads: list[int], sink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention patterns [b, n, n] over left-padded rows, with extra mass ``sink`` on the first visible key."""
    mask = torch.ones(b, n, dtype=torch.long)
    scores = torch.randn(b, n, n, generator=g) * 2
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for r, p in enumerate(pads):
        mask[r, :p] = 0
        scores[r, :, p] += sink
    keep = causal & mask.bool()[:, None, :]
    return torch.softmax(scores.masked_fill(~keep, -1e9), -1), mask


def check_argmax_shares(fn) -> None:
    g = generator(1)
    run_cases(fn, argmax_shares, [(_patterns(g, 3, 8, [0, 2, 3], 0.0), {}), (_patterns(g, 2, 10, [0, 4], 3.0), {}),
                                  (_patterns(g, 4, 6, [0, 0, 1, 0], 1.0), {})])


def collapsed_fraction(per_head: dict, thresholds: list) -> pd.DataFrame:
    return pd.DataFrame({name: [float((torch.as_tensor(e) < t).double().mean()) for t in thresholds]
                         for name, e in per_head.items()}, index=pd.Index(thresholds, name="threshold"))


def check_collapsed_fraction(fn) -> None:
    g = generator(2)
    heads = {"decoder": torch.rand(6, 4, generator=g) ** 2, "encoder": torch.rand(3, 5, generator=g)}
    run_cases(fn, collapsed_fraction, [((heads, [0.05, 0.1, 0.2]), {}), ((heads, [0.5]), {}),
                                       (({"one": torch.rand(2, 2, generator=g)}, [0.9, 0.3]), {})])


def first_step(steps: list, curves: np.ndarray, level: float, inclusive: bool):
    mean = np.asarray(curves, dtype=float).mean(0)
    return next((s for s, m in zip(steps, mean) if (m <= level if inclusive else m < level)), None)


def check_first_step(fn) -> None:
    steps = [0, 50, 100, 150, 200]
    curves = np.array([[0.0, 0.1, -0.02, -0.05, -0.1], [0.0, 0.05, 0.0, -0.05, -0.2]])
    run_cases(fn, first_step, [((steps, curves, 0.0, False), {}), ((steps, curves, -0.05, True), {}),
                               ((steps, curves, -0.05, False), {}), ((steps, curves, -0.5, True), {}),
                               ((steps, curves, 0.0, True), {})])
