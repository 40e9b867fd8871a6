"""Notebook 08 (SAOBP refinement): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd
import torch

from lib.exercises import generator, run_cases


def deep_mean(per_text: np.ndarray, deep: list) -> np.ndarray:
    return np.asarray(per_text, dtype=float)[:, list(deep)].mean(axis=1)


def check_deep_mean(fn) -> None:
    rng = np.random.default_rng(0)
    run_cases(fn, deep_mean, [((rng.random((5, 12)), [8, 9, 10, 11]), {}), ((rng.random((3, 4)).astype(np.float32), [3]), {}),
                              ((rng.random((2, 6)), range(2, 6)), {})])


def attractive_heads(J: torch.Tensor) -> tuple[torch.Tensor, int]:
    per_layer = (J > 0).sum(axis=1)
    return per_layer, int(per_layer.sum())


def check_attractive_heads(fn) -> None:
    g = generator(1)
    run_cases(fn, attractive_heads, [((torch.randn(4, 6, generator=g),), {}), ((-torch.rand(3, 2, generator=g),), {}),
                                     ((torch.tensor([[0.0, 0.1], [0.0, -0.1]]),), {})])


def gap_table(baseline: list, saobp_: list, deep: list) -> pd.DataFrame:
    table = pd.DataFrame({name: {c["step"]: float(np.mean(np.asarray(c["entropy_norm"])[list(deep)])) for c in curve}
                          for name, curve in (("baseline", baseline), ("SAOBP", saobp_))})
    table.index.name = "step"
    table["gap"] = table["SAOBP"] - table["baseline"]
    return table


def check_gap_table(fn) -> None:
    rng = np.random.default_rng(2)

    def curve(steps, n_layers):
        return [{"step": s, "entropy_norm": rng.random(n_layers).tolist()} for s in steps]

    run_cases(fn, gap_table, [((curve([0, 12, 24, 36], 6), curve([0, 12, 24, 36], 6), [4, 5]), {}),
                              ((curve([0, 5], 3), curve([0, 5], 3), [0, 1, 2]), {})])
