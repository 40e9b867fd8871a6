"""Paper A's linear toxicity probe: logistic regression on the pooled final residual stream."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import data, hooks
from lib.infra import cache, store
from lib.models import Loaded
from lib.papers.dpo.sizes import Sizes

# The paper's toxic-token direction: mean unembedding of these words minus that of the neutral ones
# (hooks.token_direction). Notebook 01 reads it, 04's solutions reuse it, and 06's parameters default to it.
TOXIC_WORDS = ("fuck", "shit", "crap", "damn", "asshole")
NONTOXIC_WORDS = ("hello", "thanks", "friend", "peace", "welcome")
PROBE_FEATURE_LAYER = "final"  # the residual stream after the final norm (lib.hooks.residual_point)


@dataclass
class Probe:
    direction: torch.Tensor  # [d_model] float32 cpu: LogisticRegression coef_ (bias dropped)
    bias: float
    val_accuracy: float  # held-out split of the training texts (Davidson tweets)
    jigsaw_accuracy: float  # the small Jigsaw sample (nan when not measured)
    n_train: int
    jigsaw_balanced_accuracy: float = float("nan")  # mean of the per-class recalls (Jigsaw is ~90% non-toxic)
    jigsaw_majority: float = float("nan")  # accuracy of always answering the majority class
    steer_layer: int = -1  # block after which the steering vector is added (-1: none measured)
    steer_direction: torch.Tensor | None = None  # [d_model] mean toxic - mean non-toxic state after steer_layer
    # The probe's data, for intervals and permuted-label controls (notebook 01); None when not kept
    train_features: torch.Tensor | None = None  # [n_train, d_model] features of the training split
    train_labels: torch.Tensor | None = None  # [n_train] 0/1
    test_features: torch.Tensor | None = None  # [n_test, d_model] features of the test set (the Jigsaw sample)
    test_labels: torch.Tensor | None = None  # [n_test] 0/1
    test_predicted: torch.Tensor | None = None  # [n_test] 0/1, the probe's predictions on the test set
    record: str = ""  # the key of its record in the measurement store ("" when not read from one)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Decision function on pooled features [n, d_model] -> [n] (> 0 means toxic)."""
        return features.float().cpu() @ self.direction + self.bias

    @property
    def unit(self) -> torch.Tensor:
        return self.direction / self.direction.norm()


def steer_layer(lm: Loaded, depth: float = Sizes.steer_depth) -> int:
    """The block after which the steer is added: round(depth * n_layers), within 0..n_layers-1."""
    if not 0 <= depth <= 1:
        raise ValueError(f"steer_depth must lie in [0, 1], got {depth!r}")
    return min(max(round(depth * lm.info.n_layers), 0), lm.info.n_layers - 1)


def features(lm: Loaded, texts: Sequence[str], max_length: int = 64, batch_size: int = 32,
             progress: bool = True) -> torch.Tensor:
    """[n, d_model] the probe's features: last hidden state after the final norm, mean-pooled."""
    return hooks.residual_means(lm, texts, PROBE_FEATURE_LAYER, batch_size, max_length, progress)


def probe_states(lm: Loaded, texts: Sequence[str], layers: Sequence[int | str], max_length: int = 64,
                 batch_size: int = 32, progress: bool = True) -> dict[int | str, torch.Tensor]:
    """{layer: [n, d_model]} :func:`lib.hooks.pooled_residuals` of ``texts`` at ``layers`` (block indices
    0..n_layers-1 and 'final'), all read from one forward pass that keeps every block's output and
    'final', cached by the texts' content: the probe reads two layers of it, notebook 01's exercise on
    other layers the rest, without a second pass."""
    every = [*range(lm.info.n_layers), PROBE_FEATURE_LAYER]
    bad = [L for L in layers if L not in every]
    if bad:
        raise ValueError(f"layers must be block indices 0..{lm.info.n_layers - 1} or {PROBE_FEATURE_LAYER!r}, got {bad}")
    texts = list(texts)
    params = {"texts": cache.content_hash(texts), "max_length": max_length, "batch_size": batch_size}
    states = cache.get_or_build("pooled-states", lm.name, params, lambda: hooks.pooled_residuals(
        lm, texts, every, batch_size, max_length, progress, desc="probe states"))
    return {L: states[L] for L in layers}


def probe_classifier():
    """The probe's estimator: scikit-learn's LogisticRegression with its defaults (more iterations,
    so that lbfgs converges). Refit it on permuted labels for a matched control."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(max_iter=5000)


def fit_probe(lm: Loaded, texts: Sequence[str], labels: Sequence[int], val_fraction: float = 0.1,
              test_texts: Sequence[str] | None = None, test_labels: Sequence[int] | None = None,
              seed: int = 0, max_length: int = 64, batch_size: int = 32, progress: bool = True,
              steer_depth: float | None = None) -> Probe:
    """Logistic regression (scikit-learn defaults, more iterations so lbfgs converges) on
    :func:`features` of ``texts``; accuracy on a stratified ``val_fraction`` split and on the
    optional test set (``jigsaw_accuracy``). With ``steer_depth``, the same forward pass also
    gives the steering vector: the training split's mean toxic minus mean non-toxic state after
    block :func:`steer_layer` (the probe's class-mean difference at that depth). The probe keeps
    the training split's features and labels and the test set's features, labels and predictions,
    so that its accuracy can be bootstrapped and compared with probes refit on permuted labels."""
    from sklearn.model_selection import train_test_split

    y = np.asarray(labels).astype(int)
    if len(texts) != len(y):
        raise ValueError(f"{len(texts)} texts but {len(y)} labels")
    if set(np.unique(y)) != {0, 1}:
        raise ValueError("labels must contain both classes 0 and 1")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    L_steer = steer_layer(lm, steer_depth) if steer_depth is not None else None
    layers = (PROBE_FEATURE_LAYER,) if L_steer is None else (PROBE_FEATURE_LAYER, L_steer)
    states = probe_states(lm, texts, layers, max_length, batch_size, progress)
    X = states[PROBE_FEATURE_LAYER].numpy()
    idx_tr, idx_va = train_test_split(np.arange(len(y)), test_size=val_fraction, random_state=seed, stratify=y)
    clf = probe_classifier().fit(X[idx_tr], y[idx_tr])
    steer = None
    if L_steer is not None:
        S, ytr = states[L_steer][torch.tensor(idx_tr)], torch.tensor(y[idx_tr])  # output of block L_steer
        steer = S[ytr == 1].mean(0) - S[ytr == 0].mean(0)
    test_acc = test_bal = test_major = float("nan")
    Xte = yte = pred = None
    if test_texts is not None:
        from sklearn.metrics import balanced_accuracy_score

        Xte = probe_states(lm, test_texts, (PROBE_FEATURE_LAYER,), max_length, batch_size, progress)[PROBE_FEATURE_LAYER].numpy()
        yte = np.asarray(test_labels).astype(int)
        pred = clf.predict(Xte)
        test_acc = float(clf.score(Xte, yte))
        test_bal = float(balanced_accuracy_score(yte, pred))
        test_major = float(max(yte.mean(), 1 - yte.mean()))
    return Probe(torch.tensor(clf.coef_[0], dtype=torch.float32), float(clf.intercept_[0]),
                 float(clf.score(X[idx_va], y[idx_va])), test_acc, len(idx_tr), test_bal, test_major,
                 -1 if L_steer is None else L_steer, steer, torch.from_numpy(X[idx_tr]).float(),
                 torch.from_numpy(y[idx_tr]), None if Xte is None else torch.from_numpy(Xte).float(),
                 None if yte is None else torch.from_numpy(yte), None if pred is None else torch.from_numpy(pred))


def probe_data(n_per_class: int, seed: int) -> tuple[list[str], list[int]]:
    """The probe's training texts and labels (1 = toxic): ``n_per_class`` Davidson tweets per class,
    sampled with ``seed``, in file order (what :func:`train_probe` fits on, before its 90/10 split)."""
    df = data.davidson_tweets()
    parts = [df[df.toxic == c].sample(n=min(n_per_class, int((df.toxic == c).sum())), random_state=seed)
             for c in (0, 1)]
    both = pd.concat(parts).sort_values("row")
    return both.tweet.tolist(), both.toxic.astype(int).tolist()


def train_probe(lm: Loaded, n_per_class: int = Sizes.n_probe_per_class, seed: int = 0,
                max_length: int = Sizes.probe_max_length, batch_size: int = 32,
                progress: bool = True, steer_depth: float = Sizes.steer_depth) -> Probe:
    """The toxicity probe on balanced Davidson tweets (toxic = hate or offensive), 90/10 split,
    checked on the Jigsaw sample, with its class-mean difference at ``steer_depth`` for steering.
    Cached per model and parameters."""
    if not isinstance(n_per_class, int) or n_per_class < 10:
        raise ValueError(f"n_per_class must be an integer >= 10, got {n_per_class!r}")

    texts, labels = probe_data(n_per_class, seed)
    jig = data.jigsaw_sample()
    jig_texts, jig_labels = jig.comment_text.tolist(), jig.toxic.tolist()

    def build():
        return fit_probe(lm, texts, labels, 0.1, jig_texts, jig_labels, seed, max_length, batch_size, progress,
                         steer_depth)

    params = {"n_per_class": n_per_class, "seed": seed, "max_length": max_length, "layer": PROBE_FEATURE_LAYER,
              "steer_depth": round(float(steer_depth), 6), "version": 4,
              "data": cache.content_hash([texts, labels, jig_texts, jig_labels])}  # edited tweets: a new probe
    params = {"model": lm.name, **params}
    probe = store.measure("probe", lm.records_name, params, build, to_record=_probe_record, from_record=_probe_from,
                          device=str(lm.device))
    probe.record = store.key_of("probe", params)
    return probe


def _probe_record(probe: Probe) -> dict:
    return {f.name: getattr(probe, f.name) for f in dataclasses.fields(probe) if f.name != "record"}


def _probe_from(fields: dict) -> Probe:
    return Probe(**fields)


