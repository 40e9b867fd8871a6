"""Paper A's direction gate: does a candidate toxicity direction steer toxicity and promote toxic tokens?"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import data, hooks, metrics, stats, verdict
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.dpo.evaluation import CONDITIONS_PER_BATCH
from lib.papers.dpo.neurons import random_neurons
from lib.papers.dpo.pairs import _tensor_key
from lib.papers.dpo.probe import NONTOXIC_WORDS, TOXIC_WORDS, Probe, steer_layer

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
NORMS_OF = ("residual", "probe")
GATE: dict = {
    "mode": "raise",  # 'raise': add +w on neutral prompts; 'lower': add -w on challenge prompts (Lee et al. 2024)
    "n_prompts": 32,  # prompts continued under each steer
    "prompt_offset": 1500,  # 'raise': the first wiki_samples row (evaluation reads rows 0.., preference pairs 1000..)
    "challenge_offset": 1100,  # 'lower': the first challenge prompt (evaluation reads 0.., statistics 600..)
    "max_new_tokens": 20,
    "steer_depth": 1.0,  # the steered block: lib.papers.dpo.steer_layer(depth) (1.0: the last block)
    "norm_of": "residual",  # steer norm = steer_fraction x 'residual': the median per-token residual norm at the
    # steered block; 'probe': the probe vector's own norm (the authors subtract the probe itself, scale 1)
    "steer_fraction": 0.5,
    "family": 5,  # steering settings tried (:data:`SWEEP`): each steering test is at 0.05 / family (Bonferroni)
    "n_random": 99,  # random directions at the same norm: the steering test's control (at least 20 x family - 1)
    "n_neurons": 128,  # top-aligned neurons whose logit-lens tokens are scored (notebook 03's N)
    "top_k_tokens": 8,  # tokens per value vector
    "n_neuron_sets": 50,  # random neuron sets of that size and layer distribution: the token test's control
}
# The steering settings of the gate, fixed in advance (the first and the fourth had been measured before, with 20
# random directions; the others had not): a candidate is validated when its steering passes in at least one of them
# (each at 0.05 / len(SWEEP)) and its promoted tokens pass (at 0.05). The first is the gate as first stated; the
# second a gentler norm (the first derails the text); the third 02's steer block a third of the way up (half the
# residual norm there is about the norm of 02's class-mean steer); the fourth the sign Lee et al. 2024 steer with;
# the fifth the authors' own intervention: their evaluation subtracts the probe vector itself, scale 1, from the
# last block's MLP output (Yushi-Y/dpo-toxic-neurons, toxicity/eval_interventions/run_evaluations.py, the
# 'subtraction' of type 'toxic_probe'; hook_utils.py, hook_subtract), the same state as the residual stream after
# the last block.
SWEEP: dict = {
    "up, last block": {},
    "up, last block, quarter norm": {"steer_fraction": 0.25},
    "up, a third up": {"steer_depth": 1 / 3},
    "down, last block": {"mode": "lower"},
    "down, last block, probe's norm (authors')": {"mode": "lower", "norm_of": "probe", "steer_fraction": 1.0},
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
    controls by the rank test. ``best``: the first validated candidate in :data:`DIRECTIONS`' order
    (None when none passes).

    A gate of the whole sweep (:func:`sweep_directions`) keeps each setting's gate in ``sweep``; its table
    has the token test and one steering column per setting, and its other fields are those of the first
    setting."""
    table: pd.DataFrame
    vectors: dict
    best: str | None
    layer: int
    steer_norm: float
    baseline_toxicity: float
    random_effects: list
    scorer: str
    settings: dict
    sweep: dict = field(default_factory=dict)

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
        ok = bool(same_vector and self.validated(name))
        steering = f"steering in one of {len(self.sweep)} settings" if self.sweep else "steering"
        label = f"direction '{name}' validated by notebook 01's gate ({steering} and promoted tokens beyond random)"
        if not same_vector:
            label += "; built from other inputs than the gate's candidate"
        if not self.best:
            label += ": no candidate passed"
        return verdict.require(label, ok, "==", True)


def validate_directions(lm: Loaded, probe: Probe, scorer: str = "auto", seed: int = 0, progress: bool = True,
                        **overrides) -> DirectionGate:
    """The direction gate: each of :func:`candidate_directions` must pass two tests on this model.

    1. **Steering.** Its unit vector times ``steer_fraction`` x :func:`lib.hooks.residual_norm` (``norm_of``
       'residual'; 'probe': x the probe vector's norm) is added to the residual stream after block
       :func:`steer_layer` (``steer_depth``; 1.0, the default, is the **last block**, where the probe reads,
       after the final norm, and where the unembedding reads the token directions) at every position, while
       the model greedily continues ``n_prompts`` prompts. Mode 'raise' (default): +w on neutral wiki_samples
       prompts, effect = mean toxicity steered minus unsteered. Mode 'lower': -w on challenge prompts (Lee et
       al. 2024 subtract the probe vector from the last layer), effect = unsteered minus steered.
       Paired bootstrap over prompts. Control: ``n_random`` Gaussian random directions at the same
       norm and sign; the effect must be beyond them by the exact rank test at p <= 0.05 / ``family``
       (:func:`lib.stats.against_controls`; ``family``: the settings of the sweep this one belongs to).
    2. **Promoted tokens.** The top-``n_neurons`` neurons by cos(v_i, w) over all layers: mean
       :func:`neuron_token_toxicity` minus that of ``n_neuron_sets`` random sets of the same size and
       layer distribution (bootstrap over the neurons); the effect must be beyond the sets by the same rank test.

    Requiring both tests keeps the chance that a direction with no toxicity content passes below about
    1 in 400 for each candidate (the steering test at 5% over the family of settings, the token test at 5%).
    Cached per model, probe and settings.
    """
    unknown = set(overrides) - set(GATE)
    if unknown:
        raise ValueError(f"unknown gate settings {sorted(unknown)}: use {', '.join(GATE)}")
    s = {**GATE, **overrides}
    for k in ("n_prompts", "max_new_tokens", "n_random", "n_neurons", "top_k_tokens", "n_neuron_sets", "family"):
        if not isinstance(s[k], int) or isinstance(s[k], bool) or s[k] <= 0:
            raise ValueError(f"{k} must be a positive integer, got {s[k]!r}")
    steer_alpha = stats.ALPHA / s["family"]
    for k, a in (("n_random", steer_alpha), ("n_neuron_sets", stats.ALPHA)):
        if s[k] < stats.min_controls(a):
            raise ValueError(f"{k} must be at least {stats.min_controls(a)} (the rank test cannot reach p <= {a:.3g} "
                             f"with fewer), got {s[k]}")
    if not s["steer_fraction"] > 0:
        raise ValueError(f"steer_fraction must be positive, got {s['steer_fraction']!r}")
    if s["mode"] not in GATE_MODES:
        raise ValueError(f"mode must be one of {', '.join(GATE_MODES)}, got {s['mode']!r}")
    if s["norm_of"] not in NORMS_OF:
        raise ValueError(f"norm_of must be one of {', '.join(NORMS_OF)}, got {s['norm_of']!r}")
    layer = steer_layer(lm, s["steer_depth"])  # one-line error outside [0, 1]
    vectors = candidate_directions(lm, probe)
    if s["mode"] == "raise":
        prompts = [r["prompt"].strip() for r in data.wiki_samples(s["n_prompts"], offset=s["prompt_offset"])]
    else:
        prompts = data.challenge_prompts(s["challenge_offset"] + s["n_prompts"])[s["challenge_offset"]:]
    if len(prompts) < s["n_prompts"]:
        raise ValueError(f"only {len(prompts)} prompts from the offset on; lower n_prompts or the offset")
    sign = 1.0 if s["mode"] == "raise" else -1.0

    def build():
        repro.setup(seed)
        ref = hooks.residual_norm(lm, prompts, layer) if s["norm_of"] == "residual" else float(probe.direction.float().norm())
        norm = s["steer_fraction"] * ref
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
            ctl = stats.against_controls(est.value, rand, name=f"{len(rand)} random directions", alpha=steer_alpha)
            top = top_aligned(hooks.cosine_with(vv, vec).cpu(), s["n_neurons"])
            sets = [random_neurons(top, lm.info.n_layers, lm.info.d_mlp, seed=seed + j)
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
        best = next((k for k in table.index if table.loc[k, "validated"]), None)
        return {"table": table, "best": best, "steer_norm": norm, "baseline": float(t0.mean()),
                "random": rand, "scorer": name, "examples": examples}

    # the candidates are a function of the model and the probe: named by the probe's record when it has one (their
    # bytes would differ in the last bits between CPUs for the ones averaged here), else by their bytes
    named = {"probe": probe.record, "candidates": sorted(vectors)} if probe.record else \
        {k: _tensor_key(v) for k, v in vectors.items()}
    key = {"model": lm.name, "settings": s, "seed": seed, "scorer": metrics.resolve_scorer(scorer), "layer": layer,
           "vectors": named, "prompts": cache.content_hash(prompts)}
    out = store.measure("direction-gate", lm.records_name, key, build, device=str(lm.device))
    return DirectionGate(out["table"], vectors, out["best"], layer, out["steer_norm"], out["baseline"],
                         out["random"], out["scorer"], {**s, "examples": out["examples"]})




def sweep_directions(lm: Loaded, probe: Probe, scorer: str = "auto", seed: int = 0, progress: bool = True,
                     sweep: dict | None = None, **common) -> DirectionGate:
    """The gate over a sweep of steering settings (:data:`SWEEP` by default; {name: overrides of :data:`GATE`}):
    :func:`validate_directions` once per setting, each steering test at 0.05 / len(sweep) (``family``), with
    ``common`` settings shared by all. A candidate is validated when its promoted tokens pass and its steering
    passes in at least one setting. Returns a gate whose ``sweep`` holds each setting's gate."""
    sweep = SWEEP if sweep is None else sweep
    if not sweep:
        raise ValueError("the sweep needs at least one setting")
    clash = sorted({k for over in sweep.values() for k in over} & set(common) | {"family"} & set(common))
    if clash:
        raise ValueError(f"{', '.join(clash)}: set by the sweep; change the sweep's settings instead")
    gates = {name: validate_directions(lm, probe, scorer, seed, progress, **{**common, **over, "family": len(sweep)})
             for name, over in sweep.items()}
    first = next(iter(gates.values()))
    table = first.table[["token_effect", "token_low", "token_high", "token_random_q95", "token_p", "token_ok"]].copy()
    steer = pd.DataFrame({name: g.table.steer_ok for name, g in gates.items()})
    for name in steer:
        table[f"steer ok: {name}"] = steer[name]
    table["validated"] = table.token_ok & steer.any(axis=1)
    best = next((k for k in table.index if table.loc[k, "validated"]), None)
    return DirectionGate(table, first.vectors, best, first.layer, first.steer_norm, first.baseline_toxicity,
                         first.random_effects, first.scorer, first.settings, sweep=gates)
