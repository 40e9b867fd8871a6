"""Notebook 03 (toxic neurons explain little): checks of its exercises and their reference solutions."""
import numpy as np
import torch

from lib.exercises import generator, run_cases


def top_neurons(score: torch.Tensor, n: int) -> list[tuple[int, int]]:
    flat = torch.argsort(score.flatten(), descending=True)[:n]
    return [(int(f) // score.shape[1], int(f) % score.shape[1]) for f in flat]


def check_top_neurons(fn) -> None:
    g = generator(0)
    run_cases(fn, top_neurons, [((torch.randn(4, 6, generator=g), 5), {}), ((torch.randn(2, 9, generator=g).abs(), 1), {}),
                                ((torch.randn(3, 3, generator=g), 9), {})])


def first_reaching(share_by_n: dict, level: float):
    return next((N for N in sorted(share_by_n) if share_by_n[N] >= level), None)


def check_first_reaching(fn) -> None:
    run_cases(fn, first_reaching, [(({128: 0.2, 512: 0.6, 2048: 0.4, 8192: 0.9}, 0.5), {}),
                                   (({8192: 0.9, 128: 0.1, 512: 0.55}, 0.5), {}),  # keys out of order
                                   (({128: 0.1, 512: float("nan")}, 0.5), {}),
                                   (({128: 0.5}, 0.5), {})])


def control_band(effect: float, controls) -> tuple[float, float]:
    c = np.asarray(controls, dtype=float)
    return float(np.quantile(c, 0.95)), (1 + int((c >= effect).sum())) / (c.size + 1)


def check_control_band(fn) -> None:
    rng = np.random.default_rng(0)
    c = rng.random(20)
    run_cases(fn, control_band, [((0.9, c), {}), ((float(c[3]), c.tolist()), {}), ((2.0, rng.random(7)), {}),
                                 ((-1.0, c), {})])
