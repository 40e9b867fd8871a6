"""Notebook 11 (relation-specific neurons): checks of its exercises and their reference solutions."""
import numpy as np

from lib.exercises import run_cases


def held_out_positives(pos: np.ndarray, row_prompt, on_test: set) -> np.ndarray:
    return np.array([i for i in pos if row_prompt[i] not in on_test], dtype=np.int64)


def check_held_out_positives(fn) -> None:
    prompts = ["The Louvre is in", "Where is the Louvre? In", "The Eiffel Tower is in", "Q: the Eiffel Tower? A:", "Rome is in"]
    run_cases(fn, held_out_positives, [((np.array([0, 1, 3, 4]), prompts, {prompts[0], prompts[2]}), {}),
                                       ((np.array([4, 2]), prompts, set()), {}),
                                       ((np.array([0, 2]), prompts, {prompts[0], prompts[2]}), {})])


def facts_lost_gained(correct_before: np.ndarray, correct_after: np.ndarray) -> tuple[int, int]:
    b, a = np.asarray(correct_before).astype(bool), np.asarray(correct_after).astype(bool)
    return int((b & ~a).sum()), int((~b & a).sum())


def check_facts_lost_gained(fn) -> None:
    rng = np.random.default_rng(0)
    run_cases(fn, facts_lost_gained, [((np.array([1, 1, 0, 0, 1]), np.array([0, 1, 1, 0, 0])), {}),
                                      ((rng.random(30) < 0.6, (rng.random(30) < 0.4).astype(int)), {}),
                                      ((np.ones(3), np.ones(3)), {})])


def uniform_sets(n_units: int, k: int, n_sets: int) -> list:
    return [np.sort(np.random.default_rng(s).choice(n_units, k, replace=False)) for s in range(n_sets)]


def check_uniform_sets(fn) -> None:
    run_cases(fn, uniform_sets, [((100, 7, 2), {}), ((10, 10, 1), {}), ((5000, 393, 3), {})])


def layer_bands(layers: np.ndarray, n_layers: int) -> dict:
    bands = [b for b in np.array_split(np.arange(n_layers), 3) if len(b)]
    return {f"layers {b[0]}-{b[-1]}": float(np.isin(layers, b).mean()) for b in bands}


def check_layer_bands(fn) -> None:
    rng = np.random.default_rng(1)
    run_cases(fn, layer_bands, [((rng.integers(0, 30, 50), 30), {}), ((rng.integers(0, 7, 9), 7), {}),
                                ((np.array([0, 1, 1]), 2), {})])
