"""Notebook 01 (the toxicity probe): checks of its exercises and their reference solutions."""
import numpy as np
import torch

from lib.papers import dpo
from lib.exercises import run_cases


def _toy(seed: int, n: int, d: int, shift: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of ``d`` features, labels 0/1, the toxic rows shifted along the first feature."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.4).astype(int)
    y[:2] = [0, 1]
    X = rng.normal(size=(n, d)) * rng.uniform(0.5, 3.0, size=d)
    X[:, 0] += shift * y
    return X, y


def balanced_accuracy_by_layer(train: dict, y_train: np.ndarray, test: dict, y_test: np.ndarray) -> dict:
    from sklearn.metrics import balanced_accuracy_score

    out = {}
    for L, X in train.items():
        clf = dpo.probe_classifier().fit(X.numpy(), y_train)
        out[L] = float(balanced_accuracy_score(y_test, clf.predict(test[L].numpy())))
    return out


def check_balanced_accuracy_by_layer(fn) -> None:
    cases = []
    for seed, layers in [(0, [0, 1, "final"]), (1, [3])]:
        X, y = _toy(seed, 60, 5, shift=2.0)
        X2, y2 = _toy(seed + 10, 40, 5, shift=2.0)
        train = {L: torch.tensor(X * (k + 1) + k, dtype=torch.float32) for k, L in enumerate(layers)}
        test = {L: torch.tensor(X2 * (k + 1) + k, dtype=torch.float32) for k, L in enumerate(layers)}
        cases.append(((train, y, test, y2), {}))
    run_cases(fn, balanced_accuracy_by_layer, cases)


def standardised_direction(X: np.ndarray, y: np.ndarray) -> torch.Tensor:
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(X)
    clf = dpo.probe_classifier().fit(scaler.transform(X), y)
    return torch.tensor(clf.coef_[0] / scaler.scale_, dtype=torch.float32)


def check_standardised_direction(fn) -> None:
    run_cases(fn, standardised_direction, [(_toy(0, 50, 4), {}), (_toy(1, 80, 7, shift=0.5), {})], rtol=1e-4, atol=1e-5)


def accuracy_table(y_true: np.ndarray, y_pred: np.ndarray) -> dict:
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    share_pos = float(np.mean(y_true == 1))
    recalls = [float(np.mean(y_pred[y_true == c] == c)) for c in (0, 1) if (y_true == c).any()]
    return {"accuracy": float(np.mean(y_true == y_pred)), "majority baseline": max(share_pos, 1 - share_pos),
            "balanced accuracy": float(np.mean(recalls))}


def check_accuracy_table(fn) -> None:
    rng = np.random.default_rng(2)
    y = (rng.random(50) < 0.1).astype(int)
    y[0] = 1
    cases = [((y, np.zeros(50, dtype=int)), {}),  # always the majority: accuracy = baseline, balanced 0.5
             ((y, (rng.random(50) < 0.3).astype(int)), {}),
             ((np.array([1, 1, 1, 0]), np.array([1, 0, 1, 0])), {})]
    run_cases(fn, accuracy_table, cases)
