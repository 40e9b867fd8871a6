"""SAOBP: self-attention refinement by one step of belief propagation, and attention statistics.

A *reconstruction* of Lee et al. (Findings of EMNLP 2025, arXiv 2509.07324) from its abstract;
the authors' code was not available. Per layer and head, with masked logits S [b, h, q, k] and
A = softmax(S) over the valid keys:

* Tokens are nodes; node i holds "which token i attends to" with unary belief A_i. A Potts
  potential psi(x_i = j, x_k = l) = exp(J [j == l]) with J < 0 is repulsive.
* One message step from the unary beliefs: m_{k->i}(j) = sum_l psi(j, l) A_kl = 1 + g A_kj,
  g = exp(J) - 1 in (-1, 0).
* Multi-hop term M_ij = sum_{k != i} A_ik log(1 + g A_kj)  (~ g (A~ A)_ij, A~ = A without diagonal),
  where k runs over valid (real, unmasked) tokens only.
* Refined attention A' = softmax(S + M); masked keys stay masked, causal models stay causal
  (A_ik A_kj is non-zero only for j <= k <= i).

It plugs into :func:`lib.hooks.attention` as the ``refine`` callback, so it works for every family
the hook supports. :class:`SAOBP` keeps J per layer and head as a parameter attached to the model
(``model.saobp``), so a learnable J trains and is saved with it. J = 0 (g = 0) is the plain model.

Statistics streamed per layer (:class:`AttentionStats`): attention entropy (raw and normalised, from
:func:`lib.metrics.attention_entropy`), the Global Token Dependency GTD_2hop(A) =
mean_i sum_j max(0, (A^2)_ij - A_ij) (0 for identity, uniform or single-hub attention) and, for
SAOBP models, GTD_msg = ||M||_F / (||S_c||_F + ||M||_F) with S_c the row-centred valid logits.

The second half is a small train / evaluate toolkit for models trained from scratch (compact
vocabulary, BERT or Llama configs, a seeded AdamW loop) and a synthetic two-hop QA task.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from lib import hooks, metrics, models, repro

COLLAPSE_THRESHOLD = 0.1  # a head is "collapsed" when its mean normalised entropy is below this


# ----------------------------------------------------------------------------- the refinement


def _probs(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """A = softmax(S) in float32 with invalid keys set to exactly 0 (also in fully masked rows)."""
    A = torch.softmax(scores.float(), dim=-1)
    return A if valid is None else A.masked_fill(~valid, 0.0)


def _per_head(J, n_heads: int, like: torch.Tensor) -> torch.Tensor:
    J = torch.as_tensor(J, dtype=torch.float32, device=like.device)
    if J.ndim == 0:
        J = J.expand(n_heads)
    if J.shape != (n_heads,):
        raise ValueError(f"J must be a scalar or have one value per head ({n_heads}), got shape {tuple(J.shape)}")
    return J.view(1, n_heads, 1, 1)


def messages(scores: torch.Tensor, valid: torch.Tensor | None, J) -> torch.Tensor:
    """The multi-hop term M [b, h, q, k] (float32) for logits ``scores`` [b, h, n, n].

    J: a scalar or one value per head; g = exp(J) - 1. Needs the square self-attention matrix
    (all queries present), so it refuses KV-cached decoding steps.
    """
    b, h, q, k = scores.shape
    if q != k:
        raise ValueError(f"SAOBP needs square self-attention (got {q} queries, {k} keys); "
                         "run full forward passes (use_cache=False), not cached decoding")
    A = _probs(scores, valid)  # [b, h, n, n]
    g = torch.expm1(_per_head(J, h, A))  # [1, h, 1, 1]
    log_msg = torch.log1p(g * A)  # log m_{k->i}(j) = log(1 + g A_kj): row k is "query k"
    eye = torch.eye(q, dtype=torch.bool, device=A.device)
    A_off = A.masked_fill(eye, 0.0)  # k != i; invalid keys k already have A_ik = 0
    return A_off @ log_msg  # [b, h, n, n]


def messages_loop(scores: torch.Tensor, valid: torch.Tensor | None, J: float) -> torch.Tensor:
    """The same M written as the slow obvious triple loop (for tests): one batch row, one head."""
    A = _probs(scores, valid)
    b, h, n, _ = A.shape
    g = math.expm1(J)
    M = torch.zeros_like(A)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                for j in range(n):
                    s = 0.0
                    for kk in range(n):
                        key_ok = True if valid is None else bool(valid[bi, 0, i, kk])
                        if kk != i and key_ok:
                            s += float(A[bi, hi, i, kk]) * math.log(1 + g * float(A[bi, hi, kk, j]))
                    M[bi, hi, i, j] = s
    return M


def query_mask(valid: torch.Tensor | None, shape) -> torch.Tensor:
    """Real query tokens [b, q] from a square validity mask: query i is real iff key i is valid for it."""
    b, _, q, k = shape
    if valid is None:
        return torch.ones(b, q, dtype=torch.bool)
    return torch.diagonal(valid[:, 0], dim1=-2, dim2=-1).cpu() if q == k else valid[:, 0].any(-1).cpu()


def gtd_msg(scores: torch.Tensor, M: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """GTD_msg per [b, h]: ||M||_F / (||S_c||_F + ||M||_F) over valid (query, key) entries.

    S_c is S centred over each row's valid keys (softmax ignores a row constant)."""
    S = scores.float()
    v = torch.ones_like(S, dtype=torch.bool) if valid is None else valid.expand_as(S)
    qm = query_mask(valid, S.shape).to(S.device)[:, None, :, None]
    v = v & qm
    n = v.sum(-1, keepdim=True).clamp_min(1)
    Sz = S.masked_fill(~v, 0.0)
    Sc = (Sz - Sz.sum(-1, keepdim=True) / n).masked_fill(~v, 0.0)
    m_norm = M.float().masked_fill(~v, 0.0).pow(2).sum((-1, -2)).sqrt()
    s_norm = Sc.pow(2).sum((-1, -2)).sqrt()
    return m_norm / (s_norm + m_norm).clamp_min(1e-12)


def gtd_2hop(probs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GTD_2hop per [b, h] = mean over real queries i of sum_j max(0, (A^2)_ij - A_ij).

    The mass that two hops put on tokens beyond what one hop gives: 0 for identity, uniform or
    single-hub attention, 1 per row for a chain i -> i+1."""
    A = probs.float()
    if valid is not None:
        A = A.masked_fill(~valid, 0.0)
    qm = query_mask(valid, A.shape).to(A.device)  # [b, q]
    A = A * qm[:, None, :, None]  # padding queries neither count nor relay
    extra = (A @ A - A).clamp_min(0).sum(-1)  # [b, h, q]
    q = qm[:, None, :].float()
    return (extra * q).sum(-1) / q.sum(-1).clamp_min(1)


class SAOBP(nn.Module):
    """J per layer and head ([n_layers, n_heads]); call it as the ``refine`` of :func:`hooks.attention`.

    ``learnable=False`` keeps J fixed (a sweep). ``observer(scores, M, valid, layer)`` if set sees
    every message (e.g. :class:`AttentionStats` for GTD_msg)."""

    def __init__(self, n_layers: int, n_heads: int, J: float = 0.0, learnable: bool = True):
        super().__init__()
        self.J = nn.Parameter(torch.full((n_layers, n_heads), float(J)), requires_grad=learnable)
        self.observer: Callable | None = None

    @property
    def g(self) -> torch.Tensor:
        return torch.expm1(self.J.detach())

    def forward(self, scores, valid, layer: int):
        L = int(layer)
        M = messages(scores, valid, self.J[L])
        if self.observer is not None:
            self.observer(scores, M, valid, L)
        return scores + M.to(scores.dtype)


def attach(lm: models.Loaded, J: float = 0.0, learnable: bool = True) -> SAOBP:
    """Attach an :class:`SAOBP` as ``lm.model.saobp`` (a submodule: trained and saved with the model)."""
    info = lm.info
    mod = SAOBP(info.n_layers, info.n_heads, J, learnable).to(next(lm.model.parameters()).device)
    lm.model.saobp = mod
    return mod


def get(lm: models.Loaded) -> SAOBP | None:
    return getattr(lm.model, "saobp", None)


@contextlib.contextmanager
def active(lm: models.Loaded, capture: Callable | None = None):
    """Run the model with its attached SAOBP (if any) and an optional capture (e.g. AttentionStats).

    Without an attached SAOBP this is the plain model through the same eager attention function."""
    mod = get(lm)
    if mod is not None and isinstance(capture, AttentionStats):
        mod.observer = capture.observe
    try:
        with hooks.attention(lm, refine=mod, capture=capture):
            yield
    finally:
        if mod is not None:
            mod.observer = None


# ----------------------------------------------------------------------------- streamed statistics


class AttentionStats:
    """Per-layer, per-head running means over sequences of normalised / raw entropy, GTD_2hop and
    (for SAOBP) GTD_msg. Use as ``capture`` of :func:`active` (or of :func:`hooks.attention`)."""

    METRICS = ("entropy", "entropy_norm", "gtd_2hop", "gtd_msg")

    def __init__(self, n_layers: int, n_heads: int, keep_sequences: bool = False):
        self.sums = {m: torch.zeros(n_layers, n_heads, dtype=torch.float64) for m in self.METRICS}
        self.counts = {m: torch.zeros(n_layers, dtype=torch.float64) for m in self.METRICS}
        self.keep = keep_sequences  # also keep each sequence's head mean: self.seq[metric][L] = list
        self.seq = {m: [[] for _ in range(n_layers)] for m in self.METRICS}

    def _add(self, name, L, per_bh):
        v = per_bh.detach().double().cpu()  # [b, h]
        self.sums[name][L] += v.sum(0)
        self.counts[name][L] += v.shape[0]
        if self.keep:
            self.seq[name][L] += v.mean(1).tolist()

    def per_sequence(self, name: str) -> np.ndarray:
        """[n_sequences, n_layers] head-mean of ``name`` per sequence (needs keep_sequences=True)."""
        if not self.keep:
            raise ValueError("per_sequence needs AttentionStats(..., keep_sequences=True)")
        return np.array(self.seq[name], dtype=float).T

    def __call__(self, probs, valid, layer: int):
        L = int(layer)
        qm = query_mask(valid, probs.shape)
        raw, norm = metrics.attention_entropy(probs.detach(), None if valid is None else valid.detach(), qm)
        self._add("entropy", L, raw)
        self._add("entropy_norm", L, norm)
        self._add("gtd_2hop", L, gtd_2hop(probs.detach(), None if valid is None else valid.detach()))

    def observe(self, scores, M, valid, layer: int):
        self._add("gtd_msg", int(layer), gtd_msg(scores.detach(), M.detach(), valid))

    def per_head(self, name: str) -> torch.Tensor:
        """[n_layers, n_heads] mean over sequences (NaN where nothing was seen)."""
        c = self.counts[name][:, None]
        return torch.where(c > 0, self.sums[name] / c.clamp_min(1), torch.full_like(self.sums[name], float("nan")))

    def table(self, threshold: float = COLLAPSE_THRESHOLD) -> pd.DataFrame:
        """One row per layer: head means of each metric and the fraction of collapsed heads."""
        df = pd.DataFrame({m: self.per_head(m).mean(1).numpy() for m in self.METRICS})
        df["collapsed_frac"] = (self.per_head("entropy_norm") < threshold).double().mean(1).numpy()
        df.index.name = "layer"
        return df


def trim(batch: dict) -> dict:
    """Drop the columns that are padding in every row of a right-padded batch (faster, same result)."""
    am = batch.get("attention_mask")
    if am is None or not bool(am[:, -1].eq(0).all()):
        return batch
    n = int(am.sum(1).max())
    return {k: v[:, :n] if v.ndim == 2 else v for k, v in batch.items()}


def batches(enc: dict, batch_size: int):
    n = len(next(iter(enc.values())))
    for i in range(0, n, batch_size):
        yield trim({k: v[i:i + batch_size] for k, v in enc.items()})


def attention_stats(lm: models.Loaded, enc: dict, batch_size: int = 16, progress: bool = False,
                    desc: str = "attention", keep_sequences: bool = False) -> AttentionStats:
    """Stream :class:`AttentionStats` over encoded inputs (labels are dropped; no gradients)."""

    stats = AttentionStats(lm.info.n_layers, lm.info.n_heads, keep_sequences)
    model = lm.model
    was = model.training
    model.eval()
    inputs = {k: v for k, v in enc.items() if k != "labels"}
    n = len(inputs["input_ids"])
    try:
        with active(lm, capture=stats), torch.no_grad():
            for b in repro.bar(list(batches(inputs, batch_size)), desc=desc, progress=progress,
                               total=math.ceil(n / batch_size)):
                model(**{k: v.to(lm.device) for k, v in b.items()}, **_no_cache(lm))
    finally:
        model.train(was)
    return stats


def _no_cache(lm):
    return {"use_cache": False} if lm.info.is_causal else {}


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


SIZES = {"tiny": (2, 128), "small": (4, 256), "mini": (1, 64)}  # name -> (layers, d_model)


def small_model(family: str, n_layers: int, d_model: int, vocab: Vocab, tokenizer, num_labels: int | None = None,
                seed: int = 0, max_positions: int = 128, head_dim: int = 32, saobp: str | None = None,
                J: float = 0.0) -> models.Loaded:
    """A randomly initialised BERT classifier (``num_labels``) or Llama LM (``num_labels=None``).

    saobp: None (plain), 'learnable' (J per head, starts at ``J``) or 'fixed' (J held at ``J``).
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
        attach(lm, J=J, learnable=saobp == "learnable")
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


def train(lm: models.Loaded, enc: dict, steps: int, batch_size: int = 32, lr: float = 1e-3,
          j_lr: float = 0.05, seed: int = 0, progress: bool = False, desc: str = "train") -> TrainLog:
    """AdamW on random mini-batches (seeded) of ``enc`` (must hold ``labels``), through :func:`active`.

    J of an attached SAOBP gets its own learning rate ``j_lr`` (it would barely move at the model's)."""

    if not torch.is_grad_enabled():
        raise RuntimeError("training needs autograd: call repro.setup(seed, grad=True) first")
    model = lm.model
    j_params = [p for n, p in model.named_parameters() if n.startswith("saobp.") and p.requires_grad]
    ids = {id(p) for p in j_params}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": rest, "lr": lr}] + ([{"params": j_params, "lr": j_lr, "weight_decay": 0.0}] if j_params else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    n = len(enc["input_ids"])
    log = TrainLog()
    model.train()
    t0 = time.perf_counter()
    with active(lm):
        for _ in repro.bar(range(steps), desc=desc, progress=progress):
            idx = torch.randint(0, n, (batch_size,), generator=gen)
            batch = {k: v.to(lm.device) for k, v in trim({k: v[idx] for k, v in enc.items()}).items()}
            loss = model(**batch, **_no_cache(lm)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            log.losses.append(loss.item())
    log.seconds_per_step = (time.perf_counter() - t0) / max(1, steps)
    model.eval()
    return log


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


def task_source(task: str):
    """The raw (train, dev) data of a from-scratch task. GLUE: the 1,000-row train sample and the GLUE
    dev set (DataFrames); 'multihop': 1,000 / 500 synthetic examples; 'LM': Wikipedia prompt+gold text
    of rows 0..1499 for training and the gold text of rows 1500.. for evaluation (lists of texts)."""
    from lib import data

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


def scratch_tokenizer(task: str, encoder: str = "minilm-l6", decoder: str = "smollm2-135m"):
    """The (embedded) encoder's tokenizer for the BERT classifiers, the decoder's for the Llama LM."""
    import transformers as tf

    name = decoder if task == "LM" else encoder
    folder = models.prepare_embedded(name)
    return models._prepare_tokenizer(tf.AutoTokenizer.from_pretrained(folder), "causal" if task == "LM" else "encoder")


def scratch_run(task: str, size: str, seed: int, variant: str, steps: int, batch_size: int = 16,
                max_length: int = 40, lr: float = 1e-3, j_lr: float = 0.05, J: float = 0.0, vocab_size: int = 3000,
                n_stats: int = 64, n_eval: int | None = None, progress: bool = False,
                encoder: str = "minilm-l6", decoder: str = "smollm2-135m") -> dict:
    """Train a from-scratch model (BERT classifier, or Llama LM for task 'LM') of ``size`` (see
    :data:`SIZES`) with ``variant`` 'baseline', 'saobp' (learnable J from ``J``) or 'saobp-fixed';
    evaluate on dev and measure attention statistics on ``n_stats`` dev examples. Cached (lib.cache)."""
    from lib import cache

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    modes = {"baseline": None, "saobp": "learnable", "saobp-fixed": "fixed"}
    if variant not in modes:
        raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(modes)}")
    params = dict(task=task, size=SIZES[size], seed=seed, variant=variant, steps=steps, batch_size=batch_size,
                  max_length=max_length, lr=lr, j_lr=j_lr, J=J, vocab_size=vocab_size, n_stats=n_stats,
                  n_eval=n_eval, tokenizer=decoder if task == "LM" else encoder, version=1,
                  data=cache.content_hash(task_source(task)))  # edited train or dev rows: trained again

    def build():
        tok = scratch_tokenizer(task, encoder, decoder)
        tr, dev, vocab = task_data(task, tok, max_length, vocab_size, n_eval)
        n_labels = None if task == "LM" else int(max(int(tr["labels"].max()), int(dev["labels"].max())) + 1)
        L, d = SIZES[size]
        lm = small_model("llama" if task == "LM" else "bert", L, d, vocab, tok, num_labels=n_labels, seed=seed,
                         max_positions=max(128, max_length), saobp=modes[variant], J=J)
        with torch.enable_grad():
            log = train(lm, tr, steps, batch_size, lr, j_lr, seed, progress, desc=f"{task} {size} {variant} s{seed}")
        scores = accuracy_or_perplexity(lm, dev)
        sub = {k: v[:n_stats] for k, v in dev.items()}
        st = attention_stats(lm, sub, batch_size=32)
        mod = get(lm)
        return {"params": params, "metrics": scores, "seconds_per_step": log.seconds_per_step, "losses": log.losses,
                "table": st.table(), "per_head": {m: st.per_head(m) for m in AttentionStats.METRICS},
                "J": None if mod is None else mod.J.detach().clone()}

    return cache.get_or_build("saobp-scratch", "scratch", params, build)
