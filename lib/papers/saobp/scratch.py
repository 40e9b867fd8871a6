"""Small models trained from scratch and fine-tuned encoders, for notebooks 08-10 (paper B).

The training toolkit around the reconstructed refinement of :mod:`lib.papers.saobp`: a synthetic two-hop QA
task, a compact vocabulary, randomly initialised BERT classifiers and Llama LMs of a few sizes
(:data:`SIZES`), encoders for classification and LM data, a training loop, evaluation, one cached
from-scratch run (:func:`scratch_run`; :func:`scratch_runs` builds many in worker processes; notebooks
07, 09 and 10, with notebook 10's recipe :data:`LM_RECIPE`) and one cached fine-tune of a pretrained
encoder with or without SAOBP (:func:`finetune`, notebook 08).

The training loop (:func:`train`) is a plain seeded AdamW loop, not ``transformers.Trainer``: the models
are tiny (1-4 layers) and train for a few hundred steps on one CPU, and the loop needs exactly three
things, which are a few lines each here and would each be an override or a callback in a Trainer: a
learning rate of its own for SAOBP's J (it barely moves at the model's), every forward pass inside
:func:`lib.papers.saobp.active` (the refinement and the eager attention function), and seeded random
mini-batches that both arms of a comparison share. Trainer's machinery (checkpointing, logging,
evaluation loops, distributed training, mixed precision) is not needed at this size. Each from-scratch
run trains on one CPU thread; two cores are used by running two at a time (:func:`scratch_runs`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import data, models
from lib.infra import cache, repro, store
from lib.papers.saobp.refinement import (DEFAULT_J, J_MODES, AttentionStats, active, attach, attention_stats, batches, depth_fall, get,
                                          no_cache, trim)

# ----------------------------------------------------------------------------- synthetic two-hop QA

NAMES = ["anna", "ben", "carl", "dora", "emil", "fay", "gus", "hana", "ivan", "jane", "karl", "lena",
         "max", "nina", "otto", "paul", "rosa", "sam", "tom", "uma", "vera", "walt", "yuri", "zoe"]
COLOURS = ["red", "blue", "green", "black", "white", "brown", "pink", "gray"]


def synthetic_multihop(n: int, seed: int = 0, chains: int = 3) -> pd.DataFrame:
    """A synthetic two-hop QA task as a classification DataFrame (text_a, text_b=None, label).

    Each example holds ``chains`` chains "X knows Y . Y likes C ." (facts shuffled) and asks
    "what does the friend of X like ?"; the label is the colour C of the queried chain (8 classes).
    One hop (X -> Y) is never enough: the colour is only linked to the intermediate Y."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        people = rng.sample(NAMES, 2 * chains)
        cols = rng.sample(range(len(COLOURS)), chains)
        facts = []
        for c in range(chains):
            x, y = people[2 * c], people[2 * c + 1]
            facts += [f"{x} knows {y} .", f"{y} likes {COLOURS[cols[c]]} ."]
        rng.shuffle(facts)
        q = rng.randrange(chains)
        rows.append({"text_a": " ".join(facts) + f" what does the friend of {people[2 * q]} like ?",
                     "text_b": None, "label": cols[q]})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- small models from scratch


@dataclass
class Vocab:
    """A compact vocabulary: the ``size`` most frequent token ids of a corpus plus special tokens."""
    mapping: torch.Tensor  # [original vocab] -> new id (unk for the rest)
    size: int
    unk: int
    pad: int

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mapping[ids]


def compact_vocab(tokenizer, id_lists: Sequence[Sequence[int]], size: int) -> Vocab:
    """Keep the tokenizer's special tokens and the ``size`` most frequent ids in ``id_lists``."""
    counts = np.bincount(np.concatenate([np.asarray(x, dtype=np.int64) for x in id_lists]), minlength=len(tokenizer))
    special = sorted({int(i) for i in tokenizer.all_special_ids})
    order = [int(i) for i in np.argsort(-counts, kind="stable") if counts[i] > 0 and int(i) not in special][:size]
    keep = special + order
    unk_old = tokenizer.unk_token_id
    unk = keep.index(unk_old) if unk_old in keep else len(keep)
    n = len(keep) + (0 if unk_old in keep else 1)
    mapping = torch.full((len(tokenizer),), unk, dtype=torch.long)
    mapping[torch.tensor(keep)] = torch.arange(len(keep))
    pad_old = tokenizer.pad_token_id
    return Vocab(mapping, n, unk, int(mapping[pad_old]) if pad_old is not None else unk)


SIZES = {"tiny": (2, 128), "small": (4, 256), "mini": (1, 64), "narrow": (4, 64), "wide": (1, 128),
         "deep": (6, 64), "deeper": (8, 64)}  # name -> (layers, d_model)

# The from-scratch LM recipe of notebook 10 (its parameters cell holds the same literals, checked by a
# test), shared with notebook 07's from-scratch baselines so that both read one cached run per size,
# seed and arm. Chosen from baseline-only probes (notebook 10 states the history): every size learns (dev
# perplexity about half the unigram bar), and the 6-layer 'deep' baseline's deep-layer entropy falls
# below its first layers' with training (07's statistic, mean over 10 seeds: +0.16 at step 100, +0.03 at
# 250, -0.08 at 400).
LM_RECIPE = dict(task="LM", steps=400, batch_size=16, max_length=32, lr=2e-3, vocab_size=1000, curve_every=50)


# Notebook 07's search for a from-scratch setting whose baseline collapses (what notebook 10's finding 2 needs):
# LM_RECIPE's baselines at these sizes, trained ``steps`` steps on exploration seeds kept apart from every
# confirmation seed, with the attention statistics every ``curve_every`` steps. A run's statistics after N steps
# are those of an N-step run (the same batches, no learning-rate schedule), so one run per size and seed covers
# every length in ``at``. :func:`collapse_search` applies the rule.
COLLAPSE_SEARCH = dict(sizes=("deep", "deeper"), seeds=(100, 101, 102), steps=1600, curve_every=100, at=(400, 800, 1200, 1600))


def collapse_search(fall: float = -0.05, progress: bool = False) -> tuple[pd.DataFrame, tuple[str, int] | None]:
    """The search of :data:`COLLAPSE_SEARCH`: one row per size, exploration seed and length in ``at`` with
    07's statistic (last third minus first third of the layers' normalised entropy) and the same with the
    attention sink removed, and the chosen setting (size, steps): the cheapest (layers x steps) in which every
    exploration seed's statistic is at most ``fall`` with and without the sink; None when no setting qualifies."""
    cs = COLLAPSE_SEARCH
    configs = [dict(LM_RECIPE, size=s, seed=sd, variant="baseline", steps=cs["steps"], curve_every=cs["curve_every"])
               for s in cs["sizes"] for sd in cs["seeds"]]
    rows = []
    for c, r in zip(configs, scratch_runs(configs, progress=progress, desc="collapse search")):
        for point in r["curve"]:
            if point["step"] in cs["at"]:
                rows.append({"size": c["size"], "layers": SIZES[c["size"]][0], "seed": c["seed"], "steps": point["step"],
                             "fall": float(depth_fall(np.array(point["entropy_norm"]))),
                             "fall without sink": float(depth_fall(np.array(point["entropy_norm_nosink"])))})
    table = pd.DataFrame(rows)
    ok = (table.groupby(["size", "layers", "steps"])[["fall", "fall without sink"]].max() <= fall).all(axis=1)
    good = sorted((layers * steps, size, steps) for (size, layers, steps), yes in ok.items() if yes)
    return table, ((good[0][1], int(good[0][2])) if good else None)


def size_order(names: Sequence[str]) -> list[str]:
    """Size names from the smallest model up (layers x d_model^2, the blocks' weight count up to a constant)."""
    return sorted(names, key=lambda s: (SIZES[s][0] * SIZES[s][1] ** 2, SIZES[s]))


def small_model(family: str, n_layers: int, d_model: int, vocab: Vocab, tokenizer, num_labels: int | None = None,
                seed: int = 0, max_positions: int = 128, head_dim: int = 32, saobp: str | None = None,
                J: float = DEFAULT_J, j_mode: str = "repulsive") -> models.Loaded:
    """A randomly initialised BERT classifier (``num_labels``) or Llama LM (``num_labels=None``).

    saobp: None (plain), 'learnable' (J per head, starts at ``J``) or 'fixed' (J held at ``J``);
    j_mode: 'repulsive' (J = -softplus(theta), needs J < 0) or 'free' (see :func:`lib.papers.saobp.attach`).
    """
    import transformers as tf

    if family not in ("bert", "llama"):
        raise ValueError(f"small_model family must be 'bert' or 'llama', got {family!r}")
    if saobp not in (None, "learnable", "fixed"):
        raise ValueError(f"saobp must be None, 'learnable' or 'fixed', got {saobp!r}")
    heads = max(1, d_model // head_dim)
    common = dict(vocab_size=vocab.size, hidden_size=d_model, num_hidden_layers=n_layers,
                  num_attention_heads=heads, intermediate_size=4 * d_model, max_position_embeddings=max_positions,
                  pad_token_id=vocab.pad)
    torch.manual_seed(seed)
    if family == "bert":
        cfg = tf.BertConfig(num_labels=num_labels or 2, **common)
        cfg._attn_implementation = "eager"
        model = tf.BertForSequenceClassification(cfg)
        kind = "encoder"
    else:
        cfg = tf.LlamaConfig(num_key_value_heads=heads, tie_word_embeddings=True, **common)
        cfg._attn_implementation = "eager"
        model = tf.LlamaForCausalLM(cfg)
        kind = "causal"
    name = f"scratch-{family}-{n_layers}x{d_model}"
    spec = models.ModelSpec(name, name, kind, "random")
    lm = models.Loaded(model, tokenizer, models.info_from_model(model, name), spec, "cpu", None)
    if saobp is not None:
        attach(lm, J=J, learnable=saobp == "learnable", mode=j_mode)
    return lm


def encode_classification(tokenizer, df: pd.DataFrame, max_length: int, vocab: Vocab | None = None) -> dict:
    """Tokenise (text_a[, text_b]) pairs with right padding and truncation; labels included."""
    a = df["text_a"].astype(str).tolist()
    b = None if df["text_b"].isna().all() else df["text_b"].fillna("").astype(str).tolist()
    enc = tokenizer(a, b, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if "token_type_ids" in enc:
        out["token_type_ids"] = enc["token_type_ids"]
    if vocab is not None:
        out["input_ids"] = vocab(out["input_ids"])
    out["labels"] = torch.tensor(df["label"].to_numpy(), dtype=torch.long)
    return out


def encode_matched(tokenizer, df: pd.DataFrame, length: int, n: int) -> dict:
    """The first ``n`` rows of ``df`` that fill all ``length`` tokens (special tokens included) once
    truncated to it: every example of the result has exactly ``length`` real tokens (notebook 09's
    matched-length comparison). Fewer rows when fewer are long enough."""
    enc = encode_classification(tokenizer, df, length)
    full = torch.nonzero(enc["attention_mask"].sum(1) == length).flatten()[:n]
    return {k: v[full] for k, v in enc.items()}


def shuffle_tokens(enc: dict, special_ids: Sequence[int], seed: int) -> dict:
    """The same examples with each one's ordinary tokens permuted at random (seeded) among their own
    positions; special tokens ([CLS], [SEP], padding) stay where they are, and so do token types and the
    mask. Same length and same tokens, order destroyed: the null for an order-dependent statistic."""
    gen = torch.Generator().manual_seed(seed)
    ids = enc["input_ids"].clone()
    fixed = torch.isin(ids, torch.tensor(sorted(set(int(i) for i in special_ids)))) | (enc["attention_mask"] == 0)
    for r in range(len(ids)):
        pos = torch.nonzero(~fixed[r]).flatten()
        ids[r, pos] = ids[r, pos[torch.randperm(len(pos), generator=gen)]]
    return {**enc, "input_ids": ids}


def encode_lm(tokenizer, texts: Sequence[str], seq_len: int, vocab: Vocab | None = None) -> dict:
    """Concatenate texts (EOS between) and cut into unpadded chunks of ``seq_len`` tokens."""
    ids = []
    eos = tokenizer.eos_token_id
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    n = len(ids) // seq_len
    x = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    if vocab is not None:
        x = vocab(x)
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    seconds_per_step: float = float("nan")
    curve: list[dict] = field(default_factory=list)  # {step, entropy_norm, sink_mass, entropy_norm_nosink: per layer} on the probe inputs


def train(lm: models.Loaded, enc: dict, steps: int, batch_size: int = 32, lr: float = 1e-3,
          j_lr: float = 0.05, seed: int = 0, progress: bool = False, desc: str = "train",
          probe: dict | None = None, probe_every: int = 0) -> TrainLog:
    """AdamW on random mini-batches (seeded) of ``enc`` (must hold ``labels``), through :func:`active`.

    J of an attached SAOBP gets its own learning rate ``j_lr`` (it would barely move at the model's).
    ``probe`` (an encoding) and ``probe_every`` > 0: the attention statistics of the probe inputs before
    the first step, every ``probe_every`` steps and after the last go into ``TrainLog.curve`` (in eval
    mode, without gradients and without touching any random generator, so the training is the same)."""

    def measure(step: int):
        st = attention_stats(lm, probe, batch_size=32)
        tab = st.table()
        log.curve.append({"step": step, "entropy_norm": tab["entropy_norm"].tolist(), "sink_mass": tab["sink_mass"].tolist(),
                          "entropy_norm_nosink": tab["entropy_norm_nosink"].tolist()})

    if not torch.is_grad_enabled():
        raise RuntimeError("training needs autograd: call repro.setup(seed, grad=True) first")
    model = lm.model
    mod = get(lm)
    j_params = [] if mod is None else [p for p in mod.parameters() if p.requires_grad]
    rest = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": rest, "lr": lr}] + ([{"params": j_params, "lr": j_lr, "weight_decay": 0.0}] if j_params else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    n = len(enc["input_ids"])
    log = TrainLog()
    model.train()
    t0 = time.perf_counter()
    probing = probe is not None and probe_every > 0
    spent = 0.0  # seconds in the probe, left out of seconds_per_step
    with active(lm):
        for step in repro.bar(range(steps), desc=desc, progress=progress):
            if probing and step % probe_every == 0:
                t1 = time.perf_counter()
                measure(step)
                spent += time.perf_counter() - t1
            idx = torch.randint(0, n, (batch_size,), generator=gen)
            batch = {k: v.to(lm.device) for k, v in trim({k: v[idx] for k, v in enc.items()}).items()}
            loss = model(**batch, **no_cache(lm)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log.losses.append(loss.item())
    log.seconds_per_step = (time.perf_counter() - t0 - spent) / max(1, steps)
    if probing:
        measure(steps)
    model.eval()
    return log


def unigram_perplexity(train_enc: dict, dev_enc: dict, vocab_size: int) -> float:
    """The perplexity of dev tokens under the training tokens' unigram frequencies (add-one smoothed,
    over the same compact vocabulary and the same next-token targets as :func:`accuracy_or_perplexity`):
    the bar an LM must clear to have learned anything beyond token frequencies."""
    ids = train_enc["input_ids"][train_enc["attention_mask"].bool()] if "attention_mask" in train_enc else train_enc["input_ids"].reshape(-1)
    p = torch.bincount(ids.reshape(-1), minlength=vocab_size).double() + 1.0
    logp = (p / p.sum()).log()
    tgt = dev_enc["labels"][:, 1:]
    tgt = tgt[tgt >= 0]
    return float(math.exp(-logp[tgt].mean()))


def accuracy_or_perplexity(lm: models.Loaded, enc: dict, batch_size: int = 64) -> dict:
    """A trained model on encoded dev data: {'accuracy'} for a classifier (logits [b, labels]), or
    {'loss', 'perplexity'} (mean next-token loss) for a causal LM."""
    model = lm.model
    model.eval()
    correct = total = 0
    nll = 0.0
    with active(lm), torch.no_grad():
        for b in batches(enc, batch_size):
            b = {k: v.to(lm.device) for k, v in b.items()}
            if lm.info.is_causal:
                out = model(**b, use_cache=False)
                logits = out.logits[:, :-1].float()
                tgt = b["labels"][:, 1:]
                nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                               reduction="sum"))
                total += tgt.numel()
            else:
                labels = b.pop("labels")
                pred = model(**b).logits.argmax(-1)
                correct += int((pred == labels).sum())
                total += len(labels)
    if lm.info.is_causal:
        return {"loss": nll / total, "perplexity": math.exp(nll / total)}
    return {"accuracy": correct / total}


# ----------------------------------------------------------------------------- one cached experiment

SCRATCH_TASKS = ("SST-2", "CoLA", "RTE", "MRPC", "multihop", "LM")


def check_tasks(name: str, tasks, values: dict | None = None) -> list[str]:
    """``tasks`` (a parameter of notebooks 09 and 10) as a list, checked before anything heavy runs: at least
    one name, each in :data:`SCRATCH_TASKS`; else one line naming the parameter and the valid tasks. The
    signature of a bound of :func:`lib.nb.start` (``values``, the other parameters, is not needed here)."""
    import difflib

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise ValueError(f"{name} is empty: name at least one task, any of {', '.join(SCRATCH_TASKS)}")
    bad = [t for t in tasks if t not in SCRATCH_TASKS]
    if bad:
        by_case = {k.lower(): k for k in SCRATCH_TASKS}
        guess = {t: [by_case[str(t).lower()]] if str(t).lower() in by_case
                 else difflib.get_close_matches(str(t), SCRATCH_TASKS, n=1, cutoff=0.5) for t in bad}
        raise ValueError(f"unknown {name} " + ", ".join(f"{t!r}" + (f" (did you mean {g[0]!r}?)" if g else "")
                                                       for t, g in guess.items())
                         + f": use any of {', '.join(SCRATCH_TASKS)}")
    return tasks


def task_source(task: str):
    """The raw (train, dev) data of a from-scratch task. GLUE: the 1,000-row train sample and the GLUE
    dev set (DataFrames); 'multihop': 1,000 / 500 synthetic examples; 'LM': Wikipedia prompt+gold text
    of rows 0..1499 for training and the gold text of rows 1500.. for evaluation (lists of texts)."""
    if task not in SCRATCH_TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(SCRATCH_TASKS)}")
    if task == "LM":
        rows = data.wiki_samples()
        return [r["prompt"] + " " + r["gold"] for r in rows[:1500]], [r["gold"] for r in rows[1500:]]
    if task == "multihop":
        return synthetic_multihop(1000, seed=1000), synthetic_multihop(500, seed=2000)
    return data.glue(task, "train"), data.glue(task, "dev")


def task_data(task: str, tokenizer, max_length: int, vocab_size: int, n_eval: int | None = None, seed: int = 0):
    """(train, dev, vocab) encodings of :func:`task_source` for a from-scratch run (LM texts in
    chunks of ``max_length``)."""
    if task == "LM":
        train_txt, dev_txt = task_source(task)
        raw = encode_lm(tokenizer, train_txt, max_length)
        vocab = compact_vocab(tokenizer, raw["input_ids"].tolist(), vocab_size)
        tr, dev = encode_lm(tokenizer, train_txt, max_length, vocab), encode_lm(tokenizer, dev_txt, max_length, vocab)
    else:
        tr_df, dev_df = task_source(task)
        raw = encode_classification(tokenizer, tr_df, max_length)
        vocab = compact_vocab(tokenizer, raw["input_ids"].tolist(), vocab_size)
        tr, dev = encode_classification(tokenizer, tr_df, max_length, vocab), encode_classification(tokenizer, dev_df, max_length, vocab)
    if n_eval is not None and n_eval < len(dev["input_ids"]):
        idx = torch.randperm(len(dev["input_ids"]), generator=torch.Generator().manual_seed(seed))[:n_eval].sort().values
        dev = {k: v[idx] for k, v in dev.items()}
    return tr, dev, vocab


@functools.lru_cache(maxsize=4)
def scratch_tokenizer(task: str, encoder: str = "minilm-l6", decoder: str = "smollm2-135m"):
    """The (embedded) encoder's tokenizer for the BERT classifiers, the decoder's for the Llama LM.
    Loaded once per process (a notebook's loop of runs shares it)."""
    import transformers as tf

    name = decoder if task == "LM" else encoder
    folder = models.prepare_embedded(name)
    return models._prepare_tokenizer(tf.AutoTokenizer.from_pretrained(folder), "causal" if task == "LM" else "encoder")


@functools.lru_cache(maxsize=8)
def _run_data(task: str, encoder: str, decoder: str, max_length: int, vocab_size: int, n_eval: int | None,
              data_hash: str):
    """:func:`task_data` for :func:`scratch_run`, built once per process and setting: every seed and arm
    of a notebook's loop trains on the same encodings (tokenising the LM corpus took about 2 s a run).
    Nothing downstream writes into these tensors (batches are indexed copies). ``data_hash`` (the task
    source's content hash, also in the run's cache key) keys the memo, so edited rows are read again."""
    return task_data(task, scratch_tokenizer(task, encoder, decoder), max_length, vocab_size, n_eval)


def scratch_run(task: str, size: str, seed: int, variant: str, steps: int, batch_size: int = 16,
                max_length: int = 40, lr: float = 1e-3, j_lr: float = 0.05, J: float = DEFAULT_J,
                vocab_size: int = 3000, n_stats: int = 64, n_eval: int | None = None, progress: bool = False,
                encoder: str = "minilm-l6", decoder: str = "smollm2-135m", j_mode: str = "repulsive",
                curve_every: int = 0, where: bool = False) -> dict:
    """Train a from-scratch model (BERT classifier, or Llama LM for task 'LM') of ``size`` (see
    :data:`SIZES`) with ``variant`` 'baseline', 'saobp' (learnable J from ``J``) or 'saobp-fixed';
    evaluate on dev and measure attention statistics on ``n_stats`` dev examples. Cached (lib.infra.cache).

    j_mode: 'repulsive' (J = -softplus(theta), J < 0 by construction; ``J`` must be < 0) or 'free' (the
    earlier unconstrained J). The baseline ignores ``J`` and ``j_mode``. ``curve_every`` > 0: the
    training curve of the attention statistics on the first ``n_stats`` dev examples (``"curve"``, see
    :func:`train`). LM runs also return the dev set's unigram perplexity (``metrics["unigram_perplexity"]``,
    :func:`unigram_perplexity`), the bar for "learned".

    Cache key: kind 'saobp-scratch' (kept from when this lived in lib.papers.saobp). A baseline's key records
    J = 0.0 (the plain model) whatever ``J`` is, and a 'free' run's key has no ``j_mode`` entry, so both
    keep the keys they had before the repulsive mode existed; a 'repulsive' run's key adds
    ``j_mode='repulsive'``. Version 2: results hold the sink metrics, the curve and the LM's unigram
    perplexity (version-1 artifacts lack them, so they are built again). Version 3: every run trains
    on one CPU thread (:func:`one_thread`), so a run's numbers do not depend on COMPENDIUM_THREADS or on
    whether :func:`scratch_runs` built it in a worker process.

    Each run is a committed record (lib.infra.store, step 'scratch-run', under the fixed owner ``scratch``: the runs
    are the same whichever notebook's model asks for them), keyed by these parameters.

    ``where=True``: return whether the run's record exists (without training it) instead of the run."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    modes = {"baseline": None, "saobp": "learnable", "saobp-fixed": "fixed"}
    if variant not in modes:
        raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(modes)}")
    if j_mode not in J_MODES:
        raise ValueError(f"unknown j_mode {j_mode!r}: use one of {', '.join(J_MODES)}")
    if variant != "baseline" and j_mode == "repulsive" and not J < 0:
        raise ValueError(f"j_mode 'repulsive' needs an initial J < 0, got J={J!r} (use j_mode='free' for J >= 0)")
    params = dict(task=task, size=SIZES[size], seed=seed, variant=variant, steps=steps, batch_size=batch_size,
                  max_length=max_length, lr=lr, j_lr=j_lr, J=0.0 if variant == "baseline" else J,
                  vocab_size=vocab_size, n_stats=n_stats,
                  n_eval=n_eval, tokenizer=decoder if task == "LM" else encoder, version=3,
                  data=cache.content_hash(task_source(task)))  # edited train or dev rows: trained again
    if variant != "baseline" and j_mode != "free":  # 'free' keeps its earlier key (see the docstring)
        params["j_mode"] = j_mode
    if curve_every:
        params["curve_every"] = curve_every
    if where:
        return store.exists("scratch-run", SCRATCH_OWNER, params)

    def build():
        tok = scratch_tokenizer(task, encoder, decoder)
        tr, dev, vocab = _run_data(task, encoder, decoder, max_length, vocab_size, n_eval, params["data"])
        n_labels = None if task == "LM" else int(max(int(tr["labels"].max()), int(dev["labels"].max())) + 1)
        L, d = SIZES[size]
        lm = small_model("llama" if task == "LM" else "bert", L, d, vocab, tok, num_labels=n_labels, seed=seed,
                         max_positions=max(128, max_length), saobp=modes[variant], J=J, j_mode=j_mode)
        sub = {k: v[:n_stats] for k, v in dev.items()}
        with one_thread():
            with torch.enable_grad():
                log = train(lm, tr, steps, batch_size, lr, j_lr, seed, progress, desc=f"{task} {size} {variant} s{seed}",
                            probe=sub, probe_every=curve_every)
            scores = accuracy_or_perplexity(lm, dev)
            st = attention_stats(lm, sub, batch_size=32)
        if task == "LM":
            scores["unigram_perplexity"] = unigram_perplexity(tr, dev, vocab.size)
        mod = get(lm)
        return {"params": params, "metrics": scores, "seconds_per_step": log.seconds_per_step, "losses": log.losses,
                "table": st.table(), "per_head": {m: st.per_head(m) for m in AttentionStats.METRICS}, "curve": log.curve,
                "J": None if mod is None else mod.J.detach().clone()}

    return store.measure("scratch-run", SCRATCH_OWNER, params, build)


@contextlib.contextmanager
def one_thread():
    """torch on one CPU thread within the block (the previous count restored after). The from-scratch
    models are so small that a second thread speeds a step up by under 20%; two runs in two processes
    (:func:`scratch_runs`) use the two cores far better, and a one-thread run gives the same numbers
    whatever the machine's thread setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _build_in_worker(config: dict) -> str:
    import warnings

    # A worker writes to the caller's terminal (or the notebook cell) directly: no bars, no library warnings
    os.environ["COMPENDIUM_PROGRESS"] = "0"
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    scratch_run(**config)
    return repr(config)


def scratch_runs(configs: Sequence[dict], workers: int | None = None, progress: bool = False,
                 desc: str = "scratch runs") -> list[dict]:
    """:func:`scratch_run` for each config (a dict of its keyword arguments), in the given order.

    Runs not yet in the cache are built first, ``workers`` at a time in separate processes (default:
    COMPENDIUM_THREADS, 2 unless set; each trains on one thread, see :func:`one_thread`), and saved to
    the cache as they finish, so an interrupted loop keeps every finished run. ``workers=1`` builds them
    in this process. The numbers are the same either way. Workers are started with "spawn": a script
    that calls this needs the ``if __name__ == "__main__":`` guard (a notebook does not)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    configs = [dict(c) for c in configs]
    n = repro.env_threads() if workers is None else workers
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    # strict mode (make test) computes nothing: a missing record is reported by scratch_run below
    todo = [] if store.mode() == "strict" else [c for c in configs if not scratch_run(**c, where=True)]
    if n > 1 and len(todo) > 1:
        for name in sorted({c.get("decoder", "smollm2-135m") if c["task"] == "LM" else c.get("encoder", "minilm-l6") for c in todo}):
            models.prepare_embedded(name)  # once, here, rather than by every worker at the same time
        with cf.ProcessPoolExecutor(min(n, len(todo)), mp_context=mp.get_context("spawn")) as ex:
            futures = [ex.submit(_build_in_worker, c) for c in todo]
            for f in repro.bar(cf.as_completed(futures), total=len(futures), desc=desc, progress=progress):
                f.result()  # a failed run raises here, with its worker's traceback
        todo = []
    out = []
    for c in repro.bar(configs, desc=desc, progress=progress and bool(todo)):
        out.append(scratch_run(**c))
    return out


# ----------------------------------------------------------------------------- one cached fine-tune (notebook 08)


def finetune(model_name: str, arm: str, seed: int, train_enc: dict, texts_enc: dict, eval_enc: dict, *,
             n_labels: int, steps: int, batch_size: int, lr: float, j_lr: float, key: dict,
             J: float = DEFAULT_J, j_mode: str = "repulsive", device: str = "cpu", progress: bool = True) -> dict:
    """Fine-tune the pretrained encoder ``model_name`` as a classifier, ``arm`` 'baseline' (plain) or
    'saobp' (a learnable J per layer and head from ``J``, in ``j_mode``), with :func:`train`; cached.

    train_enc / eval_enc: encoded training and accuracy data (:func:`encode_classification`, labels
    included); texts_enc: the texts whose attention statistics are kept. ``key``: what the caller knows
    about those encodings (task, lengths, sizes, data seed): it goes into the cache key, with a content
    hash of the three encodings. Returns {'accuracy', 'table' (:meth:`AttentionStats.table`),
    'per_text' ([n_texts, n_layers] normalised entropy), 'J' (the learned effective J or None),
    'seconds_per_step', 'loss_last' (mean of the last 5 losses)}. Seeds everything with
    ``repro.setup(seed, grad=True)`` and leaves autograd off.

    Cache key: kind 'saobp-finetune' for ``model_name`` with the fields notebook 08's own loop had
    (version 2) plus the encodings' content hash; the SAOBP arm's key adds ``J`` and ``j_mode``
    (it used to start at J = 0, which the repulsive mode cannot represent)."""
    if arm not in ("baseline", "saobp"):
        raise ValueError(f"unknown arm {arm!r}: use 'baseline' or 'saobp'")
    if j_mode not in J_MODES:
        raise ValueError(f"unknown j_mode {j_mode!r}: use one of {', '.join(J_MODES)}")
    if arm == "saobp" and j_mode == "repulsive" and not J < 0:
        raise ValueError(f"j_mode 'repulsive' needs an initial J < 0, got J={J!r} (use j_mode='free' for J >= 0)")

    def build():
        repro.setup(seed, grad=True)
        m = models.load(model_name, device=device, task="sequence-classification", num_labels=n_labels)
        if arm == "saobp":
            attach(m, J=J, learnable=True, mode=j_mode)
        log = train(m, train_enc, steps, batch_size, lr=lr, j_lr=j_lr, seed=seed, progress=progress,
                    desc=f"{arm} seed {seed}")
        torch.set_grad_enabled(False)
        st = attention_stats(m, texts_enc, batch_size=16, keep_sequences=True)
        mod = get(m)
        return {"accuracy": accuracy_or_perplexity(m, eval_enc)["accuracy"], "table": st.table(),
                "per_text": st.per_sequence("entropy_norm"),  # [n_texts, n_layers], for the interval over texts
                "J": None if mod is None else mod.J.detach().clone(), "seconds_per_step": log.seconds_per_step,
                "loss_last": float(np.mean(log.losses[-5:]))}

    record_params = dict(model=model_name, arm=arm, seed=seed, steps=steps, batch_size=batch_size, lr=lr, j_lr=j_lr, **key, version=2,
                         # the encodings' content: edited texts or labels give a new artifact, never a stale one
                         data=cache.content_hash([{k: v for k, v in sorted(e.items())} for e in (train_enc, texts_enc, eval_enc)]))
    if arm == "saobp":
        record_params.update(J=J, j_mode=j_mode)
    return store.measure("saobp-finetune", model_name, record_params, build, device=str(device))


# ----------------------------------------------------------------------------- records (lib.infra.store)
SCRATCH_OWNER = "scratch"  # results/scratch/measurements/: the from-scratch runs, shared by notebooks 07, 09 and 10
CURVE_TOLERANCE = 0.05  # a recomputed run's final training loss (and perplexity) may differ by 5% of the committed one


def _binomial_check(name: str, c: float, f: float, n: int) -> "store.Check":
    hw = 1.96 * np.sqrt(max(c * (1 - c), 1e-4) / max(n, 1))
    return store.within(name, c, f, hw, f"the binomial 95% half-width {hw:.3g} over {n} examples")


def _compare_run(c: dict, f: dict) -> list:
    """A training run: its final loss (mean of the last 5 steps) within 5% of the committed one; accuracy within
    its binomial interval's half-width, perplexity within 5%."""
    lc, lf = float(np.mean(c["losses"][-5:])), float(np.mean(f["losses"][-5:]))
    out = [store.within("final training loss", lc, lf, CURVE_TOLERANCE * abs(lc), f"{CURVE_TOLERANCE:.0%} of the committed value")]
    n = int(c["params"].get("n_eval") or 0) or 200
    for k, v in c["metrics"].items():
        if k == "accuracy":
            out.append(_binomial_check("dev accuracy", v, f["metrics"][k], n))
        elif "perplexity" in k:
            out.append(store.within(k, v, f["metrics"][k], CURVE_TOLERANCE * abs(v), f"{CURVE_TOLERANCE:.0%} of the committed value"))
    return out


def _compare_finetune(c: dict, f: dict) -> list:
    """A fine-tune: its final loss within 5%, its accuracy within 0.05 (the evaluation size is not in the record),
    its deep-layer entropy per text reported."""
    return [store.within("final training loss", c["loss_last"], f["loss_last"], CURVE_TOLERANCE * abs(c["loss_last"]),
                         f"{CURVE_TOLERANCE:.0%} of the committed value"),
            store.within("accuracy", c["accuracy"], f["accuracy"], 0.05, "a stated 0.05"),
            store.info("mean normalised entropy over texts and layers", float(np.mean(c["per_text"])),
                       float(np.mean(f["per_text"])), "reported")]


store.step("scratch-run", 1, "paper B: one model trained from scratch: losses, curve, dev metrics, attention "
           "statistics, learned J", _compare_run)
store.step("saobp-finetune", 1, "paper B: one fine-tune of a pretrained encoder with or without SAOBP: accuracy, "
           "attention statistics per text, learned J", _compare_finetune)
