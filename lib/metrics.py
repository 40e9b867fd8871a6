"""Metrics shared by the notebooks: generation, toxicity, perplexity, F1, attention entropy, AP.

Every function takes plain Python / torch inputs and returns plain numbers or arrays, so a
notebook can show the computation next to the result.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lib import data, hooks, models
from lib.hooks import batches, cache_argument, hooked
from lib.infra import cache, repro
from lib.models import Loaded

SCORERS = ("auto", "profanity-check", "detoxify", "minilm-lr")
# The second scorer, not a word list: logistic regression on the embedded MiniLM's sentence embeddings,
# trained on the labelled tweets and comments in data/ (:func:`embedding_scorer`). Never chosen by "auto".
EMBEDDING_SCORER = "minilm-lr"
# Prompts per generation batch. A CPU decoding step is compute-bound, so it costs more for more
# sequences; still, 64 gives about 1.5x the tokens per second of 16 (benchmarks/RESULTS.md, item 3)
# and the KV cache of 64 short prompts is small. The compendium's greedy continuations came out the
# same at 16 and 64; sums over a batch (activation means) can move in their last digits.
GENERATE_BATCH_SIZE = 64


# ----------------------------------------------------------------------------- generation


@dataclass
class Generations:
    prompts: list[str]  # the prompts as the model saw them (after truncation)
    continuations: list[str]  # new text only, prompt removed
    prompt_ids: list[list[int]]
    new_ids: list[list[int]]
    first_token_rank: list[int] | None = None  # with score_tokens: rank (0 = greedy choice) at the first step
    first_token_logprob: list[float] | None = None  # with score_tokens: its log-probability there

    @property
    def full_texts(self) -> list[str]:
        return [p + c for p, c in zip(self.prompts, self.continuations)]


def _check_positive(**kw):
    for k, v in kw.items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")


def _prompt_batches(lm: Loaded, prompts: Sequence[str], batch_size: int, max_prompt_tokens: int | None):
    """The token ids of each prompt (truncated) and the batches :func:`generate` forms: prompts of similar
    length together, each as (prompt indices, left-padded input ids, attention mask)."""
    _check_positive(batch_size=batch_size)
    if max_prompt_tokens is not None:
        _check_positive(max_prompt_tokens=max_prompt_tokens)
    if not lm.info.is_causal:
        raise ValueError(f"{lm.name} is an encoder; generation needs a decoder model")
    tok, model = lm.tokenizer, lm.model
    ids = [tok(p, add_special_tokens=True)["input_ids"][:max_prompt_tokens] for p in prompts]
    if any(len(i) == 0 for i in ids):
        raise ValueError("an empty prompt has no tokens to continue")
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    pad = tok.pad_token_id
    out = []
    for chunk in batches(order, batch_size):
        width = max(len(ids[i]) for i in chunk)
        input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk], device=model.device)
        attn = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], device=model.device)
        out.append((chunk, input_ids, attn))
    return ids, out


def weights_version(model) -> int:
    """Sums the in-place version counters of the model's parameters: it changes when any weight is written."""
    return sum(p._version for p in model.parameters())


@dataclass
class PromptPrefix:
    """The KV cache of each prompt without its last token, per batch of :func:`generate` (:func:`prompt_prefix`)."""
    model_id: int
    version: int
    prompt_ids: list[list[int]]
    batch_size: int
    caches: list  # one DynamicCache (or None for a batch of one-token prompts) per batch

    def check(self, lm: Loaded, ids: list[list[int]], batch_size: int):
        if id(lm.model) != self.model_id or weights_version(lm.model) != self.version:
            raise ValueError("this prompt prefix was computed on another model, or before its weights changed")
        if ids != self.prompt_ids or batch_size != self.batch_size:
            raise ValueError("this prompt prefix was computed for other prompts or another batch size")


@torch.inference_mode()
def prompt_prefix(lm: Loaded, prompts: Sequence[str], batch_size: int = GENERATE_BATCH_SIZE,
                  max_prompt_tokens: int | None = 32) -> PromptPrefix:
    """The KV cache of every prompt but its last token, for :func:`generate` (``prefix=``) to start from.

    Greedy generation from it gives the continuations of a full prompt pass (the same tokens on the
    compendium's tests and prompts; logits may differ in their last digits). Many generations on the
    same prompts can share it when an intervention leaves those positions as the model computes them:
    a patch written at the last position of each forward call only (``hooks.intervene(...,
    positions='last')``, the authors' protocol), or a vector added after the last block (the direction
    gate). Computed on the model as it is, so it raises while hooks are registered on the model.
    """
    if hooked(lm):
        raise RuntimeError("prompt_prefix needs the model without hooks: call it outside hooks.intervene and the like")
    from transformers import DynamicCache

    ids, chunks = _prompt_batches(lm, prompts, batch_size, max_prompt_tokens)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(lm.model.forward).parameters else {}
    caches = []
    for _, input_ids, attn in chunks:
        if input_ids.shape[1] < 2:
            caches.append(None)
            continue
        head, mask = input_ids[:, :-1], attn[:, :-1]
        position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers left-padded rows
        cache = DynamicCache(config=lm.model.config)
        lm.model(input_ids=head, attention_mask=mask, position_ids=position_ids, use_cache=True,
                 **{cache_argument(lm.model): cache}, **keep)
        caches.append(cache)
    return PromptPrefix(id(lm.model), weights_version(lm.model), ids, batch_size, caches)


@torch.inference_mode()
def generate(lm: Loaded, prompts: Sequence[str], max_new_tokens: int = 20, batch_size: int = GENERATE_BATCH_SIZE,
             max_prompt_tokens: int | None = 32, progress: bool = True, desc: str = "generating",
             score_tokens: Sequence[int] | None = None, prefix: PromptPrefix | None = None,
             copies: int | None = None, each_batch=None) -> Generations | list[Generations]:
    """Greedy continuations, batched with left padding and the KV cache.

    Prompts are truncated to their first ``max_prompt_tokens`` tokens; batches are formed from
    prompts of similar length (results come back in the input order). ``score_tokens`` (one token
    id per prompt) also returns that token's rank and log-probability in the first step's logits,
    from the same forward pass (e.g. the gold answer's first token).

    ``prefix`` (:func:`prompt_prefix` of the same prompts and batch size): start from its KV cache, so
    only each prompt's last token and the new tokens are computed. ``copies`` = k: generate k copies
    of each prompt in the same batches and return k :class:`Generations` (a list); a batch then holds
    each prompt's k copies side by side (row r is copy r % k), which is how ``hooks.intervene_each``
    and ``hooks.residual_add`` with k vectors give each copy its own condition.

    ``each_batch``: a function of (prefix, batch index j, copies) returning a context manager that is open
    while batch j is generated, e.g. what ``hooks.copy_activations_each`` yields (its source then starts
    from its own prompt prefix of batch j).
    """
    _check_positive(max_new_tokens=max_new_tokens)
    if copies is not None:
        _check_positive(copies=copies)
    k = copies or 1
    ids, chunks = _prompt_batches(lm, prompts, batch_size, max_prompt_tokens)
    if prefix is not None:
        prefix.check(lm, ids, batch_size)
    if score_tokens is not None and len(score_tokens) != len(ids):
        raise ValueError(f"score_tokens needs one token id per prompt: {len(score_tokens)} for {len(ids)} prompts")
    tok, model = lm.tokenizer, lm.model
    new: list[dict[int, list[int]]] = [{} for _ in range(k)]
    ranks: list[dict[int, tuple[int, float]]] = [{} for _ in range(k)]
    pad = tok.pad_token_id
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for j, (chunk, input_ids, attn) in enumerate(repro.bar(chunks, desc=desc, progress=progress)):
        width = input_ids.shape[1]
        cache = None
        if prefix is not None and prefix.caches[j] is not None:
            cache = copy.deepcopy(prefix.caches[j])  # generate appends to it
            if k > 1:
                cache.batch_repeat_interleave(k)
        with each_batch(prefix, j, k) if each_batch is not None else contextlib.nullcontext():
            out = model.generate(input_ids=input_ids.repeat_interleave(k, 0), attention_mask=attn.repeat_interleave(k, 0),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, temperature=None,
                                 top_p=None, top_k=None, **({cache_argument(model): cache} if cache is not None else {}),
                                 **({"output_logits": True, "return_dict_in_generate": True} if score_tokens is not None else {}))
        if score_tokens is not None:
            first = out.logits[0].float()  # [batch * k, vocab] raw logits of the first new token
            out = out.sequences
            target = torch.tensor([int(score_tokens[i]) for i in chunk], device=first.device).repeat_interleave(k)
            t_logit = first.gather(1, target[:, None])
            rk = (first > t_logit).sum(1).tolist()
            lp = (t_logit[:, 0] - torch.logsumexp(first, -1)).tolist()
            for r, (a, b) in enumerate(zip(rk, lp)):
                ranks[r % k][chunk[r // k]] = (a, b)
        for r, row in enumerate(out[:, width:].tolist()):
            cut = next((q for q, t in enumerate(row) if t in eos), len(row))
            new[r % k][chunk[r // k]] = row[:cut]
    prompt_texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    result = []
    for c in range(k):
        new_ids = [new[c][i] for i in range(len(ids))]
        gens = Generations(prompt_texts, [tok.decode(t, skip_special_tokens=True) for t in new_ids], ids, new_ids)
        if score_tokens is not None:
            gens.first_token_rank = [ranks[c][i][0] for i in range(len(ids))]
            gens.first_token_logprob = [ranks[c][i][1] for i in range(len(ids))]
        result.append(gens)
    return result if copies is not None else result[0]


# ----------------------------------------------------------------------------- toxicity


def distinct_n(texts: Sequence[str], n: int = 2) -> np.ndarray:
    """Per text, the share of its word n-grams that are distinct (Li et al. 2016's distinct-n, per text):
    1 for no repetition, near 0 for a loop such as "about about about". Words are split on whitespace;
    a text with fewer than n + 1 words has too few n-grams to repeat and counts as 1."""
    _check_positive(n=n)
    out = []
    for t in texts:
        w = t.split()
        grams = list(zip(*(w[i:] for i in range(n))))
        out.append(len(set(grams)) / len(grams) if len(grams) > 1 else 1.0)
    return np.asarray(out, dtype=float)


def _detoxify_checkpoint() -> Path | None:
    try:
        import detoxify  # noqa: F401
    except ImportError:
        return None
    hits = sorted((Path(torch.hub.get_dir()) / "checkpoints").glob("toxic_original-*.ckpt"))
    return hits[0] if hits else None


def resolve_scorer(scorer: str = "auto") -> str:
    """'auto': Detoxify 'original' when installed with its checkpoint, else 'profanity-check'."""
    if scorer not in SCORERS:
        raise ValueError(f"unknown toxicity scorer {scorer!r}: use one of {', '.join(SCORERS)}")
    if scorer == "auto":
        return "detoxify" if _detoxify_checkpoint() is not None else "profanity-check"
    if scorer == "detoxify" and _detoxify_checkpoint() is None:
        raise ValueError("scorer 'detoxify' needs `pip install detoxify` and its 'original' checkpoint in the "
                         "torch hub cache (downloaded on first use with network); use 'profanity-check' offline")
    return scorer


def toxicity(texts: Sequence[str], scorer: str = "auto", batch_size: int = 64) -> tuple[np.ndarray, str]:
    """Probability that each text is toxic, in [0, 1], and the scorer's name (record it with results)."""
    name = resolve_scorer(scorer)
    texts = [t if t.strip() else " " for t in texts]
    if not texts:
        return np.zeros(0), name
    if name == "profanity-check":
        from profanity_check import predict_prob

        return np.asarray(predict_prob(list(texts)), dtype=float), name
    if name == EMBEDDING_SCORER:
        return embedding_scorer().score(texts), name
    from detoxify import Detoxify

    model = Detoxify("original", device="cpu")
    scores = [np.asarray(model.predict(list(chunk))["toxicity"]) for chunk in batches(list(texts), batch_size)]
    return np.concatenate(scores).astype(float), name


@dataclass
class EmbeddingScorer:
    """A toxicity scorer that reads meaning, not words: scikit-learn's logistic regression (C = 1) on
    the L2-normalised mean-pooled last hidden states of ``encoder`` (all-MiniLM-L6-v2 with the
    sentence-transformers pooling). ``auc``: held-out ROC AUC per data set; ``n_test``: their sizes."""
    classifier: object  # sklearn Pipeline(Normalizer, LogisticRegression)
    encoder: str
    max_length: int
    auc: dict
    n_train: int
    n_test: dict

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        lm = _encoder(self.encoder)
        return hooks.pooled_residuals(lm, list(texts), ("final",), batch_size=32, max_length=self.max_length,
                                      progress=False)["final"].numpy()

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """Probability that each text is toxic, in [0, 1]. A text without a letter or digit (an empty
        continuation) scores 0: the classifier would otherwise read the bare [CLS] [SEP] embedding."""
        texts = list(texts)
        out = np.zeros(len(texts))
        worded = [i for i, t in enumerate(texts) if any(ch.isalnum() for ch in t)]
        if worded:
            out[worded] = self.classifier.predict_proba(self.embed([texts[i] for i in worded]))[:, 1]
        return out.astype(float)


_ENCODERS: dict = {}
_SCORERS: dict = {}


def _encoder(name: str) -> Loaded:
    if name not in _ENCODERS:
        _ENCODERS[name] = models.load(name, device="cpu")
    return _ENCODERS[name]


def _plain_tweet(text: str) -> str:
    """A tweet without retweet marks, @-mentions, links and HTML entities (``&#128514;``, ``&amp;``)."""
    import re

    text = re.sub(r"&#?\w+;", " ", text)
    text = re.sub(r"@\w+:?", " ", text)
    text = re.sub(r"\bRT\b|https?://\S+", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def embedding_scorer(n_davidson_per_class: int = 1000, seed: int = 0, encoder: str = "minilm-l6",
                     max_length: int = 128) -> EmbeddingScorer:
    """The :data:`EMBEDDING_SCORER`, cached (``lib.infra.cache``, keyed by its settings and the content hash
    of its data). Training data: ``n_davidson_per_class`` Davidson tweets per class (80% train, 20%
    held out) and the Jigsaw sample's labelled comments (half train, half held out, stratified); the
    held-out AUC is reported per data set, since the comments are the harder, rarer-positive test.
    Tweets lose their retweet marks, @-mentions, links and HTML entities (:func:`_plain_tweet`), which
    model continuations never have.

    The design was chosen among eight (standardised or L2-normalised features, C 0.01 to 10, tweets
    cleaned or not) by these held-out AUCs and by six hand-written sentences: its AUCs (about 0.97 on
    tweets, 0.88 on comments) are therefore slightly optimistic. The standardised C = 1 fit scored
    "you are a fucking idiot" 0.00 while reaching 0.93 AUC on tweets: a fit to tweet artefacts."""
    def split(df, text, test_size):
        from sklearn.model_selection import train_test_split

        tr, te = train_test_split(df, test_size=test_size, random_state=seed, stratify=df["toxic"])
        return (tr[text].astype(str).tolist(), tr["toxic"].astype(int).tolist(),
                te[text].astype(str).tolist(), te["toxic"].astype(int).tolist())

    tweets = data.davidson_tweets()
    tweets = tweets.groupby("toxic", group_keys=False).sample(n=n_davidson_per_class, random_state=seed)
    comments = data.jigsaw_sample()
    tweets = tweets.assign(tweet=tweets["tweet"].astype(str).map(_plain_tweet))
    parts = {"davidson": split(tweets, "tweet", 0.2), "jigsaw": split(comments, "comment_text", 0.5)}
    params = {"n_davidson_per_class": n_davidson_per_class, "seed": seed, "max_length": max_length,
              "design": "l2-normalised mean pooling, LogisticRegression(C=1)",  # change it with the fit below
              "data": cache.content_hash(parts)}
    memo = (encoder, cache.key(params))
    if memo in _SCORERS:
        return _SCORERS[memo]

    def build() -> EmbeddingScorer:
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import roc_auc_score
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import Normalizer

        probe = EmbeddingScorer(None, encoder, max_length, {}, 0, {})
        x_tr = [t for p in parts.values() for t in p[0]]
        y_tr = [y for p in parts.values() for y in p[1]]
        clf = make_pipeline(Normalizer(), LogisticRegression(max_iter=5000)).fit(probe.embed(x_tr), y_tr)
        auc = {k: float(roc_auc_score(p[3], clf.predict_proba(probe.embed(p[2]))[:, 1])) for k, p in parts.items()}
        return EmbeddingScorer(clf, encoder, max_length, auc, len(y_tr), {k: len(p[3]) for k, p in parts.items()})

    _SCORERS[memo] = cache.get_or_build("toxicity-scorer", encoder, params, build)
    return _SCORERS[memo]


# ----------------------------------------------------------------------------- perplexity and F1


@torch.inference_mode()
def perplexity(lm: Loaded, texts: Sequence[str], window: int = 256, stride: int = 128,
               separator: str = "\n\n", progress: bool = True) -> float:
    """Sliding-window perplexity of the joined ``texts`` (each token scored once, with up to
    ``window - stride`` tokens of context carried over), as in the Hugging Face recipe."""
    _check_positive(window=window, stride=stride)
    if stride > window:
        raise ValueError(f"stride ({stride}) must not exceed window ({window})")
    tok, model = lm.tokenizer, lm.model
    ids = torch.tensor(tok(separator.join(texts))["input_ids"], device=model.device)
    nll, count, prev_end = 0.0, 0, 0
    starts = []  # window starts up to the first window that reaches the end (the bar's true total)
    for begin in range(0, max(len(ids) - 1, 1), stride):
        starts.append(begin)
        if begin + window >= len(ids):
            break
    for begin in repro.bar(starts, desc="perplexity", progress=progress):
        end = min(begin + window, len(ids))
        target_len = end - prev_end  # tokens not scored yet
        inp = ids[begin:end].unsqueeze(0)
        labels = inp.clone()
        labels[:, :-target_len] = -100
        out = model(input_ids=inp, labels=labels)
        n_scored = int((labels[:, 1:] != -100).sum())
        nll += float(out.loss) * n_scored
        count += n_scored
        prev_end = end
    return math.exp(nll / max(count, 1))


def f1_bag_of_tokens(generated: Sequence[int] | str, gold: Sequence[int] | str) -> float:
    """F1 of the multiset overlap between generated and gold tokens (Lee et al. 2024)."""
    g = Counter(generated.split() if isinstance(generated, str) else generated)
    r = Counter(gold.split() if isinstance(gold, str) else gold)
    overlap = sum((g & r).values())
    if overlap == 0:
        return 0.0
    p, rc = overlap / sum(g.values()), overlap / sum(r.values())
    return 2 * p * rc / (p + rc)


def mean_f1(lm: Loaded, generations: Generations, golds: Sequence[str]) -> float:
    """Mean token-level F1 of continuations against gold texts, tokenised with the model's tokenizer."""
    tok = lm.tokenizer
    scores = [f1_bag_of_tokens(new, tok(g, add_special_tokens=False)["input_ids"])
              for new, g in zip(generations.new_ids, golds)]
    return float(np.mean(scores)) if scores else float("nan")


# ----------------------------------------------------------------------------- attention entropy


def attention_entropy(probs: torch.Tensor, valid: torch.Tensor | None = None,
                      query_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy of attention rows, averaged over valid queries: (raw, normalised), each [batch, heads].

    probs [batch, heads, q, k]; valid bool [batch, 1 or heads, q, k] (True = key may be attended);
    query_mask [batch, q] (True = real query token). Raw entropy is -sum p log p (natural log);
    normalised divides by log(number of valid keys), and skips queries with one valid key.
    """
    p = probs.float()
    b, h, q, k = p.shape
    v = torch.ones(b, 1, q, k, dtype=torch.bool, device=p.device) if valid is None else valid.to(p.device)
    ent = -(p * torch.log(p.clamp_min(1e-30))).masked_fill(~v, 0).sum(-1)  # [b, h, q]
    n_keys = v.sum(-1).float()  # [b, 1|h, q]
    qm = torch.ones(b, q, dtype=torch.bool, device=p.device) if query_mask is None else query_mask.bool().to(p.device)
    qm = qm[:, None, :] & (n_keys > 0)  # [b, 1|h, q]
    qn = qm & (n_keys > 1)
    raw = (ent * qm).sum(-1) / qm.sum(-1).clamp_min(1)
    norm = (ent / torch.log(n_keys.clamp_min(2)) * qn).sum(-1) / qn.sum(-1).clamp_min(1)
    return raw, norm


# ----------------------------------------------------------------------------- average precision


def average_precision(scores: np.ndarray | torch.Tensor, labels: Sequence[int] | np.ndarray,
                      backend: str = "sklearn", weights: np.ndarray | None = None) -> np.ndarray:
    """Average precision of each column of ``scores`` [n_examples, n_units] as a detector of
    ``labels`` (1 = positive). Returns [n_units].

    backend 'sklearn' (default) calls scikit-learn column by column; 'torch' computes the same
    number (ties handled as scikit-learn does: tied scores enter together) for all columns at once,
    which is what tens of thousands of neurons need. With 'torch', ``labels`` may also be
    [n_examples, n_tasks] (one detection task per column, sharing one sort): returns [n_tasks, n_units];
    there a label of -1 leaves the example out of that task (tasks with different negatives).
    ``weights``: each example's non-negative weight ([n_examples], or [n_examples, n_tasks] with 'torch'),
    scikit-learn's ``sample_weight``; an integer weight counts the example that many times (a bootstrap
    resample's multiplicities)."""
    from sklearn.metrics import average_precision_score

    if backend not in ("sklearn", "torch"):
        raise ValueError(f"unknown backend {backend!r}: use 'sklearn' or 'torch'")
    s = scores.detach().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores)
    y = np.asarray(labels).astype(int)
    if s.ndim == 1:
        s = s[:, None]
    if s.shape[0] != y.shape[0]:
        raise ValueError(f"scores has {s.shape[0]} rows but labels has {y.shape[0]}")
    if y.ndim == 2 and backend != "torch":
        raise ValueError("labels with one column per task need backend='torch'")
    y2 = y.reshape(len(y), -1)
    if not np.isin(y2, (0, 1) if backend == "sklearn" or y.ndim == 1 else (-1, 0, 1)).all():
        raise ValueError("labels must be 1 (positive) or 0 (negative); -1 (left out) only in [n, tasks] labels")
    if not ((y2 == 1).any(0) & (y2 == 0).any(0)).all():
        raise ValueError("labels must contain both positives and negatives")
    w2 = None
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        if w.shape not in (y.shape[:1], y2.shape) or (w.ndim == 2 and backend != "torch") or not (w >= 0).all():
            raise ValueError(f"weights must be non-negative, of shape [{len(y)}]" + (f" or {list(y2.shape)}" if backend == "torch" else "")
                             + f", got {list(w.shape)}")
        w2 = np.broadcast_to(w.reshape(len(y), -1), y2.shape)
        if not (((y2 == 1) * w2).sum(0) > 0).all() or not (((y2 == 0) * w2).sum(0) > 0).all():
            raise ValueError("the weights leave a task without positives or without negatives")
    if backend == "torch":
        ap = _average_precision_torch(torch.from_numpy(s), torch.from_numpy(y2),
                                      weights=None if w2 is None else torch.from_numpy(np.array(w2, dtype=np.float64)))  # [tasks, units]
        return ap if y.ndim == 2 else ap[0]
    return np.asarray(average_precision_score(np.repeat(y[:, None], s.shape[1], axis=1), s, average=None, sample_weight=weights))


def _average_precision_torch(s: torch.Tensor, y: torch.Tensor, chunk: int = 8192, weights: torch.Tensor | None = None) -> np.ndarray:
    """AP = mean over positives of the precision at the end of the positive's tie group (sorted by
    descending score): scikit-learn's step-wise precision-recall sum. s [n, units], y [n, tasks]
    -> [tasks, units]; the sort is shared by the tasks. ``weights`` [n, tasks]: each example's weight
    (the mean and the precision weighted, as scikit-learn's ``sample_weight``)."""
    n = s.shape[0]
    yf, nf = (y == 1).float(), (y == 0).float()  # -1: left out of the task
    if weights is not None:
        yf, nf = yf * weights.float(), nf * weights.float()
    pos = yf.sum(0)  # [tasks]
    out = []
    for c0 in range(0, s.shape[1], chunk):
        vals, order = torch.sort(s[:, c0:c0 + chunk].float(), dim=0, descending=True, stable=True)  # [n, u]
        group_end = torch.ones_like(vals, dtype=torch.bool)
        group_end[:-1] = vals[:-1] != vals[1:]
        idx = torch.where(group_end, torch.arange(n).unsqueeze(1).expand_as(order), torch.full_like(order, n))
        nxt = torch.flip(torch.cummin(torch.flip(idx, [0]), 0).values, [0])  # last index of each tie group
        rows = []
        for t in range(yf.shape[1]):
            lab, neg = yf[:, t][order], nf[:, t][order]  # [n, u]
            tp = lab.cumsum(0)
            prec = tp / (tp + neg.cumsum(0)).clamp_min(1e-12)  # exact for integer counts below 2**24
            rows.append((lab * prec.gather(0, nxt)).sum(0) / pos[t])
        out.append(torch.stack(rows))
    return torch.cat(out, 1).double().numpy()
