"""Notebook 05 (group patching replicates DPO): checks of its exercises and their reference solutions."""
import numpy as np

from lib.exercises import run_cases


def n_identical(a: list, b: list) -> int:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} continuations")
    return sum(x == y for x, y in zip(a, b))


def check_n_identical(fn) -> None:
    run_cases(fn, n_identical, [((["a", "b", "c"], ["a", "x", "c"]), {}), ((["a"], ["b"]), {}),
                                (([" the", "", "x y"], [" the", "", "x y"]), {})])


def top_decile(delta: np.ndarray) -> np.ndarray:
    d = np.asarray(delta)
    k = int(round(0.1 * int((d > 0).sum())))
    return np.stack(np.unravel_index(np.argsort(-d, axis=None, kind="stable")[:k], d.shape), 1)


def check_top_decile(fn) -> None:
    rng = np.random.default_rng(0)
    run_cases(fn, top_decile, [((rng.normal(size=(4, 30)),), {}), ((rng.normal(size=(3, 50)) - 1.0,), {}),
                               ((rng.normal(size=(2, 200)).astype(np.float32),), {})])


def share_undone(tox_patched, tox_base: float, tox_dpo: float) -> float:
    return (float(np.mean(tox_patched)) - tox_dpo) / (tox_base - tox_dpo)


def check_share_undone(fn) -> None:
    run_cases(fn, share_undone, [(([0.1, 0.3, 0.2], 0.29, 0.16), {}), (([0.29, 0.29], 0.29, 0.16), {}),
                                 ((np.array([0.05, 0.1]), 0.3, 0.2), {})])
