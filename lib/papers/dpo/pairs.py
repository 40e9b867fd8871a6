"""Paper A's preference pairs: greedy (preferred) and steered (dispreferred) continuations of neutral prompts."""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import data, hooks, metrics
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.dpo.probe import Probe
from lib.papers.dpo.sizes import Sizes


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


def preference_pairs(lm: Loaded, probe: Probe, n_pairs: int = Sizes.n_pairs, seed: int = 0,
                     steer_scale: float = Sizes.steer_scale, max_new_tokens: int = Sizes.max_new_tokens,
                     progress: bool = True, offset: int = Sizes.pair_offset, scorer: str = "auto",
                     chunk: int = 32, min_distinct2: float = Sizes.min_distinct2) -> pd.DataFrame:
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
    out = store.measure("preference-pairs", lm.records_name, params, build, device=str(lm.device))
    df = out["pairs"].copy()
    df.attrs.update(n_tried=out["n_tried"], n_looping=out["n_looping"], scorer=out["scorer"])
    return df


def shuffled_pairs(pairs: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """``pairs`` with chosen and rejected swapped in a seeded random half of the rows (``len(pairs) // 2`` of
    them): a control for DPO's preference signal. The texts, the number of pairs and anything trained on them
    keep their sizes, but which side is preferred no longer carries the signal the pairs were built for.
    Every column with a ``_chosen``/``_rejected`` twin (tox_, distinct2_) is swapped with its texts; a new
    boolean column ``swapped`` marks the swapped rows. ``attrs`` are kept, with ``shuffle_seed`` added."""
    for col in ("prompt", "chosen", "rejected"):
        if col not in pairs.columns:
            raise ValueError(f"pairs need a {col!r} column")
    rng = np.random.default_rng(seed)
    swap = np.zeros(len(pairs), dtype=bool)
    swap[rng.choice(len(pairs), size=len(pairs) // 2, replace=False)] = True
    out = pairs.copy().reset_index(drop=True)
    twins = [("chosen", "rejected")] + [(c, c[:-len("chosen")] + "rejected") for c in pairs.columns
                                        if c.endswith("_chosen") and c[:-len("chosen")] + "rejected" in pairs.columns]
    for a, b in twins:
        va, vb = out[a].to_numpy().copy(), out[b].to_numpy().copy()
        out[a], out[b] = np.where(swap, vb, va), np.where(swap, va, vb)
    out["swapped"] = swap
    out.index = pairs.index
    out.attrs = {**pairs.attrs, "shuffle_seed": seed}
    return out


def _tensor_key(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()[:12]


def _pairs_key(pairs: pd.DataFrame) -> str:
    blob = json.dumps(pairs[["prompt", "chosen", "rejected"]].values.tolist())
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


