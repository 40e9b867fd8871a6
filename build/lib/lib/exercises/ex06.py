"""Notebook 06 (activation editing): checks of its exercises and their reference solutions."""
import numpy as np
import pandas as pd
import torch

from lib.exercises import generator, run_cases


def kept_in_group(abs_cos: np.ndarray, beta: float, keep: str) -> np.ndarray:
    a = np.asarray(abs_cos, dtype=float)
    if keep not in ("highest", "lowest"):
        raise ValueError(f"keep is 'highest' or 'lowest', got {keep!r}")
    return np.argsort(-a if keep == "highest" else a, kind="stable")[:int(round(beta * len(a)))]


def check_kept_in_group(fn) -> None:
    rng = np.random.default_rng(0)
    a = rng.random(21)
    run_cases(fn, kept_in_group, [((a, 0.5, "highest"), {}), ((a, 0.5, "lowest"), {}), ((a, 0.2, "lowest"), {}),
                                  ((rng.random(4), 1.0, "highest"), {})])


def rows_of_groups(table: pd.DataFrame, groups: list) -> pd.DataFrame:
    return table[table["group"].isin(groups)][["layer", "neuron", "mode", "value"]].reset_index(drop=True)


def check_rows_of_groups(fn) -> None:
    rng = np.random.default_rng(1)
    n = 12
    table = pd.DataFrame({"layer": rng.integers(0, 3, n), "neuron": rng.integers(0, 50, n), "mode": "set",
                          "value": rng.normal(size=n), "group": rng.choice(["TP", "TN", "AP", "AN"], n),
                          "cos": rng.normal(size=n)}).sort_values(["layer", "neuron"]).reset_index(drop=True)
    run_cases(fn, rows_of_groups, [((table, ["TP", "AN"]), {}), ((table, ["AP", "TN"]), {}), ((table.iloc[::2], ["TN"]), {})])


def word_direction(W_U: torch.Tensor, words: list, minus: list) -> torch.Tensor:
    W = W_U.float()

    def mean_word(ids_per_word):
        return torch.stack([W[list(ids)].mean(0) for ids in ids_per_word]).mean(0)

    return mean_word(words) - mean_word(minus)


def check_word_direction(fn) -> None:
    g = generator(2)
    W = torch.randn(20, 6, generator=g)
    run_cases(fn, word_direction, [((W, [[1], [2, 3, 4]], [[5], [6]]), {}), ((W.half(), [[0, 19]], [[7], [8], [9, 10]]), {}),
                                   ((W, [[3], [3]], [[4]]), {})], rtol=1e-3, atol=1e-3)
