"""Relation-specific neurons: prompts and splits of factual relations, recall accuracy, AP scores of
neurons, deactivation with random controls, the rule that calls a relation's drop specific, and set
overlaps (with the bound on what overlap one-vs-rest AP allows). Intervals and tests: :mod:`lib.stats`.

The method of "On Relation-Specific Neurons in Large Language Models" (EMNLP 2025), which builds
on Kojima et al.'s expert-neuron code:

* a neuron is an input of the MLP output projection (``act(gate) * up`` for gated MLPs; see
  :mod:`lib.hooks`), so zeroing it removes exactly its value vector from the residual stream;
* its score for relation r is the average precision (AP) with which its mean-pooled activation
  over a prompt separates r's identification prompts (positives) from the other relations'
  identification prompts (negatives);
* r's candidate neurons are the top-k by AP; "deactivating" them sets their activation to zero at
  every position, during the prompt and every generated token;
* recall is measured on separate test facts: a greedy continuation is correct when it starts with
  the gold object (case-insensitive, after stripping), and the gold object's first-token rank in
  the first step's logits is a smoother measure from the same forward pass.

Every function works for any decoder :class:`~lib.models.Loaded` (GPT-2, Llama, Gemma-2, Mistral).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from lib import hooks, metrics, repro
from lib.models import Loaded

HOOK_POINT = "input of the MLP output projection (act(gate)*up for gated MLPs; TransformerLens mlp.hook_post)"


# ----------------------------------------------------------------------------- facts, splits, prompts


@dataclass
class Relation:
    """One relation's facts split into few-shot demonstrations, identification and test facts."""
    name: str
    templates: list[str]  # '{}' is the subject; identification prompts cycle through these
    demos: list[dict] = field(default_factory=list)  # {subject, object}: the few-shot prefix
    ident: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)

    def prefix(self, template: str | None = None) -> str:
        """The few-shot prefix: one line '<template with subject> <object>.' per demonstration."""
        t = template or self.templates[0]
        return "".join(f"{t.format(d['subject'])} {d['object']}.\n" for d in self.demos)

    def prompt(self, subject: str, template: str | None = None) -> str:
        t = template or self.templates[0]
        return self.prefix(t) + t.format(subject)

    def ident_prompts(self) -> list[str]:
        """One prompt per identification fact, templates used in turn."""
        return [self.prompt(f["subject"], self.templates[i % len(self.templates)]) for i, f in enumerate(self.ident)]

    def test_prompts(self) -> list[str]:
        """One prompt per test fact, with the first template (the same for every condition)."""
        return [self.prompt(f["subject"]) for f in self.test]


def split_facts(facts: Sequence[dict], n_ident: int, n_test: int, n_demos: int = 0,
                seed: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """Shuffle ``facts`` with ``seed`` and cut (demos, ident, test), disjoint by subject.

    Duplicate subjects are dropped first (a subject lands in one part only). When there are fewer
    facts than asked for, the demos are served first, then identification and test share the rest
    half and half (never overlapping)."""
    for name, v in {"n_ident": n_ident, "n_test": n_test}.items():
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(n_demos, int) or n_demos < 0:
        raise ValueError(f"n_demos must be a non-negative integer, got {n_demos!r}")
    seen, unique = set(), []
    for f in facts:
        if f["subject"] not in seen:
            seen.add(f["subject"])
            unique.append(dict(f))
    unique.sort(key=lambda f: (f["subject"], f["object"]))  # independent of the file's order
    random.Random(seed).shuffle(unique)
    if len(unique) < n_demos + 2:
        raise ValueError(f"{len(unique)} distinct facts cannot give {n_demos} demos plus identification and test facts")
    demos, rest = unique[:n_demos], unique[n_demos:]
    if len(rest) >= n_ident + n_test:
        return demos, rest[:n_ident], rest[n_ident:n_ident + n_test]
    half = len(rest) // 2
    i = min(n_ident, len(rest) - min(n_test, half))
    return demos, rest[:i], rest[i:i + n_test]


def lre_relations(names: Iterable[str], n_ident: int = 20, n_test: int = 20, shots: int = 0,
                  n_templates: int = 1, seed: int = 0) -> dict[str, Relation]:
    """LRE relations (``lib.data.lre_relation``) split with :func:`split_facts`, in sorted order."""
    from lib import data

    out = {}
    for name in sorted(names):
        r = data.lre_relation(name)
        demos, ident, test = split_facts(r["samples"], n_ident, n_test, shots, seed)
        out[name] = Relation(name, list(r["prompt_templates"][:max(1, n_templates)]), demos, ident, test)
    return out


def klar_relations(lang: str = "eng_Latn", relations: Iterable[str] | None = None, n_ident: int = 20,
                   n_test: int = 20, shots: int = 0, seed: int = 0) -> dict[str, Relation]:
    """KLAR facts of one language as :class:`Relation` objects: the prompt is the question (which
    ends with the language's 'The answer is:'), after ``shots`` answered questions of the same relation.

    The split is by line index, so with the same seed every language gets the *same* facts in
    each part, demonstrations included (KLAR files are line-aligned): identify on English, test on
    the same facts elsewhere."""
    from lib import data

    df = data.klar(lang)
    want = sorted(set(df["relation"]) if relations is None else relations)
    out = {}
    for rel in want:
        rows = df[df["relation"] == rel]
        if rows.empty:
            raise ValueError(f"unknown KLAR relation {rel!r}: use one of {', '.join(sorted(set(df['relation'])))}")
        facts = [{"subject": str(i), "object": a, "question": q} for i, q, a in zip(rows["index"], rows["question"], rows["answer"])]
        demos, ident, test = split_facts(facts, n_ident, n_test, shots, seed)
        for part in (ident, test):
            part.sort(key=lambda f: int(f["subject"]))
        out[rel] = Relation(rel, ["{}"], *([dict(f, index=int(f["subject"]), subject=f["question"]) for f in part]
                                           for part in (demos, ident, test)))
    return out


# ----------------------------------------------------------------------------- accuracy


def is_correct(continuation: str, gold: str) -> bool:
    """A continuation recalls ``gold`` when it starts with it, case-insensitive, after stripping both."""
    g = gold.strip().lower()
    return bool(g) and continuation.strip().lower().startswith(g)


def gold_first_token(lm: Loaded, gold: str, leading_space: bool = True) -> int:
    """Id of the first token of the gold object as it would follow the prompt (' ' + gold)."""
    ids = lm.tokenizer((" " if leading_space else "") + gold.strip(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"gold object {gold!r} has no tokens")
    return int(ids[0])


def zero_edits(neurons) -> list[tuple[int, int, str, float]]:
    """An intervention table that zeroes each (layer, neuron)."""
    return [(int(L), int(i), "zero", 0.0) for L, i in np.asarray(neurons, dtype=int).reshape(-1, 2)]


def greedy_recall(lm: Loaded, prompts: Sequence[str], golds: Sequence[str], off=None, max_new_tokens: int = 4,
                  batch_size: int = 32, max_prompt_tokens: int = 256, progress: bool = False,
                  desc: str = "recall") -> pd.DataFrame:
    """Greedy recall of ``golds``; ``off`` = neurons [(layer, neuron), ...] zeroed at all positions.

    Returns one row per prompt: continuation, correct (bool), rank (of the gold's first token in
    the first step, 0 = the greedy choice) and logprob (of that token)."""
    if len(prompts) != len(golds):
        raise ValueError(f"{len(prompts)} prompts but {len(golds)} gold objects")
    longest = max((len(lm.tokenizer(p)["input_ids"]) for p in prompts), default=0)
    if longest > max_prompt_tokens:
        raise ValueError(f"a prompt has {longest} tokens, more than max_prompt_tokens={max_prompt_tokens}: "
                         "raise it or use fewer shots (a truncated prompt would lose its question)")
    targets = [gold_first_token(lm, g) for g in golds]
    edits = zero_edits(off) if off is not None and len(off) else []
    with hooks.intervene(lm, edits, positions="all"):
        gen = metrics.generate(lm, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                               max_prompt_tokens=max_prompt_tokens, progress=progress, desc=desc,
                               score_tokens=targets)
    return pd.DataFrame({"continuation": gen.continuations,
                         "correct": [is_correct(c, g) for c, g in zip(gen.continuations, golds)],
                         "rank": gen.first_token_rank, "logprob": gen.first_token_logprob})


@dataclass
class TestSet:
    """All test prompts of several relations, evaluated together in one batched pass."""
    prompts: list[str]
    golds: list[str]
    relation: np.ndarray  # [n] relation name of each prompt

    @classmethod
    def of(cls, relations: dict[str, Relation], part: str = "test") -> "TestSet":
        prompts, golds, rel = [], [], []
        for name, r in relations.items():
            ps = r.test_prompts() if part == "test" else [r.prompt(f["subject"]) for f in r.ident]
            facts = r.test if part == "test" else r.ident
            prompts += ps
            golds += [f["object"] for f in facts]
            rel += [name] * len(ps)
        return cls(prompts, golds, np.asarray(rel))

    def only(self, names: Iterable[str] | str) -> "TestSet":
        """The prompts of the named relation(s) only, in the same order."""
        keep = np.isin(self.relation, [names] if isinstance(names, str) else list(names))
        return TestSet([p for p, m in zip(self.prompts, keep) if m], [g for g, m in zip(self.golds, keep) if m],
                       self.relation[keep])

    def run(self, lm: Loaded, off=None, **kw) -> pd.DataFrame:
        df = greedy_recall(lm, self.prompts, self.golds, off=off, **kw)
        df.insert(0, "relation", self.relation)
        return df


def per_relation(df: pd.DataFrame) -> pd.DataFrame:
    """Accuracy, mean log10(1 + rank) and count per relation from :func:`greedy_recall` rows."""
    g = df.assign(log_rank=np.log10(1 + df["rank"].astype(float))).groupby("relation", sort=True)
    return pd.DataFrame({"accuracy": g["correct"].mean(), "log_rank": g["log_rank"].mean(), "n": g.size()})


# ----------------------------------------------------------------------------- neuron scores


def pooled_activations(lm: Loaded, prompts: Sequence[str], starts: Sequence[int] | None = None,
                       batch_size: int = 32, max_length: int = 256, progress: bool = True,
                       desc: str = "pooled activations") -> torch.Tensor:
    """[n_prompts, n_layers, d_mlp] mean activation of every neuron over each prompt's tokens
    (from token ``starts[i]`` on when given, e.g. to skip a shared few-shot prefix)."""
    stats = hooks.mlp_activation_stats(lm, list(prompts), positions="all" if starts is None else "from",
                                       starts=starts, pooled=True, batch_size=batch_size, max_length=max_length,
                                       progress=progress, desc=desc)
    return stats.pooled


def ap_scores(pooled: torch.Tensor, labels: Sequence[str], relations: Sequence[str]) -> torch.Tensor:
    """[n_relations, n_layers, d_mlp]: AP of each neuron's pooled activation as a detector of
    relation r's prompts (positives) among all the other prompts (negatives)."""
    labels = np.asarray(labels)
    n, L, d = pooled.shape
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for {n} pooled rows")
    Y = np.stack([(labels == r).astype(int) for r in relations], 1)  # [n, R]
    ap = metrics.average_precision(pooled.reshape(n, L * d).float(), Y, backend="torch")  # [R, L*d]
    return torch.from_numpy(ap).float().reshape(len(relations), L, d)


def top_neurons(ap: torch.Tensor, k: int) -> np.ndarray:
    """[k, 2] (layer, neuron) of the k highest scores in ``ap`` [n_layers, d_mlp], best first
    (ties broken by position, so the order is deterministic)."""
    L, d = ap.shape
    if not isinstance(k, (int, np.integer)) or not 0 < k <= L * d:
        raise ValueError(f"k must be in 1..{L * d}, got {k!r}")
    flat = ap.reshape(-1).double().numpy()
    order = np.lexsort((np.arange(flat.size), -flat))[:k]
    return np.stack([order // d, order % d], 1)


def random_neurons(like: np.ndarray, n_layers: int, d_mlp: int, seed: int = 0, match_layers: bool = True,
                   exclude: np.ndarray | None = None) -> np.ndarray:
    """A random control set with as many neurons as ``like`` [k, 2].

    match_layers=True draws, in each layer, as many neurons as ``like`` has there (same layer
    distribution); False draws uniformly over all neurons. Neurons in ``exclude`` (default: ``like``)
    are never drawn."""
    like = np.asarray(like, dtype=int).reshape(-1, 2)
    excl = like if exclude is None else np.asarray(exclude, dtype=int).reshape(-1, 2)
    banned = set((excl[:, 0] * d_mlp + excl[:, 1]).tolist())
    rng = np.random.default_rng(seed)
    if match_layers:
        out = []
        for L, c in zip(*np.unique(like[:, 0], return_counts=True)):
            pool = np.setdiff1d(np.arange(d_mlp), [f % d_mlp for f in banned if f // d_mlp == L])
            if len(pool) < c:
                raise ValueError(f"layer {L} has {len(pool)} neurons outside the excluded set, {c} asked for")
            out += [(int(L), int(i)) for i in rng.choice(pool, size=c, replace=False)]
        out = np.asarray(out, dtype=int).reshape(-1, 2)
    else:
        pool = np.setdiff1d(np.arange(n_layers * d_mlp), list(banned))
        flat = rng.choice(pool, size=len(like), replace=False)
        out = np.stack([flat // d_mlp, flat % d_mlp], 1)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def layer_counts(neurons: np.ndarray, n_layers: int) -> np.ndarray:
    """[n_layers] how many of ``neurons`` [k, 2] sit in each layer."""
    return np.bincount(np.asarray(neurons, dtype=int).reshape(-1, 2)[:, 0], minlength=n_layers)


# ----------------------------------------------------------------------------- overlaps and intervals


def overlap_matrix(sets: dict[str, np.ndarray]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(intersection sizes, Jaccard indices) between every pair of neuron sets [k, 2]."""
    names = sorted(sets)
    as_set = {n: set(map(tuple, np.asarray(sets[n]).reshape(-1, 2).tolist())) for n in names}
    inter = pd.DataFrame([[len(as_set[a] & as_set[b]) for b in names] for a in names], index=names, columns=names)
    jac = pd.DataFrame([[len(as_set[a] & as_set[b]) / max(1, len(as_set[a] | as_set[b])) for b in names]
                        for a in names], index=names, columns=names)
    return inter, jac


def chance_overlap(k: int, n_total: int) -> tuple[float, float]:
    """Expected intersection and Jaccard of two independent uniform k-subsets of n_total neurons
    (intersection is hypergeometric: mean k^2 / n_total)."""
    e = k * k / n_total
    return e, e / (2 * k - e)


def is_specific(drop_on_r: float, mean_drop_on_others: float, control_drops: Sequence[float]) -> bool:
    """Notebook 11's rule: r's drop (accuracy lost on r's test facts with r's top-k neurons off) is
    *specific* when it exceeds both the mean drop the same neurons cause on the other relations and
    the **largest** drop among r's random-neuron controls (every control must be beaten)."""
    c = np.asarray(control_drops, dtype=float).ravel()
    if c.size == 0 or not np.isfinite(c).all():
        raise ValueError("is_specific needs at least one finite control drop")
    return bool(drop_on_r > mean_drop_on_others and drop_on_r > c.max())


def max_pair_ap_sum(n_a: int, n_b: int) -> float:
    """The largest AP_a + AP_b one neuron can reach as a one-vs-rest detector of two relations at once,
    with n_a and n_b positive prompts (each relation's prompts are negatives of the other).

    The best case puts both relations' prompts above every other prompt; the sum then depends only on
    how the two are interleaved, and a dynamic programme over (a placed, b placed) finds its maximum
    (placing the i-th a-prompt at rank i + j adds i / (i + j) / n_a). A neuron can sit in the top-k of
    both relations only if this bound reaches the sum of their k-th best APs."""
    for name, v in {"n_a": n_a, "n_b": n_b}.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    f = np.full((n_a + 1, n_b + 1), -np.inf)
    f[0, 0] = 0.0
    for i in range(n_a + 1):
        for j in range(n_b + 1):
            if i:
                f[i, j] = max(f[i, j], f[i - 1, j] + i / (i + j) / n_a)
            if j:
                f[i, j] = max(f[i, j], f[i, j - 1] + j / (i + j) / n_b)
    return float(f[n_a, n_b])


# ----------------------------------------------------------------------------- cached runs


def _fingerprint(*parts) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _model_key(lm: Loaded, model_name: str) -> dict:
    p = next(lm.model.parameters())
    return {"model": model_name, "dtype": str(p.dtype), "device": p.device.type}


def recall(lm: Loaded, model_name: str, tests: TestSet, off=None, max_new_tokens: int = 4, batch_size: int = 32,
           max_prompt_tokens: int = 256, use_cache: bool = True) -> pd.DataFrame:
    """:meth:`TestSet.run` through lib.cache, keyed by the model, the prompts, golds, the neurons
    switched off and the generation settings, so notebooks that ask for the same run share it."""
    from lib import cache

    kw = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "max_prompt_tokens": max_prompt_tokens}
    off_list = [] if off is None else np.asarray(off, dtype=int).reshape(-1, 2).tolist()
    params = {**_model_key(lm, model_name), "run": _fingerprint(tests.prompts, tests.golds, tests.relation.tolist(),
                                                                   off_list, sorted(kw.items()))}
    build = lambda: tests.run(lm, off=off_list or None, **kw)  # noqa: E731
    if not use_cache:
        return build()
    return cache.get_or_build("relation-recall", model_name, params, build, save=lambda df, p: df.to_pickle(p),
                              load=pd.read_pickle, suffix=".pkl")


def identify(lm: Loaded, model_name: str, relations: dict[str, Relation], pool: str = "query",
             batch_size: int = 32, max_length: int = 256, progress: bool = True) -> torch.Tensor:
    """AP scores [n_relations, n_layers, d_mlp] (relations in the dict's order) from the pooled
    activations of every relation's identification prompts, through lib.cache.

    pool 'query': average over the query's tokens only (a shared few-shot prefix is skipped);
    'all': over every token of the prompt. Only the pooled matrix is ever held in memory."""
    from lib import cache

    if pool not in ("query", "all"):
        raise ValueError(f"unknown pool {pool!r}: use 'query' or 'all'")
    prompts, labels, starts = [], [], []
    for name, r in relations.items():
        ps = r.ident_prompts()
        prompts += ps
        labels += [name] * len(ps)
        for j, f in enumerate(r.ident):
            t = r.templates[j % len(r.templates)]
            starts.append(len(lm.tokenizer(r.prefix(t), add_special_tokens=True)["input_ids"]) if r.demos else 0)
    if len(relations) < 2:
        raise ValueError("AP needs at least two relations (the others are the negatives)")
    params = {**_model_key(lm, model_name), "ident": _fingerprint(prompts, labels, pool, max_length)}

    def build():
        pooled = pooled_activations(lm, prompts, starts=starts if pool == "query" else None,
                                    batch_size=batch_size, max_length=max_length, progress=progress,
                                    desc="identification prompts")  # [n_prompts, n_layers, d_mlp]
        return ap_scores(pooled, labels, list(relations))
    return cache.get_or_build("relation-ap", model_name, params, build)


def deactivation_runs(lm: Loaded, model_name: str, tests: TestSet, sets: dict[str, np.ndarray],
                      baseline: bool = True, progress: bool = True, **kw) -> pd.DataFrame:
    """Per-prompt recall on ``tests`` with each neuron set switched off (plus, with ``baseline``, the
    unedited model as condition 'none'): long table with columns relation, continuation, correct,
    rank, logprob, condition, item (the prompt's index in ``tests``)."""

    out = []
    conds = ([("none", None)] if baseline else []) + list(sets.items())
    for name, off in repro.bar(conds, desc="conditions", progress=progress):
        df = recall(lm, model_name, tests, off=off, **kw)
        out.append(df.assign(condition=name, item=np.arange(len(df))))
    return pd.concat(out, ignore_index=True)
