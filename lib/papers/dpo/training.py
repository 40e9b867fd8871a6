"""Paper A's DPO training with TRL, cached by model and sizes, and the base-plus-DPO pair of models."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from lib import metrics, models
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.dpo.pairs import _pairs_key, preference_pairs
from lib.papers.dpo.probe import Probe, train_probe
from lib.papers.dpo.sizes import TRAINING_KEYS, Sizes


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


def dpo_run(lm: Loaded, pairs: pd.DataFrame, steps: int = Sizes.dpo_steps, lr: float = Sizes.dpo_lr,
            beta: float = Sizes.beta, seed: int = 0, progress: bool = True,
            batch_size: int = Sizes.dpo_batch_size) -> DPORun:
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
    rec = store.measure("dpo-run", lm.records_name, params, build, device=str(lm.device), produces=name)
    model = models.LazyLoaded(dataclasses.replace(lm.spec, name=name, derived_from=lm.records_name), lm.device, lambda: _load_dpo(
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


def train_dpo(lm: Loaded, pairs: pd.DataFrame, steps: int = Sizes.dpo_steps, lr: float = Sizes.dpo_lr,
              beta: float = Sizes.beta, seed: int = 0, progress: bool = True,
              batch_size: int = Sizes.dpo_batch_size) -> tuple[Loaded, pd.DataFrame]:
    """:func:`dpo_run`'s model (named ``<base>-dpo-<key>``, loaded on first use) and training log."""
    run = dpo_run(lm, pairs, steps, lr, beta, seed, progress, batch_size)
    return run.model, run.log


HALFWAY = "halfway"  # the subfolder of a DPO run's cache folder with its weights after half the steps


def _dpo_params(lm: Loaded, pairs: pd.DataFrame, steps: int, lr: float, beta: float, seed: int, batch_size: int) -> dict:
    return {"pairs": _pairs_key(pairs), "steps": steps, "lr": float(lr), "beta": float(beta), "seed": seed,
            "batch_size": batch_size, "logps": "completions",  # positions scored: lib.papers.dpo._completion_positions_only
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
    dpo_lm.spec = dataclasses.replace(dpo_lm.spec, name=f"{lm.name}-dpo-{key}{suffix}", derived_from=lm.records_name)
    dpo_lm.info.name = dpo_lm.spec.name
    return dpo_lm


def dpo_halfway(lm: Loaded, pairs: pd.DataFrame, steps: int = Sizes.dpo_steps, lr: float = Sizes.dpo_lr,
                beta: float = Sizes.beta, seed: int = 0, progress: bool = True,
                batch_size: int = Sizes.dpo_batch_size) -> tuple[Loaded, pd.DataFrame]:
    """The run of :func:`dpo_run` with these arguments as it stood after ``steps // 2`` of its steps (kept in
    its cache folder; the run is trained first when it is not cached): the model (named ``...-halfway``, loaded
    on first use) and the first ``steps // 2`` rows of its log. Not the same as a run of ``steps // 2`` steps:
    the learning rate's warm-up is 10% of the whole run's steps."""
    run = dpo_run(lm, pairs, steps, lr, beta, seed, progress, batch_size)
    folder = _dpo_folder(lm, pairs, steps, lr, beta, seed, batch_size)
    model = models.LazyLoaded(dataclasses.replace(lm.spec, name=f"{run.model.name}-halfway", derived_from=lm.records_name), lm.device, lambda: _load_dpo(
        lm, _train_dpo(lm, pairs, steps, lr, beta, seed, progress, batch_size, folder) / HALFWAY, progress,
        suffix="-halfway"), path=folder / HALFWAY, device_map=lm.device_map)
    return model, run.log[run.log.step <= run.halfway].reset_index(drop=True)


def base_and_dpo(model_name: str, device: str = "auto", seed: int = 0, progress: bool = True,
                 device_map: str | dict | None = None, **sizes) -> tuple[Loaded, Loaded, Probe]:
    """Base model, DPO model and probe in one call, each from the cache when present, else built.
    ``device`` and ``device_map`` go to :func:`lib.models.load` (the DPO model follows the base);
    ``sizes`` override the defaults of :class:`~lib.papers.dpo.sizes.Sizes` (:data:`TRAINING_KEYS`; unknown keys raise)."""
    unknown = sorted(set(sizes) - set(TRAINING_KEYS))
    if unknown:
        raise ValueError(f"unknown size(s) {', '.join(unknown)}: use any of {', '.join(TRAINING_KEYS)}")
    cfg = {**{k: getattr(Sizes, k) for k in TRAINING_KEYS}, **sizes}
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


