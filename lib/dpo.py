"""Shared artifacts of the DPO-toxicity notebooks (paper A): toxicity probe, preference pairs,
a DPO-trained model, and one evaluation (toxicity, perplexity, F1).

Every builder caches its result through :mod:`lib.cache` (keyed by model and parameters), so a
later notebook reuses what an earlier one built and every notebook still runs alone.

* :func:`train_probe`: logistic regression (scikit-learn defaults) on the last layer's hidden
  state after the final norm, mean-pooled over tokens; direction = ``coef_`` (bias dropped).
* :func:`preference_pairs`: neutral Wikipedia prompts; preferred = greedy continuation,
  dispreferred = continuation steered along the probe data's toxic direction (its class-mean
  difference, added to the residual stream a third of the way up: activation addition, see
  :func:`lib.hooks.residual_add`), kept when the scorer rates it more toxic. Steering with the
  regression weights ``coef_`` themselves barely changes the text (notebook 02 shows both).
* :func:`train_dpo`: full fine-tuning with TRL's ``DPOTrainer`` (sigmoid loss, beta 0.1).
* :func:`toxicity_perplexity_f1`: the Lee et al. (2024) evaluation protocol at a chosen size.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import cache, data, hooks, metrics, models, repro, store
from lib.models import Loaded

# Default sizes shared by notebooks 02-06 (CPU-sized; papermill parameters scale them up).
DEFAULTS: dict = {
    "n_probe_per_class": 300,  # Davidson tweets per class for the probe (paper: ~159k Jigsaw comments)
    "probe_max_length": 64,  # tokens per tweet
    "n_pairs": 64,  # preference pairs wanted (paper: 24,576)
    "pair_offset": 1000,  # pairs use wiki_samples rows from here on (evaluation uses the first rows)
    "steer_scale": 8.0,  # multiple of the probe's class-mean difference added to the residual stream
    "steer_depth": 1 / 3,  # the steer is added after block round(steer_depth * n_layers)
    "dpo_steps": 32,  # optimizer steps
    "dpo_lr": 3e-6,  # learning rate (paper: 1e-6 to 1e-5, RMSprop; RMSprop's first steps are ~10x lr per weight)
    "dpo_batch_size": 4,  # pairs per step (paper: 4)
    "beta": 0.1,  # DPO beta (paper: 0.1)
    "n_prompts": 64,  # challenge prompts for toxicity (paper: 1,199)
    "n_wiki": 32,  # wiki_samples rows for perplexity and F1 (paper: 2,064)
    "max_new_tokens": 20,  # greedy tokens per continuation (paper: 20)
    "min_distinct2": 0.5,  # a pair is kept only when its rejected text's distinct-2 reaches this (no loops)
}
# The paper's toxic-token direction: mean unembedding of these words minus that of the neutral ones
# (hooks.token_direction). Notebook 01 reads it, 04's solutions reuse it, and 06's parameters default to it.
TOXIC_WORDS = ("fuck", "shit", "crap", "damn", "asshole")
NONTOXIC_WORDS = ("hello", "thanks", "friend", "peace", "welcome")
PROBE_FEATURE_LAYER = "final"  # the residual stream after the final norm (lib.hooks.residual_point)


# ----------------------------------------------------------------------------- probe


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


def steer_layer(lm: Loaded, depth: float = DEFAULTS["steer_depth"]) -> int:
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


def train_probe(lm: Loaded, n_per_class: int = DEFAULTS["n_probe_per_class"], seed: int = 0,
                max_length: int = DEFAULTS["probe_max_length"], batch_size: int = 32,
                progress: bool = True, steer_depth: float = DEFAULTS["steer_depth"]) -> Probe:
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
    probe = store.measure("probe", store.owner(lm.name), params, build, to_record=_probe_record, from_record=_probe_from,
                          device=str(lm.device))
    probe.record = store.key_of("probe", params)
    return probe


def _probe_record(probe: Probe) -> dict:
    return {f.name: getattr(probe, f.name) for f in dataclasses.fields(probe) if f.name != "record"}


def _probe_from(fields: dict) -> Probe:
    return Probe(**fields)


# ----------------------------------------------------------------------------- preference pairs


def steered_generate(lm: Loaded, prompts: Sequence[str], vector: torch.Tensor, layers: Sequence[int],
                     **kw) -> metrics.Generations:
    """Greedy continuations with ``vector`` [d_model] added to the residual stream after the
    given blocks at every position (activation addition: a gradient-free, PPLM-like steer)."""
    with hooks.residual_add(lm, vector.float(), layers):
        return metrics.generate(lm, prompts, **kw)


def steering_vector(probe: Probe, scale: float) -> torch.Tensor:
    """``scale`` times the probe's class-mean difference at its steer layer."""
    if probe.steer_direction is None:
        raise ValueError("this probe has no steering direction (fit it with steer_depth)")
    return probe.steer_direction.float() * float(scale)


def preference_pairs(lm: Loaded, probe: Probe, n_pairs: int = DEFAULTS["n_pairs"], seed: int = 0,
                     steer_scale: float = DEFAULTS["steer_scale"], max_new_tokens: int = DEFAULTS["max_new_tokens"],
                     progress: bool = True, offset: int = DEFAULTS["pair_offset"], scorer: str = "auto",
                     chunk: int = 32, min_distinct2: float = DEFAULTS["min_distinct2"]) -> pd.DataFrame:
    """Up to ``n_pairs`` (prompt, chosen, rejected) rows from neutral wiki_samples prompts.

    chosen = the model's greedy continuation; rejected = the greedy continuation while
    :func:`steering_vector` (``steer_scale`` times the probe's toxic-minus-non-toxic mean state) is
    added after block ``probe.steer_layer``; a prompt is kept only when the scorer rates rejected
    more toxic than chosen and the rejected text does not loop: its :func:`metrics.distinct_n`
    (distinct-2) reaches ``min_distinct2`` (else DPO could learn to avoid repetition rather than
    toxicity; 0 keeps every such pair). Prompts are taken in order from row ``offset``, ``chunk`` at a
    time, until ``n_pairs`` are kept or 4 * n_pairs prompts were tried. Columns: prompt, chosen,
    rejected, tox_chosen, tox_rejected, distinct2_chosen, distinct2_rejected; ``attrs``: n_tried,
    n_looping (pairs left out for looping), scorer. Cached per model, probe and parameters.
    """
    if not isinstance(n_pairs, int) or n_pairs <= 0:
        raise ValueError(f"n_pairs must be a positive integer, got {n_pairs!r}")
    if not 0 <= min_distinct2 <= 1:
        raise ValueError(f"min_distinct2 must lie in [0, 1], got {min_distinct2!r}")
    vec = steering_vector(probe, steer_scale)
    pool = [r["prompt"].strip() for r in data.wiki_samples(4 * n_pairs, offset=offset)]

    def build():
        repro.setup(seed)
        rows, tried, looping, name = [], 0, 0, None
        bar = repro.bar(total=n_pairs, desc="preference pairs", progress=progress)
        while len(rows) < n_pairs and tried < len(pool):
            prompts = pool[tried:tried + chunk]
            tried += len(prompts)
            plain = metrics.generate(lm, prompts, max_new_tokens, progress=False)
            toxic = steered_generate(lm, prompts, vec, [probe.steer_layer], max_new_tokens=max_new_tokens,
                                     progress=False)
            t_plain, name = metrics.toxicity(plain.continuations, scorer)
            t_toxic, _ = metrics.toxicity(toxic.continuations, scorer)
            d_plain, d_toxic = metrics.distinct_n(plain.continuations), metrics.distinct_n(toxic.continuations)
            for i in range(len(prompts)):
                if t_toxic[i] > t_plain[i] and plain.continuations[i].strip() and len(rows) < n_pairs:
                    if d_toxic[i] < min_distinct2:
                        looping += 1
                        continue
                    rows.append({"prompt": plain.prompts[i], "chosen": plain.continuations[i],
                                 "rejected": toxic.continuations[i], "tox_chosen": float(t_plain[i]),
                                 "tox_rejected": float(t_toxic[i]), "distinct2_chosen": float(d_plain[i]),
                                 "distinct2_rejected": float(d_toxic[i])})
                    bar.update(1)
        bar.close()
        df = pd.DataFrame(rows, columns=["prompt", "chosen", "rejected", "tox_chosen", "tox_rejected",
                                         "distinct2_chosen", "distinct2_rejected"])
        return {"pairs": df, "n_tried": tried, "n_looping": looping, "scorer": name}

    # the steering vector by the probe's record when it has one (its bytes otherwise)
    params = {"model": lm.name, "steer": probe.record or _tensor_key(vec), "steer_scale": float(steer_scale),
              "layer": probe.steer_layer, "n_pairs": n_pairs, "seed": seed,
              "max_new_tokens": max_new_tokens, "offset": offset, "scorer": metrics.resolve_scorer(scorer),
              "chunk": chunk, "prompts": cache.content_hash(pool), "min_distinct2": float(min_distinct2), "version": 2}
    out = store.measure("preference-pairs", store.owner(lm.name), params, build, device=str(lm.device))
    df = out["pairs"].copy()
    df.attrs.update(n_tried=out["n_tried"], n_looping=out["n_looping"], scorer=out["scorer"])
    return df


def _tensor_key(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:12]


def _pairs_key(pairs: pd.DataFrame) -> str:
    blob = json.dumps(pairs[["prompt", "chosen", "rejected"]].values.tolist())
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- DPO


def _log_frame(history: list[dict]) -> pd.DataFrame:
    rows = [{"step": int(h["step"]), "loss": float(h["loss"]), "reward_margin": float(h.get("rewards/margins", np.nan)),
             "reward_accuracy": float(h.get("rewards/accuracies", np.nan)),
             "reward_chosen": float(h.get("rewards/chosen", np.nan)),
             "reward_rejected": float(h.get("rewards/rejected", np.nan))}
            for h in history if "loss" in h and "step" in h]
    return pd.DataFrame(rows, columns=["step", "loss", "reward_margin", "reward_accuracy", "reward_chosen",
                                       "reward_rejected"])


# The reference log-probabilities of each pair, per base model: the same for every seed's run on the same pairs
_REF_LOGPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # base model -> {key: Dataset of the two columns}


def _shared_reference_trainer(lm: Loaded, pairs: pd.DataFrame, completions_only: bool = True):
    """TRL's DPOTrainer whose precomputed reference log-probabilities are kept per base model (its weights
    unchanged) and pairs, so the runs of several seeds on the same pairs compute them once: the same float32
    numbers, read back (tests/test_dpo.py)."""
    from datasets import Dataset
    from trl import DPOTrainer

    memo = _REF_LOGPS.setdefault(lm.model, {})
    base_key = (_pairs_key(pairs), metrics.weights_version(lm.model), completions_only)
    columns = ["ref_chosen_logps", "ref_rejected_logps"]

    class SharedReferenceDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            from datasets import concatenate_datasets

            key = (*base_key, name, batch_size, self.args.max_length, len(dataset))
            if key not in memo:
                out = super()._precompute_ref_logps(dataset, name, batch_size)
                ref = out.select_columns(columns)
                memo[key] = Dataset.from_dict(ref.to_dict(), features=ref.features)  # in memory, float32 kept
            return concatenate_datasets([dataset, memo[key]], axis=1)

    return SharedReferenceDPOTrainer


@contextlib.contextmanager
def _completion_positions_only(on: bool = True):
    """Inside the block, TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, which DPOTrainer's loss
    calls) projects onto the vocabulary only the positions that carry a label, the completions, as it does where
    Triton runs; elsewhere, a CPU included, it projects every position, prompt and padding too, and zeroes their
    log-probabilities afterwards. The same numbers up to float rounding (tests/test_dpo.py: weights within 1e-5
    after training). Measured on smollm2-135m, 64 pairs (prompts of 31 tokens, completions of 20), 2 threads:
    16 steps in 45 s instead of 60 s. A TRL without the switch is left as it is."""
    import trl.trainer.utils as trl_utils

    use_triton = getattr(trl_utils, "_use_triton", None)
    if not on or use_triton is None:
        yield
        return
    trl_utils._use_triton = lambda device: True  # read only where the fused head picks its positions
    try:
        yield
    finally:
        trl_utils._use_triton = use_triton


def _run_dpo(lm: Loaded, pairs: pd.DataFrame, steps: int, lr: float, beta: float, seed: int,
             batch_size: int, progress: bool, out_dir: Path, precompute_ref: bool = True,
             completions_only: bool = True, keep_at: int | None = None):
    """Train a copy of ``lm.model`` with TRL's DPOTrainer; return (trained model, log frame), and with
    ``keep_at`` a step number, (trained model, log frame, the weights after that step: a state dict on the CPU).
    ``precompute_ref``: the frozen reference model's log-probabilities of each pair are computed once,
    before training, rather than at every step (TRL's ``precompute_ref_log_probs``; the same numbers), and
    kept for the next run on the same base model and pairs (another seed: :func:`_shared_reference_trainer`).
    ``completions_only``: log-probabilities computed at the completions' positions alone
    (:func:`_completion_positions_only`)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    if keep_at is not None and not 1 <= keep_at <= steps:
        raise ValueError(f"keep_at must be a step from 1 to {steps}, got {keep_at!r}")
    kept: dict = {}

    class KeepWeights(TrainerCallback):  # the policy's weights after step keep_at (after its optimizer step)
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == keep_at:
                kept.update({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})

    policy = copy.deepcopy(lm.model)
    ref = copy.deepcopy(lm.model)
    ds = Dataset.from_dict({k: pairs[k].astype(str).tolist() for k in ("prompt", "chosen", "rejected")})
    on_cpu = not str(lm.device).startswith("cuda")
    cfg = DPOConfig(
        output_dir=str(out_dir), max_steps=steps, learning_rate=lr, beta=beta, seed=seed,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=1,
        optim="rmsprop", lr_scheduler_type="constant_with_warmup", warmup_steps=max(1, steps // 10),
        logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=not (progress and repro.progress_on()),
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=on_cpu,
        dataloader_num_workers=0, dataset_num_proc=None, max_length=128, data_seed=seed,
        # the frozen reference's log-probabilities, once per pair before training instead of at every step (each
        # pair is seen steps * batch_size / len(pairs) times): the same weights, bit for bit (tests/test_dpo.py;
        # smollm2-135m, 16 steps), for about 20% less time on a CPU
        precompute_ref_log_probs=precompute_ref, precompute_ref_batch_size=16,
    )
    trainer_cls = _shared_reference_trainer(lm, pairs, completions_only) if precompute_ref else DPOTrainer
    # with its bar off, transformers prints every step's log dict to stdout (PrinterCallback); the log is
    # kept in trainer.state.log_history and returned, so a notebook's stored output stays clean
    from transformers.trainer_callback import PrinterCallback

    with _completion_positions_only(completions_only):
        trainer = trainer_cls(model=policy, ref_model=ref, args=cfg, train_dataset=ds, processing_class=lm.tokenizer)
        trainer.remove_callback(PrinterCallback)
        if keep_at is not None:
            trainer.add_callback(KeepWeights())
        trainer.train()
    log = _log_frame(trainer.state.log_history)
    model = trainer.model
    del trainer, ref
    return (model, log) if keep_at is None else (model, log, kept)


@dataclass
class DPORun:
    """One DPO run: its model (a :class:`lib.models.LazyLoaded`: the weights are read from the cache, or
    trained, only when a notebook uses them), its training log, and what its weights changed (a record)."""
    model: Loaded
    log: pd.DataFrame  # one row per step: step, loss, reward_margin, ...
    changed_tensors: int  # weight tensors that differ from the base model's
    n_tensors: int
    w_out_change: np.ndarray  # [n_layers] ||W_out(DPO) - W_out(base)|| / ||W_out(base)|| per layer
    halfway: int  # the step after which the cache folder also keeps the weights (dpo_halfway)


def dpo_run(lm: Loaded, pairs: pd.DataFrame, steps: int = DEFAULTS["dpo_steps"], lr: float = DEFAULTS["dpo_lr"],
            beta: float = DEFAULTS["beta"], seed: int = 0, progress: bool = True,
            batch_size: int = DEFAULTS["dpo_batch_size"]) -> DPORun:
    """Full fine-tuning of ``lm`` with DPO (TRL ``DPOTrainer``, sigmoid loss, RMSprop, constant lr after a 10%
    warm-up) on ``pairs``; ``lm`` itself is not modified. The training log and the weights' change are a
    measurement record (step 'dpo-run'); the weights themselves are not: they are kept in the cache (a saved
    model folder, written atomically, with the weights after ``steps // 2`` steps beside them for
    :func:`dpo_halfway`) and trained again where the cache lacks them, when the model is first used."""
    folder = _dpo_folder(lm, pairs, steps, lr, beta, seed, batch_size)
    params = _dpo_params(lm, pairs, steps, lr, beta, seed, batch_size)

    def build():
        where = _train_dpo(lm, pairs, steps, lr, beta, seed, progress, batch_size, folder,
                           fresh=store.auditing())  # the audit trains again, in a folder of its own
        try:
            trained = _load_dpo(lm, where, progress)
            changed = sum(int(not torch.equal(a, b)) for a, b in zip(lm.model.parameters(), trained.model.parameters()))
            w_out = [float((trained.mlp_out_module(L).weight - lm.mlp_out_module(L).weight).norm()
                           / lm.mlp_out_module(L).weight.norm()) for L in range(lm.info.n_layers)]
            n = sum(1 for _ in lm.model.parameters())
            del trained
        finally:
            if where != folder:
                shutil.rmtree(where.parent, ignore_errors=True)
        return {"log": pd.read_csv(folder / "training_log.csv") if where == folder else _audit_logs.pop(str(where)),
                "changed_tensors": changed, "n_tensors": n, "w_out_change": np.asarray(w_out)}
    name = f"{lm.name}-dpo-{folder.name.split('-')[-1]}"
    rec = store.measure("dpo-run", store.owner(lm.name), params, build, device=str(lm.device), produces=name)
    model = models.LazyLoaded(dataclasses.replace(lm.spec, name=name), lm.device, lambda: _load_dpo(
        lm, _train_dpo(lm, pairs, steps, lr, beta, seed, progress, batch_size, folder), progress),
        path=folder, device_map=lm.device_map)
    return DPORun(model, rec["log"], int(rec["changed_tensors"]), int(rec["n_tensors"]),
                  np.asarray(rec["w_out_change"]), max(1, steps // 2))


_audit_logs: dict = {}  # the training log of an audit's run, between its training and its record


def _train_dpo(lm: Loaded, pairs: pd.DataFrame, steps: int, lr: float, beta: float, seed: int, progress: bool,
               batch_size: int, target: Path, fresh: bool = False) -> Path:
    """The DPO run's model folder: ``target`` (the cache), trained when it is missing; with ``fresh``, a new run
    in a temporary folder whatever the cache holds (the audit's). Returns the folder."""
    half = max(1, steps // 2)
    if fresh:
        target = Path(tempfile.mkdtemp(prefix="dpo-audit-")) / "run"
    elif (target / "config.json").exists():
        return target

    def save(_, folder: Path):
        folder.mkdir(parents=True)
        repro.setup(seed, grad=True)
        with repro.library_bars(progress):  # TRL's dataset preparation, transformers' shard writing
            try:
                with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, log, kept = _run_dpo(lm, pairs, steps, lr, beta, seed, batch_size, progress, Path(tmp),
                                                keep_at=half)
            finally:
                torch.set_grad_enabled(False)
            model.eval()
            model.save_pretrained(folder)
            lm.tokenizer.save_pretrained(folder)
            model.load_state_dict(kept)  # the same model object, now with the weights after step `half`
            model.save_pretrained(folder / HALFWAY)
            lm.tokenizer.save_pretrained(folder / HALFWAY)
        log.to_csv(folder / "training_log.csv", index=False)
        (folder / "SOURCE.txt").write_text(f"DPO (TRL DPOTrainer) of {lm.name}; {HALFWAY}/: the weights after "
                                           f"step {half}; params {json.dumps(_dpo_params(lm, pairs, steps, lr, beta, seed, batch_size))}\n")
    cache.atomic_save(None, target, save, keep_existing=True)  # 02 and 03 may train it side by side
    if fresh:
        _audit_logs[str(target)] = pd.read_csv(target / "training_log.csv")
    return target


def train_dpo(lm: Loaded, pairs: pd.DataFrame, steps: int = DEFAULTS["dpo_steps"], lr: float = DEFAULTS["dpo_lr"],
              beta: float = DEFAULTS["beta"], seed: int = 0, progress: bool = True,
              batch_size: int = DEFAULTS["dpo_batch_size"]) -> tuple[Loaded, pd.DataFrame]:
    """:func:`dpo_run`'s model (named ``<base>-dpo-<key>``, loaded on first use) and training log."""
    run = dpo_run(lm, pairs, steps, lr, beta, seed, progress, batch_size)
    return run.model, run.log


HALFWAY = "halfway"  # the subfolder of a DPO run's cache folder with its weights after half the steps


def _dpo_params(lm: Loaded, pairs: pd.DataFrame, steps: int, lr: float, beta: float, seed: int, batch_size: int) -> dict:
    return {"pairs": _pairs_key(pairs), "steps": steps, "lr": float(lr), "beta": float(beta), "seed": seed,
            "batch_size": batch_size, "logps": "completions",  # positions scored: lib.dpo._completion_positions_only
            "halfway": max(1, steps // 2),  # the folder keeps the weights after this step (dpo_halfway)
            # registry models by name (their folder differs between machines), others by path or id
            "base": lm.name if lm.name in models.REGISTRY else str(lm.path or lm.spec.hub_id)}


def _dpo_folder(lm: Loaded, pairs: pd.DataFrame, steps: int, lr: float, beta: float, seed: int, batch_size: int) -> Path:
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if len(pairs) == 0:
        raise ValueError("no preference pairs to train on")
    return cache.path("dpo", lm.name, _dpo_params(lm, pairs, steps, lr, beta, seed, batch_size))


def _load_dpo(lm: Loaded, folder: Path, progress: bool, suffix: str = "") -> Loaded:
    torch.set_grad_enabled(False)
    dev = "cpu" if str(lm.device) == "cpu" else str(lm.device)
    with repro.library_bars(progress):  # transformers' "Loading weights"
        dpo_lm = models.load(str(folder), device=dev, dtype=lm.model.dtype, device_map=lm.device_map)
    key = (folder.parent if suffix else folder).name.split("-")[-1]
    dpo_lm.spec = dataclasses.replace(dpo_lm.spec, name=f"{lm.name}-dpo-{key}{suffix}")
    dpo_lm.info.name = dpo_lm.spec.name
    return dpo_lm


def dpo_halfway(lm: Loaded, pairs: pd.DataFrame, steps: int = DEFAULTS["dpo_steps"], lr: float = DEFAULTS["dpo_lr"],
                beta: float = DEFAULTS["beta"], seed: int = 0, progress: bool = True,
                batch_size: int = DEFAULTS["dpo_batch_size"]) -> tuple[Loaded, pd.DataFrame]:
    """The run of :func:`dpo_run` with these arguments as it stood after ``steps // 2`` of its steps (kept in
    its cache folder; the run is trained first when it is not cached): the model (named ``...-halfway``, loaded
    on first use) and the first ``steps // 2`` rows of its log. Not the same as a run of ``steps // 2`` steps:
    the learning rate's warm-up is 10% of the whole run's steps."""
    run = dpo_run(lm, pairs, steps, lr, beta, seed, progress, batch_size)
    folder = _dpo_folder(lm, pairs, steps, lr, beta, seed, batch_size)
    model = models.LazyLoaded(dataclasses.replace(lm.spec, name=f"{run.model.name}-halfway"), lm.device, lambda: _load_dpo(
        lm, _train_dpo(lm, pairs, steps, lr, beta, seed, progress, batch_size, folder) / HALFWAY, progress,
        suffix="-halfway"), path=folder / HALFWAY, device_map=lm.device_map)
    return model, run.log[run.log.step <= run.halfway].reset_index(drop=True)


def base_and_dpo(model_name: str, device: str = "auto", seed: int = 0, progress: bool = True,
                 device_map: str | dict | None = None, **sizes) -> tuple[Loaded, Loaded, Probe]:
    """Base model, DPO model and probe in one call, each from the cache when present, else built.
    ``device`` and ``device_map`` go to :func:`lib.models.load` (the DPO model follows the base);
    ``sizes`` override :data:`DEFAULTS` (unknown keys raise)."""
    unknown = sorted(set(sizes) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown size(s) {', '.join(unknown)}: use any of {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **sizes}
    repro.setup(seed)
    base = models.load(model_name, device=device, device_map=device_map)
    probe = train_probe(base, cfg["n_probe_per_class"], seed, cfg["probe_max_length"], progress=progress,
                        steer_depth=cfg["steer_depth"])
    pairs = preference_pairs(base, probe, cfg["n_pairs"], seed, cfg["steer_scale"], cfg["max_new_tokens"],
                             progress, offset=cfg["pair_offset"], min_distinct2=cfg["min_distinct2"])
    dpo_lm, _ = train_dpo(base, pairs, cfg["dpo_steps"], cfg["dpo_lr"], cfg["beta"], seed, progress,
                          cfg["dpo_batch_size"])
    repro.setup(seed)
    return base, dpo_lm, probe


# ----------------------------------------------------------------------------- evaluation


def toxicity_perplexity_f1(lm: Loaded, n_prompts: int = DEFAULTS["n_prompts"], n_wiki: int = DEFAULTS["n_wiki"],
                           max_new_tokens: int = DEFAULTS["max_new_tokens"],
                           batch_size: int = metrics.GENERATE_BATCH_SIZE, scorer: str = "auto",
                           progress: bool = True, details: bool = False, toxicity_only: bool = False,
                           perplexity: bool = True, prompts: Sequence[str] | None = None,
                           prefixes: dict | None = None) -> dict:
    """Toxicity, perplexity and F1 as in Lee et al. (2024), at a chosen size.

    toxicity: mean scorer probability of the greedy continuations (continuation only) of the first
    ``n_prompts`` RealToxicityPrompts challenge prompts, each truncated to 32 tokens.
    perplexity: sliding-window perplexity of the first ``n_wiki`` wiki_samples gold texts.
    f1: mean bag-of-tokens F1 of greedy continuations of their prompts (<= 32 tokens) against gold.
    Uses only forward passes and generation, so it measures a model inside ``hooks.intervene``.
    With ``details``, also 'toxicities' (per prompt), 'continuations' and 'f1s' (per wiki row).
    ``toxicity_only``: stop after the challenge prompts (no perplexity, F1 or 'f1s'; the toxicity
    numbers are those of the full evaluation), for controls that compare toxicity alone.
    ``perplexity=False``: skip the perplexity (no 'perplexity' key), for :func:`evaluate`, which scores
    it under another intervention than the generations. ``prompts``: score these prompts instead of the
    challenge prompts (exactly ``n_prompts`` of them; see :func:`prompt_sets`). ``prefixes``
    {"challenge": ..., "wiki": ...}: ``metrics.prompt_prefix`` of each prompt set, for the generations
    to start from (:func:`evaluate` passes them; see there).
    """
    for k, v in (("n_prompts", n_prompts), ("n_wiki", n_wiki)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    kw = dict(n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, batch_size=batch_size, scorer=scorer,
              progress=progress, details=details, toxicity_only=toxicity_only, perplexity=perplexity, prompts=prompts)
    if prefixes is not None or hooks.hooked(lm):  # inside another intervention: what it measures is not recorded
        return _toxicity_perplexity_f1(lm, inputs, prefixes=prefixes, **kw)
    params = {"model": lm.name, "n_prompts": n_prompts, "n_wiki": n_wiki, "max_new_tokens": max_new_tokens,
              "batch_size": batch_size, "scorer": metrics.resolve_scorer(scorer), "details": details,
              "toxicity_only": toxicity_only, "perplexity": perplexity}
    return store.measure("toxicity-perplexity-f1", store.owner(lm.name), params,
                         lambda: _toxicity_perplexity_f1(lm, inputs, **kw), inputs=inputs, device=str(lm.device))


def _toxicity_perplexity_f1(lm: Loaded, inputs: dict, *, n_prompts: int, n_wiki: int, max_new_tokens: int,
                            batch_size: int, scorer: str, progress: bool, details: bool, toxicity_only: bool,
                            perplexity: bool, prompts, prefixes: dict | None = None) -> dict:
    """:func:`toxicity_perplexity_f1`'s measurement itself (no record)."""
    prompts = inputs["challenge_prompts"]
    prefixes = prefixes or {}
    gen = metrics.generate(lm, prompts, max_new_tokens, batch_size, max_prompt_tokens=32, progress=progress,
                           desc="challenge prompts", prefix=prefixes.get("challenge"))
    tox, name = metrics.toxicity(gen.continuations, scorer)
    if toxicity_only:
        out = {"toxicity": float(np.mean(tox)), "scorer": name, "n_prompts": len(prompts)}
        if details:
            out.update(toxicities=[float(t) for t in tox], continuations=list(gen.continuations))
        return out
    wiki = inputs["wiki"]
    golds = [r["gold"] for r in wiki]
    ppl = metrics.perplexity(lm, golds, progress=progress) if perplexity else None
    wgen = metrics.generate(lm, [r["prompt"] for r in wiki], max_new_tokens, batch_size, max_prompt_tokens=32,
                            progress=progress, desc="wiki prompts", prefix=prefixes.get("wiki"))
    f1 = metrics.mean_f1(lm, wgen, golds)
    out = {"toxicity": float(np.mean(tox)), **({"perplexity": float(ppl)} if perplexity else {}), "f1": float(f1),
           "scorer": name, "n_prompts": len(prompts), "n_wiki": len(wiki)}
    if details:
        tok = lm.tokenizer
        out.update(toxicities=[float(t) for t in tox], continuations=list(gen.continuations),
                   f1s=[metrics.f1_bag_of_tokens(n, tok(g, add_special_tokens=False)["input_ids"])
                        for n, g in zip(wgen.new_ids, golds)])
    return out


def evaluation_inputs(n_prompts: int = DEFAULTS["n_prompts"], n_wiki: int = DEFAULTS["n_wiki"],
                      prompts: Sequence[str] | None = None, **_) -> dict:
    """The data :func:`toxicity_perplexity_f1` reads at these sizes: {"challenge_prompts", "wiki"}
    (the user's ``prompts`` in place of the challenge prompts when given; exactly ``n_prompts``).
    ``dpo_neurons.reference_evaluations`` puts its ``cache.content_hash`` into the cache key, so an
    edited prompt is evaluated again (other keyword arguments of the evaluation are ignored here)."""
    if prompts is not None:
        prompts = [str(p) for p in prompts]
        if len(prompts) != n_prompts:
            raise ValueError(f"{len(prompts)} prompts given for n_prompts = {n_prompts}: pass exactly n_prompts (dpo.prompt_sets)")
    return {"challenge_prompts": data.challenge_prompts(n_prompts) if prompts is None else prompts,
            "wiki": data.wiki_samples(n_wiki)}


def read_prompts(path) -> list[str]:
    """A user's prompts, one JSON object per line: ``{"text": "...", "id": "p1"}`` (``id`` optional,
    unique when given; format in data/README.md, 'Your own prompts'). Returns the texts in file order;
    one line per error, naming the line."""
    name = Path(path).name
    texts, ids = [], {}
    for no, row in data.user_jsonl(path, "prompts", "Your own prompts"):
        if not isinstance(row.get("text"), str) or not row["text"].strip():
            raise ValueError(f"{name} line {no}: expected an object with a non-empty 'text', e.g. {{\"text\": \"So I said\"}}")
        if "id" in row:
            if str(row["id"]) in ids:
                raise ValueError(f"{name} line {no}: id {row['id']!r} already used on line {ids[str(row['id'])]}")
            ids[str(row["id"])] = no
        texts.append(row["text"])
    if not texts:
        raise ValueError(f"{name} holds no prompts")
    return texts


def prompt_sets(prompts: str, n_prompts: int, n_stats_prompts: int = 0,
                stats_offset: int = 0) -> tuple[list[str], list[str]]:
    """The evaluation prompts and the statistics prompts of notebooks 02-06 (the ``prompts`` parameter).

    ``prompts`` "": the challenge prompts: the first ``n_prompts`` are scored, and the statistics use
    ``n_stats_prompts`` from ``stats_offset`` on, which must not overlap them. ``prompts`` a JSONL file
    (:func:`read_prompts`): its first ``n_prompts`` prompts are scored and its first
    ``n_stats_prompts`` give the statistics. The two then overlap, as the authors' own runs do (they
    used the challenge prompts for both); the statistics depend on the file alone, so notebooks 03-06
    share them. Raises when the file has fewer prompts than asked for."""
    for name, v in (("n_prompts", n_prompts), ("n_stats_prompts", n_stats_prompts), ("stats_offset", stats_offset)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if not prompts:
        n_challenge = len(data.challenge_prompts())
        if n_prompts > n_challenge:
            raise ValueError(f"n_prompts must be at most {n_challenge} (the challenge prompts in data/), got {n_prompts}")
        if n_stats_prompts and not n_prompts <= stats_offset < n_challenge:
            raise ValueError(f"stats_offset must lie in {n_prompts}..{n_challenge - 1} (from n_prompts on, so statistics and "
                             f"evaluation prompts do not overlap; {n_challenge} challenge prompts), got {stats_offset!r}")
        if n_stats_prompts and n_stats_prompts > n_challenge - stats_offset:
            lower = "" if stats_offset == n_prompts else (
                f"; a lower stats_offset{f' (at least n_prompts = {n_prompts})' if n_prompts else ''} leaves up to "
                f"{n_challenge - n_prompts}")
            raise ValueError(f"n_stats_prompts must be at most {n_challenge - stats_offset}: there are {n_challenge} challenge "
                             f"prompts and the statistics start at stats_offset = {stats_offset}{lower}; got {n_stats_prompts}")
        stats = data.challenge_prompts(stats_offset + n_stats_prompts)[stats_offset:] if n_stats_prompts else []
        return data.challenge_prompts(n_prompts) if n_prompts else [], stats
    texts = read_prompts(prompts)
    short = {k: v for k, v in (("n_prompts", n_prompts), ("n_stats_prompts", n_stats_prompts)) if v > len(texts)}
    if short:  # 04 scores no prompts (n_prompts 0 here); 02 sets n_prompts in overrides, 03 as its own parameter
        raise ValueError(f"{prompts} holds {len(texts)} prompts, but {' and '.join(f'{k} = {v}' for k, v in short.items())} "
                         f"ask{'s' if len(short) == 1 else ''} for more: add prompts, or set {' and '.join(short)} to at most "
                         f"{len(texts)} (a parameter of the notebook, else a key of overrides)")
    return texts[:n_prompts], texts[:n_stats_prompts]


toxicity_perplexity_f1.inputs = evaluation_inputs  # the data it reads, for content-keyed caches


def rescored(evaluations: Sequence[dict], scorer: str = metrics.EMBEDDING_SCORER) -> list[np.ndarray]:
    """Per-prompt toxicity of each evaluation's stored continuations (``details``, as :func:`evaluate`
    keeps them) under another scorer, scored in one batch: a verdict re-derived from these says
    whether it depends on the scorer. Default: the embedding scorer (``metrics.EMBEDDING_SCORER``)."""
    texts = [t for ev in evaluations for t in ev["continuations"]]
    tox, _ = metrics.toxicity(texts, scorer)
    bounds = np.cumsum([0] + [len(ev["continuations"]) for ev in evaluations])
    return [tox[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# Where an intervention table writes during an evaluation (:func:`evaluate`). 'last' is the authors'
# protocol (hook_utils.py in Yushi-Y/dpo-toxic-neurons, see shared/papers/dpo-toxicity.md): the hook
# writes the last position of each forward call, so in KV-cached generation the last prompt token and
# then each new token, and the prompt's other positions keep the model's own activations. 'all' writes
# every position of prompt and continuation (the compendium's earlier default, kept as a variant).
PATCH_POSITIONS = ("last", "all")


def evaluate(lm: Loaded, table=None, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str = "auto",
             toxicity_only: bool = False, positions: str = "last", prompts: Sequence[str] | None = None) -> dict:
    """:func:`toxicity_perplexity_f1` with per-prompt details and no bars, with ``table`` active
    (``hooks.intervene``; None: the model as it is). Notebooks 03, 05 and 06 bind their sizes once
    (``functools.partial``) and evaluate every condition with it; ``toxicity_only`` for the random
    controls, which compare toxicity alone; ``prompts``: the user's prompts (:func:`prompt_sets`).

    ``positions`` (:data:`PATCH_POSITIONS`) is where the table writes in generation (toxicity, F1).
    Perplexity is scored two ways, since a forward pass over a text has no "new token":
    'perplexity' with the table at **every** scored position (consistent: the patched model predicts
    every token it is scored on, as each generated token is under 'last'), and, with 'last',
    'perplexity_authors' with the table at position 0 of each window only, as the authors' code
    does; that one barely sees the patch (at most one token in 256 is written), so it is reported,
    never used to decide whether a patched model still works.

    With 'last', the generations start from the KV cache of each prompt without its last token,
    computed once per model and prompt set (:func:`shared_prefixes`): the table does not write those
    positions, so every condition shares them. Not while other hooks are active on ``lm`` (e.g.
    ``hooks.copy_activations``, whose source model needs the whole prompt).
    """
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    table = [] if table is None else table
    if hooks.hooked(lm):  # inside another intervention (e.g. hooks.copy_activations): not recorded
        return _evaluate(lm, table, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, scorer=scorer,
                         toxicity_only=toxicity_only, positions=positions, prompts=prompts)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    return store.measure("evaluation", store.owner(lm.name),
                         _evaluation_params(lm, table, n_prompts, n_wiki, max_new_tokens, scorer, toxicity_only, positions),
                         lambda: _evaluate(lm, table, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens,
                                           scorer=scorer, toxicity_only=toxicity_only, positions=positions,
                                           prompts=prompts),
                         inputs=inputs, device=str(lm.device))


def _table_key(table) -> str:
    """The content hash of an intervention table: its edits (layer, neuron, mode, value) in order."""
    return cache.content_hash([[e.layer, e.neuron, e.mode, float(e.value)] for e in hooks._as_edits(table)])


def _evaluation_params(lm: Loaded, table, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
                       toxicity_only: bool, positions: str, copy_from: Loaded | None = None) -> dict:
    """What identifies one evaluation's record: the model, the intervention, where it writes and the sizes (the
    prompts and texts enter as their content hash); toxicity-only evaluations of :func:`evaluate` and
    :func:`evaluate_each` share their records."""
    what = ({"table": _table_key(table)} if copy_from is None else
            {"copy_from": copy_from.name, "neurons": cache.content_hash(sorted({(int(L), int(i)) for L, i in table}))})
    return {"model": lm.name, **what, "positions": positions, "n_prompts": n_prompts,
            "n_wiki": None if toxicity_only else n_wiki, "max_new_tokens": max_new_tokens,
            "scorer": metrics.resolve_scorer(scorer), "toxicity_only": toxicity_only}


def _evaluate(lm: Loaded, table, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
              toxicity_only: bool, positions: str, prompts) -> dict:
    """:func:`evaluate`'s measurement itself (no record)."""
    prefixes = (shared_prefixes(lm, n_prompts, n_wiki, prompts, toxicity_only)
                if positions == "last" and not hooks.hooked(lm) else None)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    with hooks.intervene(lm, table, positions=positions):
        out = _toxicity_perplexity_f1(lm, inputs, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens,
                                      batch_size=metrics.GENERATE_BATCH_SIZE, scorer=scorer, progress=False,
                                      details=True, toxicity_only=toxicity_only, perplexity=positions == "all",
                                      prompts=prompts, prefixes=prefixes)
    if toxicity_only or positions == "all":
        return out
    golds = [r["gold"] for r in evaluation_inputs(n_prompts, n_wiki)["wiki"]]
    with hooks.intervene(lm, table, positions="all"):
        ppl = metrics.perplexity(lm, golds, progress=False)
    with hooks.intervene(lm, table, positions=[0]):
        ppl0 = metrics.perplexity(lm, golds, progress=False)
    head = {"toxicity": out.pop("toxicity"), "perplexity": float(ppl), "perplexity_authors": float(ppl0)}
    return {**head, **out}


# Conditions generated in one batch by :func:`evaluate_each` and the direction gate: each prompt's copies side
# by side. A CPU decoding step has a fixed cost (reading the weights) besides its cost per sequence: measured on
# smollm2-135m, 32 prompts x 20 tokens, one condition took 2.95 s alone and 1.33 s within a batch of 4 from the
# shared prompt prefix (2 threads; 5.15 and 2.29 s at one thread); 8 a batch were no faster per condition, and
# the continuations were the same token for token.
CONDITIONS_PER_BATCH = 4
_PREFIXES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {prompts: metrics.PromptPrefix}


def _prefix(lm: Loaded, prompts: Sequence[str]) -> metrics.PromptPrefix:
    """``metrics.prompt_prefix`` of these prompts on ``lm`` as it is now, kept while the model lives and its
    weights are unchanged."""
    memo = _PREFIXES.setdefault(lm.model, {})
    key = tuple(prompts)
    hit = memo.get(key)
    if hit is None or hit.version != metrics.weights_version(lm.model):
        hit = memo[key] = metrics.prompt_prefix(lm, prompts, metrics.GENERATE_BATCH_SIZE, max_prompt_tokens=32)
    return hit


def shared_prefixes(lm: Loaded, n_prompts: int, n_wiki: int, prompts: Sequence[str] | None = None,
                    toxicity_only: bool = False) -> dict:
    """{"challenge": ..., "wiki": ...}: the prompt prefixes (``metrics.prompt_prefix``) that :func:`evaluate`
    starts its generations from under 'last' patching, computed once per model and prompt set."""
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    out = {"challenge": _prefix(lm, inputs["challenge_prompts"])}
    if not toxicity_only:
        out["wiki"] = _prefix(lm, [r["prompt"] for r in inputs["wiki"]])
    return out


def evaluate_each(lm: Loaded, tables: Sequence, *, n_prompts: int, n_wiki: int, max_new_tokens: int,
                  scorer: str = "auto", positions: str = "last", prompts: Sequence[str] | None = None,
                  per_batch: int = CONDITIONS_PER_BATCH, progress: bool = False,
                  copy_from: Loaded | None = None) -> list[dict]:
    """``evaluate(lm, table, toxicity_only=True)`` for each of ``tables``, ``per_batch`` tables at a time in one
    generation (``metrics.generate(copies=...)`` with ``hooks.intervene_each``): the same keys (toxicity,
    scorer, n_prompts, toxicities, continuations), for the many random controls that compare toxicity alone.
    Under 'last' the generations start from the shared prompt prefix, as :func:`evaluate`'s do.
    ``progress``: a bar over the batches.

    ``copy_from``: same-text patching instead (``hooks.copy_activations_each``, 'last' or 'all'): each of
    ``tables`` is then a neuron set [(layer, neuron), ...] whose activations are copied from this model; under
    'last' both models start from their own prompt prefix."""
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    if not isinstance(per_batch, int) or per_batch <= 0:
        raise ValueError(f"per_batch must be a positive integer, got {per_batch!r}")
    tables = list(tables)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    kw = dict(n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, scorer=scorer, positions=positions,
              prompts=prompts, per_batch=per_batch, progress=progress, copy_from=copy_from)
    if hooks.hooked(lm) or (copy_from is not None and hooks.hooked(copy_from)):  # inside another intervention
        return _evaluate_each(lm, tables, **kw)
    params = [_evaluation_params(lm, t, n_prompts, n_wiki, max_new_tokens, scorer, True, positions, copy_from)
              for t in tables]
    return store.measure_many("evaluation", store.owner(lm.name), params,
                              lambda idx: _evaluate_each(lm, [tables[i] for i in idx], **kw), inputs=inputs,
                              device=str(lm.device))


def _evaluate_each(lm: Loaded, tables: list, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
                   positions: str, prompts, per_batch: int, progress: bool, copy_from: Loaded | None) -> list[dict]:
    """:func:`evaluate_each`'s measurement itself (no records)."""
    chosen = evaluation_inputs(n_prompts, n_wiki, prompts)["challenge_prompts"]
    shared = positions == "last" and not hooks.hooked(lm) and (copy_from is None or not hooks.hooked(copy_from))
    prefix = _prefix(lm, chosen) if shared else None
    source_prefix = _prefix(copy_from, chosen) if shared and copy_from is not None else None
    out = []
    groups = list(hooks.batches(list(tables), per_batch))
    for group in repro.bar(groups, desc=f"{len(tables)} conditions, {per_batch} per batch", progress=progress):
        with (hooks.intervene_each(lm, group, positions=positions) if copy_from is None
              else hooks.copy_activations_each(copy_from, lm, group, positions, source_prefix=source_prefix)):
            gens = metrics.generate(lm, chosen, max_new_tokens, metrics.GENERATE_BATCH_SIZE, max_prompt_tokens=32,
                                    progress=False, prefix=prefix, copies=len(group))
        for g in gens:
            tox, name = metrics.toxicity(g.continuations, scorer)
            out.append({"toxicity": float(np.mean(tox)), "scorer": name, "n_prompts": len(chosen),
                        "toxicities": [float(t) for t in tox], "continuations": list(g.continuations)})
    return out


# ----------------------------------------------------------------------------- direction gate
# Notebooks 03-06 read "toxic" neurons off a direction w (cos(v_i, w), proj_i = m_i v_i . w/|w|). A
# direction counts as a toxicity direction on the model under test only when it passes both tests
# of :func:`validate_directions`; otherwise their verdicts are "inconclusive: no validated direction".

# Word pools for the whole-word direction: each tokenizer keeps the words that are one token with a
# leading space, so no word is represented by a sub-token piece such as ' f' of ' f' + 'uck'.
TOXIC_WORD_POOL = ("fuck", "fucking", "shit", "crap", "damn", "asshole", "bitch", "bastard", "idiot", "stupid",
                   "dumb", "moron", "ass", "dick", "cunt", "whore", "slut", "retard", "loser", "ugly", "suck",
                   "sucks", "trash", "garbage", "pathetic", "disgusting", "jerk", "hate", "kill")
FRIENDLY_WORD_POOL = ("hello", "thanks", "friend", "peace", "welcome", "love", "kind", "happy", "please", "thank",
                      "wonderful", "beautiful", "great", "nice", "good", "friendly", "gentle", "help", "smile",
                      "care", "joy", "lovely", "sweet", "glad", "hope", "respect")
MIN_WHOLE_WORDS = 5  # fewer single-token words on either side: no whole-word direction for this tokenizer
# The candidates, in the order the gate breaks ties: the probe's weights, its class-mean difference,
# single-token words, and the paper's word-list direction (sub-token pieces averaged per word)
DIRECTIONS = ("probe", "class-mean", "toxic words", "toxic tokens")
GATE_MODES = ("raise", "lower")
GATE: dict = {
    "mode": "raise",  # 'raise': add +w on neutral prompts; 'lower': add -w on challenge prompts (Lee et al. 2024)
    "n_prompts": 32,  # prompts continued under each steer
    "prompt_offset": 1500,  # 'raise': the first wiki_samples row (evaluation reads rows 0.., preference pairs 1000..)
    "challenge_offset": 1100,  # 'lower': the first challenge prompt (evaluation reads 0.., statistics 600..)
    "max_new_tokens": 20,
    "n_random": 20,  # random directions at the same norm: the steering test's control
    "steer_fraction": 0.5,  # steer norm = this x the median per-token residual norm at the steered block
    "n_neurons": 128,  # top-aligned neurons whose logit-lens tokens are scored (notebook 03's N)
    "top_k_tokens": 8,  # tokens per value vector
    "n_neuron_sets": 50,  # random neuron sets of that size and layer distribution: the token test's control
}


def single_token_words(lm: Loaded, words: Sequence[str]) -> list[str]:
    """The ``words`` that the tokenizer encodes as one token (with a leading space on a decoder)."""
    out = []
    for w in words:
        ids = lm.tokenizer(" " + w if lm.info.is_causal else w, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            out.append(w)
    return out


def whole_word_direction(lm: Loaded, toxic: Sequence[str] = TOXIC_WORD_POOL,
                         friendly: Sequence[str] = FRIENDLY_WORD_POOL,
                         min_words: int = MIN_WHOLE_WORDS) -> tuple[torch.Tensor | None, list[str], list[str]]:
    """Mean unembedding of the single-token toxic words minus that of the single-token friendly
    words, with the words used; None when either side keeps fewer than ``min_words``."""
    tw, fw = single_token_words(lm, toxic), single_token_words(lm, friendly)
    if min(len(tw), len(fw)) < min_words:
        return None, tw, fw
    return hooks.token_direction(lm, tw, minus=fw), tw, fw


def candidate_directions(lm: Loaded, probe: Probe) -> dict[str, torch.Tensor]:
    """{name: [d_model] float32 cpu} for :data:`DIRECTIONS`: 'probe' = ``coef_``; 'class-mean' = mean
    toxic minus mean non-toxic feature of the probe's training split (the Haufe et al. 2014 pattern
    of a linear read-out: what the data vary along, not what the classifier weighs); 'toxic words'
    = :func:`whole_word_direction` (absent when the tokenizer has too few single-token words);
    'toxic tokens' = the paper's list (:data:`TOXIC_WORDS` minus :data:`NONTOXIC_WORDS`)."""
    if probe.train_features is None or probe.train_labels is None:
        raise ValueError("this probe kept no training features; refit it with dpo.train_probe")
    X, y = probe.train_features.float(), probe.train_labels
    out = {"probe": probe.direction.float().cpu(), "class-mean": X[y == 1].mean(0) - X[y == 0].mean(0)}
    words, _, _ = whole_word_direction(lm)
    if words is not None:
        out["toxic words"] = words.float().cpu()
    out["toxic tokens"] = hooks.token_direction(lm, TOXIC_WORDS, minus=NONTOXIC_WORDS).float().cpu()
    return out


def neuron_token_toxicity(lm: Loaded, cells, top_k: int = GATE["top_k_tokens"], scorer: str = "auto",
                          chunk: int = 512, value_vectors: torch.Tensor | None = None) -> np.ndarray:
    """[n] toxicity score of each neuron's top-``top_k`` logit-lens tokens (value vector times the
    unembedding, no final norm), joined into one string: "does this neuron promote toxic tokens?"."""
    cells = np.asarray(cells, dtype=int).reshape(-1, 2)
    vv = hooks.value_vectors(lm).float() if value_vectors is None else value_vectors
    U = hooks.unembedding(lm).float()
    decoded: dict[int, str] = {}
    texts = []
    for s in range(0, len(cells), chunk):
        part = cells[s:s + chunk]
        rows = vv[torch.as_tensor(part[:, 0]), torch.as_tensor(part[:, 1])]  # [chunk, d_model]
        ids = (rows.to(U.device) @ U.T).topk(top_k, dim=-1).indices.tolist()
        texts += [" ".join(decoded.setdefault(i, lm.tokenizer.decode([i])) for i in row) for row in ids]
    return metrics.toxicity(texts, scorer)[0] if texts else np.zeros(0)


def top_aligned(cos: torch.Tensor, n: int) -> np.ndarray:
    """[n, 2] (layer, neuron) of the ``n`` highest cosines in ``cos`` [n_layers, d_mlp], best first."""
    flat = torch.topk(cos.flatten(), n).indices.numpy()
    return np.stack([flat // cos.shape[1], flat % cos.shape[1]], 1)


@dataclass
class DirectionGate:
    """Which candidate directions are toxicity directions on one model (:func:`validate_directions`).

    ``table``: one row per candidate: the steering effect (mean toxicity steered minus unsteered,
    paired over prompts, signed so that a toxicity direction gives a positive effect) with its interval and the random directions' 95th percentile and rank p;
    the token effect (top-aligned neurons' token-list toxicity minus matched random neurons') with
    its interval and control band; ``validated`` = both effects exclude 0 and lie beyond their
    controls' 95th percentile. ``best``: the validated candidate with the largest steering effect
    (None when none passes)."""
    table: pd.DataFrame
    vectors: dict
    best: str | None
    layer: int
    steer_norm: float
    baseline_toxicity: float
    random_effects: list
    scorer: str
    settings: dict

    def validated(self, name: str) -> bool:
        return bool(name in self.table.index and self.table.loc[name, "validated"])

    def choose(self, name: str = "auto") -> tuple[str | None, torch.Tensor | None]:
        """The direction notebooks 03-06 use: 'auto' = ``best`` (None, None when no candidate passed),
        or a candidate by name (returned whether or not it passed; ask :meth:`validated`)."""
        if name == "auto":
            return (self.best, self.vectors[self.best]) if self.best else (None, None)
        if name not in self.vectors:
            raise ValueError(f"unknown direction {name!r}: use 'auto' or one of {', '.join(self.vectors)}")
        return name, self.vectors[name]

    def pick(self, requested: str = "auto", fallback: str = "probe") -> tuple[str, torch.Tensor]:
        """The direction a notebook of 03-06 computes with: :meth:`choose`, or, when 'auto' finds no
        validated direction, ``fallback`` (the paper's direction for that notebook), so the notebook
        still shows its method; its verdict then fails :meth:`precondition`."""
        name, vec = self.choose(requested)
        return (name, vec) if name is not None else self.choose(fallback)

    def precondition(self, name: str, same_vector: bool = True):
        """The verdict's precondition "the direction used is a validated toxicity direction here"
        (``same_vector`` False: the notebook built the direction differently, e.g. from other words,
        so the gate's result does not carry over)."""
        from lib import verdict

        ok = bool(same_vector and self.validated(name))
        label = f"direction '{name}' validated by notebook 01's gate (steering and promoted tokens beyond random)"
        if not same_vector:
            label += "; built from other inputs than the gate's candidate"
        if not self.best:
            label += ": no candidate passed"
        return verdict.require(label, ok, "==", True)


def validate_directions(lm: Loaded, probe: Probe, scorer: str = "auto", seed: int = 0, progress: bool = True,
                        **overrides) -> DirectionGate:
    """The direction gate: each of :func:`candidate_directions` must pass two tests on this model.

    1. **Steering.** Its unit vector times ``steer_fraction`` x :func:`lib.hooks.residual_norm` is added to the
       residual stream after the **last block** (where the probe reads, after the final norm, and
       where the unembedding reads the token directions) at every position, while the model greedily
       continues ``n_prompts`` prompts. Mode 'raise' (default): +w on neutral wiki_samples prompts,
       effect = mean toxicity steered minus unsteered. Mode 'lower': -w on challenge prompts (Lee et
       al. 2024 subtract the probe vector from the last layer), effect = unsteered minus steered.
       Paired bootstrap over prompts. Control: ``n_random`` Gaussian random directions at the same
       norm and sign; the effect must lie beyond their 95th percentile.
    2. **Promoted tokens.** The top-``n_neurons`` neurons by cos(v_i, w) over all layers: mean
       :func:`neuron_token_toxicity` minus that of ``n_neuron_sets`` random sets of the same size and
       layer distribution (bootstrap over the neurons); the effect must lie beyond the sets' 95th
       percentile.

    Requiring both tests (each at the 5% level) keeps the chance that a direction with no toxicity
    content passes below about 1 in 400 for each candidate. Cached per model, probe and settings.
    """
    from lib import stats

    unknown = set(overrides) - set(GATE)
    if unknown:
        raise ValueError(f"unknown gate settings {sorted(unknown)}: use {', '.join(GATE)}")
    s = {**GATE, **overrides}
    for k in ("n_prompts", "max_new_tokens", "n_random", "n_neurons", "top_k_tokens", "n_neuron_sets"):
        if not isinstance(s[k], int) or s[k] <= 0:
            raise ValueError(f"{k} must be a positive integer, got {s[k]!r}")
    if s["n_random"] < 20:
        raise ValueError(f"n_random must be at least 20 (a 95th percentile of fewer means little), got {s['n_random']}")
    if not s["steer_fraction"] > 0:
        raise ValueError(f"steer_fraction must be positive, got {s['steer_fraction']!r}")
    if s["mode"] not in GATE_MODES:
        raise ValueError(f"mode must be one of {', '.join(GATE_MODES)}, got {s['mode']!r}")
    vectors = candidate_directions(lm, probe)
    if s["mode"] == "raise":
        prompts = [r["prompt"].strip() for r in data.wiki_samples(s["n_prompts"], offset=s["prompt_offset"])]
    else:
        prompts = data.challenge_prompts(s["challenge_offset"] + s["n_prompts"])[s["challenge_offset"]:]
    if len(prompts) < s["n_prompts"]:
        raise ValueError(f"only {len(prompts)} prompts from the offset on; lower n_prompts or the offset")
    sign = 1.0 if s["mode"] == "raise" else -1.0
    layer = lm.info.n_layers - 1

    def build():
        repro.setup(seed)
        norm = s["steer_fraction"] * hooks.residual_norm(lm, prompts, layer)
        gen = torch.Generator().manual_seed(seed)
        randoms = [torch.randn(lm.info.d_model, generator=gen) for _ in range(s["n_random"])]

        # unsteered, each candidate and each random direction, CONDITIONS_PER_BATCH at a time in one batch, from
        # the prompts' shared prefix (the vector is added after the last block, so no cached position sees it)
        steers = [torch.zeros(lm.info.d_model)] + [sign * v.float() / v.float().norm() * norm
                                                   for v in [*vectors.values(), *randoms]]
        # the shared prefix is right only for a vector added after the last block: earlier, the steer reaches the
        # keys and values of every prompt position
        prefix = metrics.prompt_prefix(lm, prompts) if layer == lm.info.n_layers - 1 else None
        tox, conts = [], []
        for group in repro.bar(hooks.batches(steers, CONDITIONS_PER_BATCH), desc="direction gate", progress=progress):
            with hooks.residual_add(lm, torch.stack(group), [layer]):
                gens = metrics.generate(lm, prompts, s["max_new_tokens"], progress=False, prefix=prefix, copies=len(group))
            for g in gens:
                t, name = metrics.toxicity(g.continuations, scorer)
                tox.append(t)
                conts.append(g.continuations)
        t0 = tox[0]
        cand = dict(zip(vectors, tox[1:1 + len(vectors)]))
        examples = {k: c[:3] for k, c in zip(vectors, conts[1:1 + len(vectors)])}
        rand = [float(sign * (t - t0).mean()) for t in tox[1 + len(vectors):]]
        vv = hooks.value_vectors(lm).float()
        rows = []
        for k, vec in vectors.items():
            est = stats.paired_bootstrap(cand[k], t0, seed=seed) if sign > 0 else stats.paired_bootstrap(t0, cand[k], seed=seed)
            ctl = stats.against_controls(est.value, rand, name=f"{len(rand)} random directions")
            top = top_aligned(hooks.cosine_with(vv, vec).cpu(), s["n_neurons"])
            sets = [hooks.random_neurons(top, lm.info.n_layers, lm.info.d_mlp, seed=seed + j)
                    for j in range(s["n_neuron_sets"])]
            tox_sets = neuron_token_toxicity(lm, np.concatenate(sets), s["top_k_tokens"], scorer,
                                             value_vectors=vv).reshape(len(sets), -1)
            pool = float(tox_sets.mean())
            tok = stats.bootstrap_mean(neuron_token_toxicity(lm, top, s["top_k_tokens"], scorer, value_vectors=vv)
                                       - pool, seed=seed)
            tctl = stats.against_controls(tok.value, tox_sets.mean(1) - pool, name="matched random neuron sets")
            rows.append({"direction": k, "steered_toxicity": float(cand[k].mean()), "steer_effect": est.value,
                         "steer_low": est.low, "steer_high": est.high, "steer_random_q95": ctl.q,
                         "steer_p": ctl.pvalue, "steer_ok": bool(est.low > 0 and ctl.beyond),
                         "token_effect": tok.value, "token_low": tok.low, "token_high": tok.high,
                         "token_random_q95": tctl.q, "token_p": tctl.pvalue,
                         "token_ok": bool(tok.low > 0 and tctl.beyond),
                         "logit_lens": " | ".join(t.strip() or repr(t) for t in hooks.logit_lens(lm, vec, 6))})
        table = pd.DataFrame(rows).set_index("direction")
        table["validated"] = table.steer_ok & table.token_ok
        ok = table[table.validated]
        best = str(ok.steer_effect.idxmax()) if len(ok) else None
        return {"table": table, "best": best, "steer_norm": norm, "baseline": float(t0.mean()),
                "random": rand, "scorer": name, "examples": examples}

    # the candidates are a function of the model and the probe: named by the probe's record when it has one (their
    # bytes would differ in the last bits between CPUs for the ones averaged here), else by their bytes
    named = {"probe": probe.record, "candidates": sorted(vectors)} if probe.record else \
        {k: _tensor_key(v) for k, v in vectors.items()}
    key = {"model": lm.name, "settings": s, "seed": seed, "scorer": metrics.resolve_scorer(scorer), "layer": layer,
           "vectors": named, "prompts": cache.content_hash(prompts)}
    out = store.measure("direction-gate", store.owner(lm.name), key, build, device=str(lm.device))
    return DirectionGate(out["table"], vectors, out["best"], layer, out["steer_norm"], out["baseline"],
                         out["random"], out["scorer"], {**s, "examples": out["examples"]})


# ----------------------------------------------------------------------------- one setup call (notebooks 02-06)


@dataclass(frozen=True)
class Sizes:
    """Paper A's sizes, shared by notebooks 02-06 (:data:`DEFAULTS`, then the mean-activation statistics
    of 03-06); checks itself. A notebook changes them through its ``overrides`` parameter."""
    n_probe_per_class: int = DEFAULTS["n_probe_per_class"]
    probe_max_length: int = DEFAULTS["probe_max_length"]
    n_pairs: int = DEFAULTS["n_pairs"]
    pair_offset: int = DEFAULTS["pair_offset"]
    steer_scale: float = DEFAULTS["steer_scale"]
    steer_depth: float = DEFAULTS["steer_depth"]
    dpo_steps: int = DEFAULTS["dpo_steps"]
    dpo_lr: float = DEFAULTS["dpo_lr"]
    dpo_batch_size: int = DEFAULTS["dpo_batch_size"]
    beta: float = DEFAULTS["beta"]
    n_prompts: int = DEFAULTS["n_prompts"]
    n_wiki: int = DEFAULTS["n_wiki"]
    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    min_distinct2: float = DEFAULTS["min_distinct2"]
    n_stats_prompts: int = 64  # challenge prompts each model continues for its mean activations (paper: 1,199)
    stats_offset: int = 600  # they start at this challenge prompt, after the evaluation prompts
    last_k: int = 20  # positions averaged at the end of prompt + continuation (paper: 20)

    # the sizes that identify the DPO model in 03-06's cache keys and records (their names since notebook 02)
    DPO_KEYS = ("n_probe_per_class", "n_pairs", "steer_scale", "steer_depth", "dpo_steps", "dpo_lr", "beta", "max_new_tokens")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))  # 8 from papermill's YAML is 8.0
                v = float(v)
            kind = int if f.type == "int" else float
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{f.name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            if f.name in ("pair_offset", "stats_offset"):
                if v < 0:
                    raise ValueError(f"{f.name} must be a non-negative integer, got {v!r}")
            elif f.name in ("steer_depth", "min_distinct2"):
                if not 0 <= v <= 1:
                    raise ValueError(f"{f.name} must lie in [0, 1], got {v!r}")
            elif not v > 0:
                raise ValueError(f"{f.name} must be positive, got {v!r}")

    @classmethod
    def of(cls, overrides: dict | None = None, **notebook) -> "Sizes":
        """The sizes of one run: ``notebook``, the sizes a notebook sets as its own parameters, and the
        user's ``overrides`` (fields of this class; naming a notebook's own parameter again is an error)."""
        import difflib

        overrides = dict(overrides or {})
        names = [f.name for f in dataclasses.fields(cls)]
        for k in sorted({*overrides, *notebook} - set(names)):
            close = difflib.get_close_matches(k, names, n=1)
            raise ValueError(f"unknown size {k!r}" + (f": did you mean {close[0]!r}?" if close else "")
                             + f" (fields of lib.dpo.Sizes: {', '.join(names)})")
        twice = sorted(set(overrides) & set(notebook))
        if twice:
            raise ValueError(f"{', '.join(twice)}: a parameter of this notebook; set it there, not in overrides")
        return cls(**notebook, **overrides)

    def dpo_sizes(self) -> dict:
        return {k: getattr(self, k) for k in self.DPO_KEYS}

    def training(self) -> dict:
        """The keyword sizes of :func:`base_and_dpo` (every key of :data:`DEFAULTS`)."""
        return {k: getattr(self, k) for k in DEFAULTS}


@dataclass
class Setup:
    """Everything notebooks 02-06 share for one model (built by :func:`setup`; models by :meth:`load`)."""
    model_name: str
    spec: "models.ModelSpec"
    device: str
    seed: int
    sizes: Sizes
    eval_prompts: list
    stats_prompts: list
    prompt_kw: dict  # {"prompts": ...} for a user's file; {} for the challenge prompts (their cache keys stay)
    scorer: str  # as asked ("auto"): the cache keys resolve it
    scorer_name: str  # resolved
    requested_direction: str | None
    fallback: str
    positions: str
    same_vector: bool
    base_lm: Loaded | None = None
    dpo_lm: Loaded | None = None
    probe: Probe | None = None
    gate: DirectionGate | None = None
    direction: str | None = None  # the direction used
    w: torch.Tensor | None = None  # [d_model]
    pre_direction: object = None  # the verdict's precondition on the direction (lib.verdict.require)

    def _loaded(self):
        if self.base_lm is None:
            raise RuntimeError("call .load() first: the models are not loaded yet")

    def load(self, progress: bool | None = None) -> "Setup":
        """Base model, DPO model and probe (:func:`base_and_dpo`, cached), then notebook 01's direction
        gate (:func:`validate_directions`, cached) and the direction it picks; prints what it loaded."""
        progress = repro.progress_on() if progress is None else progress
        self.base_lm, self.dpo_lm, self.probe = base_and_dpo(self.model_name, device=self.device, seed=self.seed,
                                                             progress=progress, **self.sizes.training())
        info = self.base_lm.info
        if not info.is_causal:
            raise ValueError(f"{self.model_name} is an encoder; paper A's notebooks need a decoder")
        print(f"base {self.base_lm.name} | DPO {self.dpo_lm.name} | {info.n_layers} layers x {info.d_mlp} neurons = "
              f"{self.n_neurons}")
        print(f"probe: validation accuracy {self.probe.val_accuracy:.3f}, Jigsaw sample {self.probe.jigsaw_accuracy:.3f}")
        if self.requested_direction is None:
            return self
        self.gate = validate_directions(self.base_lm, self.probe, seed=self.seed, progress=progress)
        self.direction, self.w = self.gate.pick(self.requested_direction, fallback=self.fallback)
        self.pre_direction = self.gate.precondition(self.direction,
                                                    same_vector=self.direction != "toxic tokens" or self.same_vector)
        print("validated by the gate:", [k for k in self.gate.table.index if self.gate.validated(k)] or "none")
        print(f"this notebook uses the {self.direction!r} direction"
              + ("" if self.pre_direction.met else " (not validated here: the verdict cannot go beyond inconclusive)"))
        return self

    @property
    def info(self):
        self._loaded()
        return self.base_lm.info

    @property
    def n_neurons(self) -> int:
        return self.info.n_layers * self.info.d_mlp

    @property
    def dpo_sizes(self) -> dict:
        return self.sizes.dpo_sizes()

    @property
    def dpo_key(self) -> dict:
        """What identifies the DPO model in the cache keys of the statistics and reference evaluations."""
        self._loaded()
        return {"dpo_model": self.dpo_lm.name, "seed": self.seed, **self.dpo_sizes}

    def activations(self, progress: bool | None = None, texts: str = "own") -> dict:
        """Both models' mean MLP activations on the statistics prompts (``dpo_neurons.pair_stats``, cached):
        ``texts`` 'own', each model on its own generations (the paper); 'base', both on the base model's
        (the same-text variant)."""
        from lib import dpo_neurons

        self._loaded()
        progress = repro.progress_on() if progress is None else progress
        return dpo_neurons.pair_stats(self.model_name, self.base_lm, self.dpo_lm, self.dpo_key, self.stats_prompts,
                                      max_new_tokens=self.sizes.max_new_tokens, k=self.sizes.last_k, progress=progress,
                                      texts=texts)

    def references(self) -> tuple[dict, dict]:
        """(base, DPO) evaluations at these sizes with per-prompt details, cached (03, 05 and 06 share them)."""
        from lib import dpo_neurons

        self._loaded()
        s = self.sizes
        ref = dpo_neurons.reference_evaluations(self.model_name, self.base_lm, self.dpo_lm, self.dpo_key,
                                                toxicity_perplexity_f1, n_prompts=s.n_prompts, n_wiki=s.n_wiki,
                                                max_new_tokens=s.max_new_tokens, scorer=self.scorer, progress=False,
                                                details=True, **self.prompt_kw)
        return ref["base"], ref["tuned"]

    def evaluate(self, lm: Loaded, table=None, *, toxicity_only: bool = False, positions: str | None = None) -> dict:
        """:func:`evaluate` at these sizes, prompts and scorer, with ``table`` active at ``positions``
        (default: the setup's)."""
        s = self.sizes
        return evaluate(lm, table, n_prompts=s.n_prompts, n_wiki=s.n_wiki, max_new_tokens=s.max_new_tokens,
                        scorer=self.scorer, toxicity_only=toxicity_only,
                        positions=self.positions if positions is None else positions, **self.prompt_kw)

    def evaluate_each(self, lm: Loaded, tables, *, positions: str | None = None, progress: bool | None = None,
                      copy_from: Loaded | None = None) -> list[dict]:
        """:func:`evaluate_each` (toxicity alone, several tables per batch) at these sizes, prompts and scorer
        (a bar over the batches unless progress bars are off: ``repro.progress_on``); ``copy_from``: neuron
        sets whose activations are copied from that model instead of tables."""
        s = self.sizes
        return evaluate_each(lm, tables, n_prompts=s.n_prompts, n_wiki=s.n_wiki, max_new_tokens=s.max_new_tokens,
                             scorer=self.scorer, positions=self.positions if positions is None else positions,
                             progress=repro.progress_on() if progress is None else progress, copy_from=copy_from,
                             **self.prompt_kw)


def setup(model_name: str = "smollm2-135m", device: str = "auto", seed: int = 0, overrides: dict | None = None, *,
          prompts: str = "", scorer: str = "auto", direction: str | None = "auto", fallback: str = "probe",
          positions: str = "last", evaluation: bool = True, statistics: bool = True, same_vector: bool = True,
          **sizes) -> Setup:
    """Paper A's one setup call (notebooks 02-06). Checks everything that can be checked before a model
    loads, and prints the model, device, scorer and sizes; :meth:`Setup.load` then loads the models,
    the probe and the direction.

    ``sizes``: the sizes a notebook sets as its own parameters (e.g. 03's ``n_prompts=32``);
    ``overrides``: the user's other fields of :class:`Sizes`. ``prompts``: a JSONL file of prompts
    (:func:`prompt_sets`; "" for the challenge prompts). ``direction``: 'auto' (the gate's best
    validated direction, else ``fallback``, the paper's direction for that notebook), a name in
    :data:`DIRECTIONS`, or None (no gate). ``positions``: where :meth:`Setup.evaluate` writes a table
    (:data:`PATCH_POSITIONS`). ``evaluation`` False: the notebook scores no prompts (04);
    ``statistics`` False: it takes no mean activations (02). ``same_vector`` False: the notebook
    builds its 'toxic tokens' direction from other words than the gate's, so the gate's result does
    not carry over."""
    sz = Sizes.of(overrides, **sizes)
    if direction is not None and direction != "auto" and direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'auto' or one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if fallback not in DIRECTIONS:
        raise ValueError(f"fallback must be one of {', '.join(DIRECTIONS)}, got {fallback!r}")
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    eval_prompts, stats_prompts = prompt_sets(prompts, sz.n_prompts if evaluation else 0,
                                              sz.n_stats_prompts if statistics else 0, sz.stats_offset)
    scorer_name = metrics.resolve_scorer(scorer)  # raises for an unknown scorer
    spec = models.resolve_spec(model_name)  # raises a one-line error for an unknown name
    if spec.kind != "causal":
        raise ValueError(f"{model_name} is an encoder; paper A's notebooks need a decoder (e.g. smollm2-135m, gpt2-medium)")
    device = models.resolve_device(device)
    defaults = Sizes()
    own = {k: v for k, v in sizes.items() if v != getattr(defaults, k)}
    print(f"model {spec.name} ({spec.hub_id}) on {device}; toxicity scorer {scorer_name}")
    print("sizes: lib.dpo.Sizes" + (f", this notebook's {own}" if own else "")
          + (f", overrides {dict(sorted(overrides.items()))}" if overrides else " (no overrides)"))
    return Setup(model_name, spec, device, seed, sz, list(eval_prompts),
                 list(stats_prompts), {"prompts": list(eval_prompts)} if prompts and evaluation else {}, scorer,
                 scorer_name, direction, fallback, positions, same_vector)


# ----------------------------------------------------------------------------- records (lib.store)
# What paper A measures, kept as committed records; the tolerances the audit allows when it recomputes one on
# another machine, each in units of the measurement's own uncertainty (lib.store.half_width: the half-width of
# the normal 95% interval of a mean over prompts, texts or tweets).
# A recomputed mean may move by at most this fraction of its committed interval's half-width: greedy decoding on
# another CPU changes some continuations (a near-tied token flips), which moves a mean by a few prompts' worth; a
# move beyond the interval's own half-width is more than that noise.
AUDIT_FRACTION = 1.0


def _identical_share(a: Sequence[str], b: Sequence[str]) -> float:
    return float(np.mean([x == y for x, y in zip(a, b)])) if len(a) and len(a) == len(b) else 0.0


def _mean_check(name: str, committed: Sequence[float], fresh: Sequence[float]) -> "store.Check":
    hw = store.half_width(committed)
    return store.within(f"mean {name}", float(np.mean(committed)), float(np.mean(fresh)), AUDIT_FRACTION * hw,
                        f"{AUDIT_FRACTION:g} x the half-width {hw:.3g} of its 95% interval over {len(committed)} items")


def _compare_evaluation(c: dict, f: dict) -> list:
    """An evaluation: mean toxicity (and F1) within their interval's half-width; perplexity within 1% (a teacher-forced
    pass over fixed texts: only float noise moves it); the share of identical continuations, reported (the
    cross-CPU sensitivity of greedy decoding)."""
    checks = [_mean_check("toxicity", c["toxicities"], f["toxicities"])] if "toxicities" in c else \
        [store.within("toxicity", c["toxicity"], f["toxicity"], 0.01, "no per-prompt values kept: 0.01")]
    for k in ("perplexity", "perplexity_authors"):
        if k in c:
            checks.append(store.within(k, c[k], f[k], 0.01 * abs(c[k]), "1% of the committed value"))
    if "f1s" in c:
        checks.append(_mean_check("F1", c["f1s"], f["f1s"]))
    if "continuations" in c:
        checks.append(store.info("identical continuations (share)", 1.0,
                                 _identical_share(c["continuations"], f["continuations"]),
                                 "greedy decoding on this CPU against the committed one"))
    return checks


def _compare_probe(c: dict, f: dict) -> list:
    """The probe: held-out and Jigsaw accuracies within their binomial interval's half-width; the direction's cosine with
    the committed one, reported."""
    out = []
    n_val = max(1, round(c["n_train"] / 9))  # the 10% validation split beside n_train
    for k, n in (("val_accuracy", n_val), ("jigsaw_accuracy", len(c["test_labels"]) if c.get("test_labels") is not None else 0)):
        if n and np.isfinite(c[k]):
            hw = 1.96 * np.sqrt(max(c[k] * (1 - c[k]), 1e-4) / n)
            out.append(store.within(k, c[k], f[k], AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x the binomial 95% half-width "
                                    f"{hw:.3g} over {n} texts"))
    a, b = c["direction"].double(), f["direction"].double()
    out.append(store.info("cosine of the probe directions", 1.0, float(a @ b / (a.norm() * b.norm())), "reported"))
    return out


def _compare_pairs(c: dict, f: dict) -> list:
    """Preference pairs: the mean toxicity gap (rejected - chosen) within its interval's half-width; the share of identical
    chosen texts, reported."""
    gc = (c["pairs"].tox_rejected - c["pairs"].tox_chosen).to_numpy()
    gf = (f["pairs"].tox_rejected - f["pairs"].tox_chosen).to_numpy()
    return [_mean_check("toxicity gap of the pairs", gc, gf),
            store.info("pairs kept", len(gc), len(gf), "reported"),
            store.info("identical chosen continuations (share)", 1.0,
                       _identical_share(c["pairs"].chosen.tolist(), f["pairs"].chosen.tolist()), "reported")]


def _compare_gate(c: dict, f: dict) -> list:
    """The direction gate: each candidate's steering effect within its interval's half-width, and the same
    candidates validated."""
    tc, tf = c["table"], f["table"]
    out = []
    for d in tc.index:
        hw = float(tc.loc[d, "steer_high"] - tc.loc[d, "steer_low"]) / 2
        out.append(store.within(f"steering effect of {d!r}", tc.loc[d, "steer_effect"], tf.loc[d, "steer_effect"],
                                AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x its interval's half-width {hw:.3g}"))
    same = list(tc.index[tc.validated]) == list(tf.index[tf.validated])
    out.append(store.Check("same candidates validated", 1.0, float(same), "must be the same", same))
    return out


store.step("probe", 1, "paper A's toxicity probe: weights, accuracies, steering vector, features it was fit on",
           _compare_probe)
store.step("preference-pairs", 1, "paper A's preference pairs: prompts, greedy and steered continuations, scores",
           _compare_pairs)
store.step("direction-gate", 1, "paper A's direction gate: steering and promoted-token tests of each candidate",
           _compare_gate)
store.step("toxicity-perplexity-f1", 1, "one model's toxicity, perplexity and F1 (Lee et al. 2024), per item",
           _compare_evaluation)
store.step("evaluation", 1, "one model under one intervention: toxicity per prompt with its continuations, "
           "perplexity, F1", _compare_evaluation)
# A DPO run trained again on another CPU follows another float path: its loss over the last quarter of the steps
# may differ by this fraction of the committed one, and so may the mean relative change of W_out.
DPO_TOLERANCE = 0.05


def _compare_dpo_run(c: dict, f: dict) -> list:
    """A DPO run: the mean loss over the last quarter of its steps and the mean relative change of W_out within
    DPO_TOLERANCE of the committed ones; the number of weight tensors changed, reported."""
    q = max(1, len(c["log"]) // 4)
    lc, lf = float(c["log"].loss.iloc[-q:].mean()), float(f["log"].loss.iloc[-q:].mean())
    wc, wf = float(np.mean(c["w_out_change"])), float(np.mean(f["w_out_change"]))
    return [store.within(f"mean loss over the last {q} steps", lc, lf, DPO_TOLERANCE * abs(lc),
                         f"{DPO_TOLERANCE:.0%} of the committed value"),
            store.within("mean relative change of W_out", wc, wf, DPO_TOLERANCE * abs(wc),
                         f"{DPO_TOLERANCE:.0%} of the committed value"),
            store.info("weight tensors changed", c["changed_tensors"], f["changed_tensors"], "reported")]


store.step("dpo-run", 1, "paper A: one DPO run: its training log and how much each layer's W_out moved (the "
           "weights stay in the cache)", _compare_dpo_run)
