"""Neuron-level comparison of a base model with a fine-tuned copy (e.g. after DPO) along a direction.

Definitions follow "How Does DPO Reduce Toxicity? A Mechanistic Neuron-Level Analysis" (EMNLP 2025);
nothing here is specific to toxicity or to one model family.

* Activation m_i: the input of the MLP output projection (:mod:`lib.hooks`), averaged over the last
  ``k`` positions of prompt + the model's own greedy continuation (:func:`generation_stats`,
  cached for a base/fine-tuned pair by :func:`pair_stats`).
* Value vector v_i = row i of W_out; cos_i = cosine(v_i, w) (:func:`neuron_cosines`).
* proj_i = mean(m_i) * (v_i . w / |w|), each model with its own value vectors
  (:func:`neuron_projections`); Delta_i = proj_i(base) - proj_i(tuned) (:func:`projection_deltas`),
  > 0 means the neuron writes less along w after fine-tuning.
* Groups (:func:`neuron_groups`): TP (cos > 0, mean base activation > 0), TN (cos > 0, < 0),
  AP (cos < 0, > 0), AN (cos < 0, < 0); :func:`group_shares` splits the positive Delta among them.
* Interventions as :func:`lib.hooks.intervene` tables: :func:`patch_table` (set neurons to the
  tuned model's mean activation) and :func:`editing_table` (edit groups chosen on the base model).

Neuron-indexed tensors are [n_layers, d_mlp]; neuron lists are [(layer, neuron), ...].
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from lib import hooks, metrics, stats
from lib.infra import cache, store
from lib.models import Loaded

GROUPS = ("TP", "TN", "AP", "AN")
# Editing keeps, within each group, the fraction beta of neurons with the highest or lowest |cos|.
EDIT_KEEP = {"TP": "highest", "AN": "highest", "AP": "lowest", "TN": "lowest"}
# Editing scales TP and AN by (1 - alpha) and AP and TN by (1 + alpha).
EDIT_SIGN = {"TP": -1.0, "AN": -1.0, "AP": 1.0, "TN": 1.0}


# ----------------------------------------------------------------------------- activation statistics


def generation_stats(lm: Loaded, prompts: Sequence[str], max_new_tokens: int = 20, k: int = 20,
                     batch_size: int = metrics.GENERATE_BATCH_SIZE, max_prompt_tokens: int = 32,
                     progress: bool = True, desc: str | None = None,
                     pooled: bool = False) -> tuple[hooks.NeuronStats, metrics.Generations]:
    """The model continues each prompt greedily (its own generation); then the per-neuron mean
    activation over the last ``k`` tokens of prompt + continuation. Returns (stats, generations);
    ``stats.mean`` is [n_layers, d_mlp]; with ``pooled``, ``stats.pooled`` is the same mean per prompt,
    [n_prompts, n_layers, d_mlp] (for intervals over prompts)."""
    gen = metrics.generate(lm, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           max_prompt_tokens=max_prompt_tokens, progress=progress,
                           desc=f"{desc or lm.name}: generating")
    # no truncation: it would cut the end of the text, where the counted positions are
    stats = hooks.mlp_activation_stats(lm, gen.full_texts, positions="last_k", k=k, batch_size=batch_size,
                                       max_length=None, pooled=pooled, progress=progress,
                                       desc=f"{desc or lm.name}: activations")
    return stats, gen


# Which texts the two models are measured on (:func:`pair_stats`): 'own', the paper's protocol (each model
# continues the prompts and is read on its own generations); 'base', a variant beyond the paper (both
# models read the base model's prompts + continuations, so a change of activation is not a change of text).
TEXTS = ("own", "base")


def pair_stats(model_name: str, base: Loaded, tuned: Loaded, tuned_params: dict, prompts: Sequence[str],
               max_new_tokens: int = 20, k: int = 20, batch_size: int = metrics.GENERATE_BATCH_SIZE,
               max_prompt_tokens: int = 32, progress: bool = True, texts: str = "own") -> dict:
    """:func:`generation_stats` of a base model and its fine-tuned copy on the same prompts, each
    on its own generations, cached under ``model_name`` + ``tuned_params`` (what identifies the
    fine-tuned model, e.g. the DPO sizes and seed) + the statistics' parameters.

    Returns {"base": [n_layers, d_mlp], "tuned": [n_layers, d_mlp], "base_per_prompt" and
    "tuned_per_prompt" ([n_prompts, n_layers, d_mlp], the same means per prompt, for bootstrap
    intervals over prompts), "base_continuations", "tuned_continuations", "prompts", "count", "texts"}
    (means on the CPU, float32).

    ``texts`` (:data:`TEXTS`) 'base': the same-text variant. The tuned model is read on the base model's
    prompts + continuations at the same last ``k`` positions (one forward pass over them, cached apart);
    "base" and "base_per_prompt" are the base model's own statistics, and "tuned_continuations" are then
    the base model's continuations too, the text both models read."""
    if texts not in TEXTS:
        raise ValueError(f"texts must be one of {', '.join(TEXTS)}, got {texts!r}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("pair_stats needs at least one prompt")
    params = {"tuned": dict(sorted(tuned_params.items())), "prompts": cache.content_hash(prompts),
              "max_new_tokens": max_new_tokens, "k": k, "max_prompt_tokens": max_prompt_tokens, "positions": "last_k",
              "model": base.name}

    def build():
        sb, gb = generation_stats(lm=base, prompts=prompts, max_new_tokens=max_new_tokens, k=k,
                                  batch_size=batch_size, max_prompt_tokens=max_prompt_tokens,
                                  progress=progress, desc="base", pooled=True)
        st, gt = generation_stats(lm=tuned, prompts=prompts, max_new_tokens=max_new_tokens, k=k,
                                  batch_size=batch_size, max_prompt_tokens=max_prompt_tokens,
                                  progress=progress, desc="tuned", pooled=True)
        _PER_PROMPT[(id(base), id(tuned), model_name, str(params))] = {"base": sb.pooled.float(), "tuned": st.pooled.float()}
        return {"base": sb.mean, "tuned": st.mean, "base_continuations": gb.continuations,
                "tuned_continuations": gt.continuations, "prompts": gb.prompts,
                "count": {"base": int(sb.count[0]), "tuned": int(st.count[0])}}

    own = store.measure("neuron-stats", model_name, {**params, "texts": "own"}, build, device=str(base.device))
    per_prompt = _per_prompt_reader(model_name, base, tuned, params, own, k, batch_size, progress)
    if texts == "own":
        return PairStats({**own, "texts": "own"}, per_prompt, "own")
    read = [p + c for p, c in zip(own["prompts"], own["base_continuations"])]  # the base model's full texts

    def build_same():
        st = hooks.mlp_activation_stats(tuned, read, positions="last_k", k=k, batch_size=batch_size, max_length=None,
                                        pooled=True, progress=progress, desc="tuned on the base model's texts")
        _PER_PROMPT[(id(base), id(tuned), model_name, str(params), "same")] = st.pooled.float()
        return {"tuned": st.mean, "count": int(st.count[0])}

    same = store.measure("neuron-stats", model_name, {**params, "texts": "base"}, build_same, device=str(tuned.device))
    return PairStats({**own, "tuned": same["tuned"], "tuned_continuations": own["base_continuations"],
                      "count": {**own["count"], "tuned": same["count"]}, "texts": "base"}, per_prompt, "base")


# The per-prompt means of a build in this process, so that its first reader does not run the models again
_PER_PROMPT: dict = {}


class PairStats(dict):
    """:func:`pair_stats`' result. The record keeps the means and the continuations; the per-prompt means
    ("base_per_prompt", "tuned_per_prompt", [n_prompts, n_layers, d_mlp], for intervals over prompts) are large,
    so they are computed again from the recorded continuations on first use (a forward pass of each model over
    its texts, cached in lib.infra.cache)."""

    def __init__(self, values: dict, per_prompt, texts: str):
        super().__init__(values)
        self._per_prompt, self._texts = per_prompt, texts

    def __missing__(self, key):
        if key not in ("base_per_prompt", "tuned_per_prompt"):
            raise KeyError(key)
        value = self._per_prompt(key.split("_")[0], self._texts)
        self[key] = value
        return value


def _per_prompt_reader(model_name, base, tuned, params, own, k, batch_size, progress):
    def read(which: str, texts: str) -> torch.Tensor:
        memo = _PER_PROMPT.get((id(base), id(tuned), model_name, str(params)))
        if which == "tuned" and texts == "base":
            hit = _PER_PROMPT.get((id(base), id(tuned), model_name, str(params), "same"))
            if hit is not None:
                return hit
        elif memo is not None:
            return memo[which]
        lm = base if which == "base" else tuned
        conts = own["base_continuations"] if which == "base" or texts == "base" else own["tuned_continuations"]
        full = [p + c for p, c in zip(own["prompts"], conts)]
        key = {**params, "which": which, "texts": cache.content_hash(full), "model": lm.name}
        return cache.get_or_build("neuron-stats-per-prompt", model_name, key, lambda: hooks.mlp_activation_stats(
            lm, full, positions="last_k", k=k, batch_size=batch_size, max_length=None, pooled=True, progress=progress,
            desc=f"{which}: per-prompt activations").pooled.float())

    return read


# ----------------------------------------------------------------------------- projections and groups


def _unit(direction: torch.Tensor) -> torch.Tensor:
    d = direction.detach().float().cpu().flatten()  # [d_model]
    n = d.norm()
    if not torch.isfinite(n) or n == 0:
        raise ValueError("the direction must be a finite, non-zero vector")
    return d / n


def _vv(lm_or_vectors) -> torch.Tensor:
    """[n_layers, d_mlp, d_model] value vectors of a model (or the tensor itself), float32 on the CPU."""
    vv = lm_or_vectors if isinstance(lm_or_vectors, torch.Tensor) else hooks.value_vectors(lm_or_vectors)
    return vv.detach().float().cpu()


def neuron_cosines(lm_or_vectors, direction: torch.Tensor) -> torch.Tensor:
    """cos_i = cosine(v_i, w): [n_layers, d_mlp]."""
    return hooks.cosine_with(_vv(lm_or_vectors), _unit(direction))


def neuron_projections(lm_or_vectors, means: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """proj_i = mean(m_i) * (v_i . w / |w|): [n_layers, d_mlp], what neuron i writes along w on average."""
    vv = _vv(lm_or_vectors)  # [n_layers, d_mlp, d_model]
    means = means.detach().float().cpu()
    if means.shape != vv.shape[:2]:
        raise ValueError(f"means has shape {list(means.shape)}, the model's neurons are {list(vv.shape[:2])}")
    return means * (vv @ _unit(direction))  # [n_layers, d_mlp]


def projection_deltas(base, tuned, base_means: torch.Tensor, tuned_means: torch.Tensor,
                      direction: torch.Tensor) -> torch.Tensor:
    """Delta_i = proj_i(base) - proj_i(tuned), each with its own value vectors: [n_layers, d_mlp]."""
    return neuron_projections(base, base_means, direction) - neuron_projections(tuned, tuned_means, direction)


def neuron_groups(cos: torch.Tensor, base_means: torch.Tensor, mask: torch.Tensor | None = None) -> np.ndarray:
    """Group label of every neuron: 'TP', 'TN', 'AP', 'AN' from the signs of cos and of the mean
    base activation, '' where either is exactly 0 or ``mask`` (e.g. Delta > 0) is False.
    Returns a string array [n_layers, d_mlp]."""
    c = cos.detach().cpu().numpy()
    m = base_means.detach().float().cpu().numpy()
    if c.shape != m.shape:
        raise ValueError(f"cos {c.shape} and base_means {m.shape} must have the same shape")
    out = np.full(c.shape, "", dtype="<U2")
    out[(c > 0) & (m > 0)] = "TP"
    out[(c > 0) & (m < 0)] = "TN"
    out[(c < 0) & (m > 0)] = "AP"
    out[(c < 0) & (m < 0)] = "AN"
    if mask is not None:
        out[~np.asarray(mask.detach().cpu().numpy(), dtype=bool)] = ""
    return out


def group_shares(delta: torch.Tensor, cos: torch.Tensor, base_means: torch.Tensor) -> pd.DataFrame:
    """Among neurons with Delta > 0: count, sum of Delta and share (sum / all positive Delta) per group.
    One row per group in GROUPS order; shares sum to 1 (neurons with cos or activation exactly 0,
    if any, fall in no group and make the sum fall short of 1)."""
    pos = delta > 0
    groups = neuron_groups(cos, base_means, pos)
    d = delta.detach().float().cpu().numpy()
    shares = group_share_array(d.ravel(), cos.detach().float().cpu().numpy().ravel(),
                               base_means.detach().float().cpu().numpy().ravel())
    return pd.DataFrame([{"group": g, "count": int((groups == g).sum()), "delta_sum": float(d[groups == g].sum()),
                          "share": float(share)} for g, share in zip(GROUPS, shares)])


def group_share_array(delta: np.ndarray, cos: np.ndarray, base_means: np.ndarray) -> np.ndarray:
    """The share column of :func:`group_shares` (which calls it), for many resamples at once: ``delta`` and
    ``base_means`` [..., n_neurons] (any leading batch axes), ``cos`` [n_neurons] or the same shape.
    Returns [..., 4], the shares of the positive Delta in GROUPS order (nan where no Delta is positive)."""
    d, m = np.asarray(delta), np.asarray(base_means)
    c = np.broadcast_to(np.asarray(cos), d.shape)
    if d.shape != m.shape:
        raise ValueError(f"delta {d.shape} and base_means {m.shape} must have the same shape")
    dp = np.where(d > 0, d, 0)  # Delta of the neurons with Delta > 0
    sums = np.stack([(dp * ((cs * c > 0) & (ms * m > 0))).sum(-1) for cs, ms in _GROUP_SIGNS], -1)
    total = dp.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, sums / total, np.nan)


def group_asymmetry(shares: np.ndarray) -> np.ndarray:
    """(TP + AN) - (TN + AP) of group shares [..., 4] in GROUPS order: the share of the positive change that lowers
    a push along the direction (a toxic-aligned push of a positive activation, TP, or of a negative one, AN) minus
    the share that strengthens a push against it (TN, AP). In [-1, 1]; 0 when both kinds carry half."""
    s = np.asarray(shares, dtype=float)
    if s.shape[-1] != len(GROUPS):
        raise ValueError(f"shares must end in an axis of the {len(GROUPS)} groups {GROUPS}, got shape {s.shape}")
    return s[..., 0] + s[..., 3] - s[..., 1] - s[..., 2]


_GROUP_SIGNS = ((1, 1), (1, -1), (-1, 1), (-1, -1))  # (sign of cos, sign of base mean) of TP, TN, AP, AN


def neuron_frame(base, tuned, base_means: torch.Tensor, tuned_means: torch.Tensor,
                 direction: torch.Tensor) -> pd.DataFrame:
    """One row per neuron: layer, neuron, cos (base value vectors), m_base, m_tuned, proj_base,
    proj_tuned, delta, group (among Delta > 0; '' otherwise)."""
    cos = neuron_cosines(base, direction)
    pb = neuron_projections(base, base_means, direction)
    pt = neuron_projections(tuned, tuned_means, direction)
    delta = pb - pt
    groups = neuron_groups(cos, base_means, delta > 0)
    n_layers, d_mlp = cos.shape
    return pd.DataFrame({
        "layer": np.repeat(np.arange(n_layers), d_mlp), "neuron": np.tile(np.arange(d_mlp), n_layers),
        "cos": cos.flatten().numpy(), "m_base": base_means.float().flatten().cpu().numpy(),
        "m_tuned": tuned_means.float().flatten().cpu().numpy(), "proj_base": pb.flatten().numpy(),
        "proj_tuned": pt.flatten().numpy(), "delta": delta.flatten().numpy(), "group": groups.flatten()})


def top_toxic_neurons(cos: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """The ``n`` neurons whose value vectors have the highest cosine with the direction, best first."""
    if not isinstance(n, int) or not 0 < n <= cos.numel():
        raise ValueError(f"n must be an integer in 1..{cos.numel()}, got {n!r}")
    d_mlp = cos.shape[-1]
    flat = torch.topk(cos.detach().float().cpu().flatten(), n).indices.tolist()
    return [(i // d_mlp, i % d_mlp) for i in flat]


def positive_share(delta: torch.Tensor, neurons: Iterable[tuple[int, int]]) -> float:
    """Share of the positive projection change carried by ``neurons``: sum of their positive Delta
    over the sum of all positive Delta."""
    d = delta.detach().float().cpu().clamp_min(0)
    total = float(d.sum())
    if total <= 0:
        return float("nan")
    chosen = sorted(set((int(L), int(i)) for L, i in neurons))
    if not chosen:
        return 0.0
    L, i = zip(*chosen)
    return float(d[list(L), list(i)].sum()) / total


# ----------------------------------------------------------------------------- intervention tables


def patch_table(neurons: Iterable[tuple[int, int]], means: torch.Tensor) -> pd.DataFrame:
    """A :func:`lib.hooks.intervene` table that sets each neuron to ``means[layer, neuron]`` (e.g.
    the fine-tuned model's mean activation) at every position. Columns layer, neuron, mode, value."""
    m = means.detach().float().cpu()
    rows = [{"layer": int(L), "neuron": int(i), "mode": "set", "value": float(m[L, i])}
            for L, i in sorted(set((int(L), int(i)) for L, i in neurons))]
    return pd.DataFrame(rows, columns=["layer", "neuron", "mode", "value"])


def group_neurons(groups: np.ndarray, names: Iterable[str]) -> list[tuple[int, int]]:
    """(layer, neuron) of every neuron whose label in ``groups`` (from :func:`neuron_groups`) is in ``names``."""
    names = set(names)
    unknown = names - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown group(s) {sorted(unknown)}: use {', '.join(GROUPS)}")
    L, i = np.nonzero(np.isin(groups, sorted(names)))
    return list(zip(L.tolist(), i.tolist()))


EDIT_HOW = ("assign", "scale")


def editing_table(base_means: torch.Tensor, cos: torch.Tensor, alpha: float, beta: float,
                  keep: dict | None = None, how: str = "assign", seed: int = 0) -> pd.DataFrame:
    """Activation editing without training: groups from the base model alone (signs of cos and of
    the mean base activation, every neuron); within each group keep the fraction ``beta`` ranked by
    |cos| (``keep``, default :data:`EDIT_KEEP`: TP and AN highest, AP and TN lowest, as the authors
    code it; 'random' keeps a random fraction, seeded by ``seed``: the matched random-neuron control).

    ``how`` (:data:`EDIT_HOW`): 'assign', the authors' method, sets TP and AN to mean * (1 - alpha) and
    AP and TN to mean * (1 + alpha), with mean the base model's mean activation (mode 'set'); 'scale'
    multiplies each token's own activation by (1 - alpha) or (1 + alpha) (mode 'scale', the
    compendium's earlier variant). Columns layer, neuron, mode, value, group, cos."""
    if not 0 <= float(alpha) <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    if not 0 <= float(beta) <= 1:
        raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    if how not in EDIT_HOW:
        raise ValueError(f"how must be one of {', '.join(EDIT_HOW)}, got {how!r}")
    keep = {**EDIT_KEEP, **(keep or {})}
    if set(keep.values()) - {"highest", "lowest", "random"}:
        raise ValueError("keep maps groups to 'highest', 'lowest' or 'random'")
    groups = neuron_groups(cos, base_means)
    c = cos.detach().float().cpu().numpy()
    m = base_means.detach().float().cpu().numpy()
    rng = np.random.default_rng(seed)
    rows = []
    for g in GROUPS:
        L, i = np.nonzero(groups == g)
        n_keep = int(round(beta * len(L)))
        if n_keep == 0:
            continue
        a = np.abs(c[L, i])
        if keep[g] == "random":
            order = rng.permutation(len(L))[:n_keep]
        else:
            order = np.argsort(-a if keep[g] == "highest" else a, kind="stable")[:n_keep]
        factor = 1.0 + EDIT_SIGN[g] * float(alpha)
        for j in order:
            value = factor * float(m[L[j], i[j]]) if how == "assign" else factor
            rows.append({"layer": int(L[j]), "neuron": int(i[j]), "mode": "set" if how == "assign" else "scale",
                         "value": value, "group": g, "cos": float(c[L[j], i[j]])})
    df = pd.DataFrame(rows, columns=["layer", "neuron", "mode", "value", "group", "cos"])
    return df.sort_values(["layer", "neuron"]).reset_index(drop=True)


def reduction_share(base: float, intervened: float, tuned: float) -> float:
    """(base - intervened) / (base - tuned): the share of the tuned model's reduction that an
    intervention on the base model achieves (nan when the tuned model reduces nothing)."""
    gap = base - tuned
    return (base - intervened) / gap if gap > 0 else float("nan")


def reduction_share_interval(base: Sequence[float], intervened: Sequence[float], tuned: Sequence[float],
                             **kw) -> stats.Estimate:
    """:func:`reduction_share` of the means of per-item values (e.g. per-prompt toxicity, items in the
    same order in all three), with a paired BCa bootstrap interval over the items: the ratio of
    the mean reductions, mean(base - intervened) / mean(base - tuned), is
    ``stats.paired_bootstrap(base - intervened, base - tuned, relative=True)`` + 1. ``kw`` go to
    :func:`lib.stats.paired_bootstrap`."""
    b, i, t = (np.asarray(x, dtype=float) for x in (base, intervened, tuned))
    if not b.shape == i.shape == t.shape:
        raise ValueError(f"per-item values differ in length: {b.size}, {i.size}, {t.size}")
    est = stats.paired_bootstrap(b - i, b - t, relative=True, **kw)
    return stats.Estimate(est.value + 1, est.low + 1, est.high + 1, est.n, est.level,
                          f"{est.method} of the ratio of mean reductions")


# ----------------------------------------------------------------------------- cached reference evaluations


def reference_evaluations(model_name: str, base: Loaded, tuned: Loaded, tuned_params: dict, evaluate,
                          **eval_kwargs) -> dict:
    """``evaluate(lm, **eval_kwargs)`` of the base and the fine-tuned model (notebooks that compare
    interventions with both share them). ``evaluate`` keeps its own records (``lib.papers.dpo.toxicity_perplexity_f1``
    reads and writes the measurement store, keyed by the model, the sizes and the content of the prompts and
    texts), so a second call reads them. ``model_name`` and ``tuned_params`` are kept for callers; the
    evaluated models' names identify them. Returns {"base": ..., "tuned": ...}."""
    return {"base": evaluate(base, **eval_kwargs), "tuned": evaluate(tuned, **eval_kwargs)}


def _compare_stats(c: dict, f: dict) -> list:
    """Mean activations: each model's per-neuron means correlate at r >= 0.99 with the committed ones (they are
    means over the continuations, which greedy decoding on another CPU may change); the share of identical
    continuations, reported."""
    out = []
    for k in ("base", "tuned"):
        if k in c:
            r = float(np.corrcoef(np.asarray(c[k], dtype=float).ravel(), np.asarray(f[k], dtype=float).ravel())[0, 1])
            out.append(store.at_least(f"correlation of the {k} model's mean activations", r, 0.99,
                                      "per-neuron means over the recorded positions"))
    for k in ("base_continuations", "tuned_continuations"):
        if k in c:
            same = float(np.mean([a == b for a, b in zip(c[k], f[k])]))
            out.append(store.info(f"identical {k.replace('_', ' ')} (share)", 1.0, same, "reported"))
    return out


store.step("neuron-stats", 1, "paper A: each model's mean MLP activation per neuron over the last positions of its "
           "(or the base model's) continuations, with the continuations", _compare_stats)


# ----------------------------------------------------------------------------- random control sets


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
